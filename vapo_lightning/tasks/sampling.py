"""Seeded drawing of task rows and disjoint train / validation splits, shared by tasks.

A task supplies ``make_problem(rng, difficulty) -> row`` (a dict with a ``"prompt"``);
`draw` cycles the difficulties evenly and keeps prompts out of `exclude`, and `disjoint_splits`
draws validation first and train excluding it.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterable
from pathlib import Path

from vapo_lightning.jsonl import write_jsonl

__all__ = ["disjoint_splits", "draw", "splits_main"]

MakeProblem = Callable[[random.Random, int], dict]


def draw(
    make_problem: MakeProblem,
    n: int,
    seed: int,
    difficulties: Iterable[int],
    exclude: Iterable[str] = (),
    distinct: bool = True,
) -> list[dict]:
    """`n` rows, difficulties cycled evenly, none whose prompt is in `exclude`.

    With `distinct`, no prompt repeats; with ``distinct=False`` repeats are allowed (large SFT
    sets), exclusions still hold.
    """
    rng = random.Random(seed)
    levels = list(difficulties)
    seen = set(exclude)
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct problems from difficulties {levels}")
        row = make_problem(rng, levels[len(rows) % len(levels)])
        if row["prompt"] not in seen:
            if distinct:
                seen.add(row["prompt"])
            rows.append(row)
    return rows


def disjoint_splits(
    generate: Callable[..., list[dict]], n_train: int, n_val: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation rows of ``generate(n, seed, exclude=...)``: validation
    first (`seed`), train drawn excluding it (``seed + 1``)."""
    val = generate(n_val, seed=seed)
    train = generate(n_train, seed=seed + 1, exclude=[r["prompt"] for r in val])
    return train, val


def splits_main(
    make_splits: Callable[[int, int, int], tuple[list[dict], list[dict]]],
    description: str,
    n_train: int,
    n_val: int,
    args: list[str] | None = None,
) -> None:
    """The command line of a task module: ``--out DIR`` gets ``train.jsonl`` / ``val.jsonl``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="folder for train.jsonl and val.jsonl")
    parser.add_argument("--n-train", type=int, default=n_train)
    parser.add_argument("--n-val", type=int, default=n_val)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(args)
    out = Path(ns.out)
    for name, rows in zip(("train", "val"), make_splits(ns.n_train, ns.n_val, ns.seed)):
        write_jsonl(rows, out / f"{name}.jsonl")
    print(f"wrote {ns.n_train} train and {ns.n_val} val problems to {out}")
