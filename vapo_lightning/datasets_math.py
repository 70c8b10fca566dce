"""Public math datasets as the prompt rows `PromptDataModule` reads by default.

Each output line is ``{"prompt": <problem text>, "answer": <gold answer>, "data_source": <name>,
...}`` plus the row's short metadata (level, type, year, ...), which reaches rewards as
``Sample.extra_info``. The prompt is the bare problem: the configs add the instruction with
``data.prompt_template`` and ``data.chat_template``, so training and validation rows get the same
one. Formats (the layouts of the public releases) and the hub dataset each reads by default:

- ``gsm8k``: question; answer = the number after the solution's ``####``, commas removed
  (``#### 1,234`` -> ``1234``). openai/gsm8k, subset main, split train.
- ``math``: problem; answer, else the last ``\\boxed{}`` of solution (the MATH training set has
  only solutions). DigitalLearningGmbH/MATH-lighteval, train.
- ``dapo``: verl's parquet layout: prompt (chat messages; DAPO's "Answer:" instruction around
  the problem is removed), reward_model.ground_truth. BytedTsinghua-SIA/DAPO-Math-17k, train.
- ``aime2024``, ``amc``, ``math500``: problem, answer (AMC's 142.0 -> 142), the layouts of the
  deepscaler copies. HuggingFaceH4/aime_2024 (train), AI-MO/aimo-validation-amc (train),
  HuggingFaceH4/MATH-500 (test).

A source is a local ``.jsonl`` / ``.json`` (a list of objects) / ``.parquet`` file, a directory
of one-problem ``.json`` files (the original MATH release), or a hub dataset id (downloaded
with `datasets`; ``--config`` / ``--split`` choose the subset). Integer answers lose leading
zeros (AIME's ``025`` -> ``25``). Rows repeating an earlier (prompt, answer) are dropped: the hub
copy of DAPO-Math-17k holds its ~17k prompts about 100 times each. Every unusable row is
reported as ``file:line`` (``file:item N`` in a JSON list, ``file:row N`` in a parquet file)
with the reason, and nothing is written unless all rows convert (or ``--skip-bad-rows``).

    python -m vapo_lightning.datasets_math gsm8k --out data/gsm8k_train.jsonl
    python -m vapo_lightning.datasets_math aime2024 path/to/aime2024.json --out data/aime2024.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vapo_lightning.data import DataError, read_rows
from vapo_lightning.jsonl import write_jsonl
from vapo_lightning.rewards.math import extract_answer
from vapo_lightning.rewards.math_answers import number_text

__all__ = ["FORMATS", "Conversion", "convert", "last_boxed", "main", "parser", "write_jsonl"]


class RowError(ValueError):
    """A row cannot be converted; the caller adds its file and line."""


@dataclass
class Item:
    """One converted row: the problem, its gold answer, and short metadata."""

    problem: str
    answer: str
    data_source: str | None = None  # the row's own (verl layout); --data-source overrides it
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------- field helpers

_INTEGER = re.compile(r"[+-]?\d+")
_GSM8K_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_MAX_META_CHARS = 200  # longer strings (solutions, urls of long pages) are not metadata
# DAPO-Math-17k's prompt: "Solve the following math problem step by step. The last line of
# your response should be of the form Answer: $Answer ...\n\n{problem}\n\nRemember to put
# your answer on its own line after "Answer:"."
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:"'


def _text(raw: dict, key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"field '{key}' must be a non-empty string, got {value!r:.60}")
    return value.strip()


def _answer(value: Any, key: str) -> str:
    """A gold answer as a string: 142.0 -> "142", 1e-05 -> "0.00001", "025" -> "25", LaTeX
    unchanged."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (str, int, float))
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise RowError(f"field '{key}' must be a string or a number, got {value!r:.60}")
    text = (value if isinstance(value, str) else number_text(value)).strip()
    if not text:
        raise RowError(f"field '{key}' is empty")
    return str(int(text)) if _INTEGER.fullmatch(text) else text


