"""JSON Lines files: one object per line, read and written the same way everywhere."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["read_jsonl", "write_jsonl"]


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of a JSON Lines file; blank lines are skipped."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: Iterable[dict], out: str | Path) -> Path:
    """Writes one JSON object per line, through a temporary file and a rename (a reader
    never sees half a file); creates the folder. Returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out
