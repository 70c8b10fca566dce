"""A synthetic, verifiable reasoning task: multi-step arithmetic with a chain of thought.

A problem starts from a small number and applies `difficulty` labelled additions or
subtractions of a digit (1 to 10 of them) in order:
``Start at 17. a) + 8 b) - 3 c) + 9``. The reference solution works one labelled operation per
sentence (``a) 17 + 8 = 25. b) 25 - 3 = 22. ...``) and ends with ``\\boxed{N}``; the labels let
a small model find the next operation by matching, so what it must learn is the arithmetic. Each step is easy; the difficulty is carrying the state through a
long chain without a slip, so a small model's accuracy falls with length. With the project's
digit-splitting BPE a correct response is about 17 tokens at difficulty 1 and ~140 at
difficulty 10, so the length-adaptive λ_actor = 1 − 1/(0.05·l) (VAPO §4.2) spans 0 to ~0.86.

Everything is seeded: `generate(n, seed)` returns the same rows on every machine, and
`make_splits` gives disjoint train / validation problems (no prompt in both). Rows are
``{"prompt", "answer", "solution", "data_source": "arithmetic", "difficulty"}``.

    python -m vapo_lightning.tasks.arithmetic --out vapo_lightning/assets/arithmetic
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence

from vapo_lightning.jsonl import read_jsonl, write_jsonl
from vapo_lightning.tasks.sampling import disjoint_splits, draw, splits_main

__all__ = [
    "DATA_SOURCE",
    "MAX_DIFFICULTY",
    "boxed",
    "evaluate",
    "extract_boxed_int",
    "generate",
    "is_correct",
    "make_problem",
    "make_splits",
    "read_jsonl",
    "solve",
    "write_jsonl",
]

DATA_SOURCE = "arithmetic"
MAX_DIFFICULTY = 10
PROMPT_PREFIX = "Start at "
LABELS = "abcdefghij"
MAX_VALUE = 40  # every intermediate value stays in [0, MAX_VALUE]
MAX_OPERAND = 9

Op = tuple[str, int]  # ("+" | "-", operand)


def evaluate(start: int, ops: Sequence[Op]) -> int:
    """The value of ``start op1 b1 op2 b2 ...`` read strictly from left to right."""
    x = start
    for op, b in ops:
        x = x + b if op == "+" else x - b
    return x


def boxed(value: int | str) -> str:
    """The final answer as every solution of the task ends: ``\\boxed{N}``."""
    return f"\\boxed{{{value}}}"


def solve(start: int, ops: Sequence[Op]) -> str:
    """The reference chain of thought, one labelled sentence per operation, then ``\\boxed{N}``."""
    steps, x = [], start
    for label, (op, b) in zip(LABELS, ops):
        y = evaluate(x, [(op, b)])
        steps.append(f"{label}) {x} {op} {b} = {y}.")
        x = y
    return " ".join(steps) + " " + boxed(x)


def _random_op(rng: random.Random, x: int) -> Op:
    """Adds or subtracts a digit, keeping the running value in [0, MAX_VALUE]."""
    op = "+" if x < 1 else "-" if x > MAX_VALUE - 1 else rng.choice("+-")
    room = MAX_VALUE - x if op == "+" else x
    return op, rng.randint(1, min(MAX_OPERAND, room))


def make_problem(rng: random.Random, difficulty: int) -> dict:
    """One row with `difficulty` operations, drawn from `rng`."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in [1, {MAX_DIFFICULTY}], got {difficulty}")
    start = rng.randint(2, 30)
    ops, x = [], start
    for _ in range(difficulty):
        op = _random_op(rng, x)
        ops.append(op)
        x = evaluate(x, [op])
    prompt = f"{PROMPT_PREFIX}{start}. " + " ".join(f"{label}) {op} {b}" for label, (op, b) in zip(LABELS, ops))
    return {
        "prompt": prompt,
        "answer": str(x),
        "solution": solve(start, ops),
        "data_source": DATA_SOURCE,
        "difficulty": difficulty,
    }


def generate(
    n: int,
    seed: int,
    difficulties: Iterable[int] = range(1, MAX_DIFFICULTY + 1),
    exclude: Iterable[str] = (),
    distinct: bool = True,
) -> list[dict]:
    """`n` problems, difficulties cycled evenly, none whose prompt is in `exclude`.

    With `distinct`, no prompt repeats (difficulty 1 has only ~2,500 distinct problems); with
    ``distinct=False`` repeats are allowed (large SFT sets), exclusions still hold.
    """
    return draw(make_problem, n, seed, difficulties, exclude, distinct)


def make_splits(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation problems: validation first, train drawn excluding it."""
    return disjoint_splits(generate, n_train, n_val, seed)


_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def extract_boxed_int(text: str) -> int | None:
    """The integer in the last ``\\boxed{...}`` of `text`, or None if there is none."""
    found = _BOXED.findall(text)
    return int(found[-1]) if found else None


def is_correct(response: str, answer: str | int) -> bool:
    """A local checker: the last boxed integer equals the gold answer."""
    got = extract_boxed_int(response)
    return got is not None and got == int(answer)


def main(args: list[str] | None = None) -> None:
    splits_main(make_splits, __doc__.split("\n")[0], n_train=2048, n_val=200, args=args)


if __name__ == "__main__":
    main()