def _metadata(raw: dict, used: set[str]) -> dict[str, Any]:
    """Short scalar fields of the row (and of a nested ``extra_info``), for ``extra_info``."""
    nested = raw.get("extra_info")
    flat = {**raw, **(nested if isinstance(nested, dict) else {})}
    skip = used | set(OUTPUT_FIELDS)
    return {
        k: v
        for k, v in flat.items()
        if k not in skip
        and isinstance(v, (str, int, float, bool))
        and not (isinstance(v, str) and len(v) > _MAX_META_CHARS)
    }


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{}`` / ``\\fbox{}`` of `text`, by the math reward's
    `extract_answer` on the text from that box on; None when there is no box."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    return None if start < 0 else extract_answer(text[start:])


# ----------------------------------------------------------------------------- formats


def gsm8k_item(raw: dict) -> Item:
    """openai/gsm8k: the answer is the number after the solution's ``####``."""
    question, solution = _text(raw, "question"), _text(raw, "answer")
    if "####" not in solution:
        raise RowError("field 'answer' has no '#### <number>' final answer")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not _GSM8K_NUMBER.fullmatch(answer):
        raise RowError(f"the final answer after '####' is not a number: {answer!r:.40}")
    return Item(question, _answer(answer, "answer"))


def math_item(raw: dict) -> Item:
    """MATH / MATH-500 / AIME / AMC: ``answer`` if the row has one, else the last box of
    ``solution`` (the MATH training set has only solutions)."""
    problem = _text(raw, "problem")
    if raw.get("answer") not in (None, ""):
        answer = _answer(raw["answer"], "answer")
    else:
        answer = last_boxed(_text(raw, "solution"))
        if answer is None:
            raise RowError("no 'answer' field and no \\boxed{} answer in field 'solution'")
        answer = _answer(answer, "solution")
    return Item(problem, answer, extra=_metadata(raw, {"problem", "answer", "solution"}))


def dapo_item(raw: dict) -> Item:
    """verl's parquet layout (DAPO-Math-17k): the user message of ``prompt``, with DAPO's
    instruction around the problem removed; the answer in ``reward_model.ground_truth``."""
    prompt = raw.get("prompt")
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowError(f"field 'prompt' has no user message with text, got {raw.get('prompt')!r:.60}")
    problem = prompt.strip()
    if problem.startswith(_DAPO_HEAD) and "\n\n" in problem:
        problem = problem.split("\n\n", 1)[1]
    problem = problem.split(_DAPO_TAIL, 1)[0].strip()
    if not problem:
        raise RowError("field 'prompt' holds DAPO's instruction but no problem")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") in (None, ""):
        raise RowError(f"field 'reward_model.ground_truth' is missing, got {reward_model!r:.60}")
    source = raw.get("data_source")
    return Item(
        problem,
        _answer(reward_model["ground_truth"], "reward_model.ground_truth"),
        data_source=source if isinstance(source, str) and source else None,
        extra=_metadata(raw, {"prompt", "reward_model", "extra_info"}),
    )


@dataclass(frozen=True)
class Format:
    """How to read one public dataset and where it lives on the hub."""

    item: Callable[[dict], Item]
    data_source: str
    hub: str
    hub_config: str | None
    hub_split: str


FORMATS: dict[str, Format] = {
    "gsm8k": Format(gsm8k_item, "gsm8k", "openai/gsm8k", "main", "train"),
    "math": Format(math_item, "math", "DigitalLearningGmbH/MATH-lighteval", None, "train"),
    "dapo": Format(dapo_item, "math_dapo", "BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
    "aime2024": Format(math_item, "aime2024", "HuggingFaceH4/aime_2024", None, "train"),
    "amc": Format(math_item, "amc", "AI-MO/aimo-validation-amc", None, "train"),
    "math500": Format(math_item, "math500", "HuggingFaceH4/MATH-500", None, "test"),
}
OUTPUT_FIELDS = ("prompt", "answer", "data_source")  # PromptDataModule's default field names


# ------------------------------------------------------------------------------ reading


def _hub_rows(name: str, config: str | None, split: str) -> Iterator[tuple[str, dict]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as err:
        raise DataError(
            f"{name}: not a local file or directory, and loading it from the hub "
            f"(config={config}, split={split}) failed: {err}"
        ) from err
    for i, row in enumerate(ds):
        yield f"{name}:{split}:row {i}", row


def _directory_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """The original MATH release: one problem object per ``.json`` file."""
    files = sorted(path.rglob("*.json"))
    if not files:
        raise DataError(f"{path}: directory holds no .json files")
    for file in files:
        try:
            yield str(file), json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{file}:{err.lineno}: malformed JSON ({err.msg})") from None


def iter_source(
    source: str,
    fmt: Format,
    config: str | None,
    split: str | None,
    malformed: list[str] | None = None,
):
    """Yields (location, raw row) from a local file or directory, or from the hub; a .jsonl
    line that is not JSON goes to `malformed` (see `read_rows`)."""
    path = Path(source)
    if path.is_dir():
        return _directory_rows(path)
    if path.suffix in (".jsonl", ".json", ".parquet") and not path.exists():
        raise DataError(f"{source}: file does not exist")
    if path.exists():
        return read_rows(source, malformed)
    return _hub_rows(source, config or fmt.hub_config, split or fmt.hub_split)


# --------------------------------------------------------------------------- converting


@dataclass
class Conversion:
    """What `convert` made: the rows, the bad rows' messages, the duplicates dropped."""

    rows: list[dict[str, Any]]
    errors: list[str]
    duplicates: int


def convert(
    format_name: str,
    sources: Sequence[str] = (),
    config: str | None = None,
    split: str | None = None,
    data_source: str | None = None,
) -> Conversion:
    """Converts `sources` (default: the format's hub dataset) to prompt rows. A row that cannot
    be converted, or a .jsonl line that is not JSON, becomes an error message naming its file
    and line; any other malformed file raises `DataError` at once."""
    if format_name not in FORMATS:
        raise ValueError(f"unknown format {format_name!r}; choose one of {sorted(FORMATS)}")
    fmt = FORMATS[format_name]
    rows, errors, seen, duplicates = [], [], set(), 0
    for source in sources or [fmt.hub]:
        for where, raw in iter_source(source, fmt, config, split, errors):
            try:
                if not isinstance(raw, dict):
                    raise RowError(f"expected an object, got {type(raw).__name__}")
                item = fmt.item(raw)
            except RowError as err:
                errors.append(f"{where}: {err}")
                continue
            if (item.problem, item.answer) in seen:
                duplicates += 1
                continue
            seen.add((item.problem, item.answer))
            source_name = data_source or item.data_source or fmt.data_source
            rows.append({"prompt": item.problem, "answer": item.answer, "data_source": source_name} | item.extra)
    return Conversion(rows, errors, duplicates)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m vapo_lightning.datasets_math",
        description="Convert a public math dataset into prompt rows (prompt, answer, data_source).",
    )
    ap.add_argument("format", choices=sorted(FORMATS))
    ap.add_argument("sources", nargs="*", help="local files / directories or hub ids (default: the format's)")
    ap.add_argument("--out", required=True, help="the .jsonl file to write")
    ap.add_argument("--config", help="hub subset (default: the format's, e.g. gsm8k: main)")
    ap.add_argument("--split", help="hub split (default: the format's, e.g. train)")
    ap.add_argument("--data-source", help="the rows' data_source (default: the format's name)")
    ap.add_argument("--skip-bad-rows", action="store_true", help="write the good rows, report the others")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        result = convert(args.format, args.sources, args.config, args.split, args.data_source)
    except DataError as err:
        sys.exit(f"error: {err}")
    for message in result.errors[:20]:
        print(f"bad row: {message}", file=sys.stderr)
    if len(result.errors) > 20:
        print(f"... and {len(result.errors) - 20} more bad rows", file=sys.stderr)
    if result.errors and not args.skip_bad_rows:
        sys.exit(f"error: {len(result.errors)} bad rows; nothing written (--skip-bad-rows skips them)")
    if not result.rows:
        sys.exit("error: no rows to write")
    write_jsonl(result.rows, args.out)
    print(
        f"{args.out}: {len(result.rows)} rows ({args.format}); dropped {result.duplicates} "
        f"duplicates, skipped {len(result.errors)} bad rows"
    )


if __name__ == "__main__":
    main()
