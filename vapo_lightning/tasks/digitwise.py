"""A synthetic task for token-level credit assignment: digit-by-digit sums mod 10.

A problem gives two K-digit numbers, K = `difficulty` from 2 to 28:
``Add digit by digit, mod 10: 4719 + 3582``. The reference solution works one digit pair per
step, left to right, then boxes the digits it wrote: ``4+3=7 7+5=2 1+8=9 9+2=1 \\boxed{7291}``.
It has the three properties VAPO's argument is about (arXiv 2504.05118, §3-4):

- long responses of very different lengths: with the project's digit-splitting BPE a
  correct response is 8 tokens per digit (7 for the step, 1 in the box) plus 5, 18 tokens at
  K = 2 and 229 at K = 28, so the length-adaptive λ_actor = 1 − 1/(0.05·l) (§4.2) spans 0
  to 0.91;
- one verifiable outcome at the end: the boxed number, exactly;
- local mistakes: each step depends on two prompt digits only, so one wrong digit anywhere
  makes the answer wrong while every other step stays right. A critic that reads the step can
  tell where a response went wrong; a group mean cannot.

The SFT warm start learns from demonstrations with slips (`with_slips`: each step's result
replaced by another digit with probability `slip_rate`, and the box copies the working, as a
careless writer would), so at temperature 1 it errs at about that rate per step and exact
success falls with K: (1 − 0.075)^K is 0.86 at K = 2 and 0.11 at K = 28 for a 7.5 % slip rate.

Everything is seeded: `generate(n, seed)` returns the same rows on every machine;
`make_splits` gives disjoint train / validation problems. Rows are ``{"prompt", "answer",
"solution", "data_source": "digitwise", "difficulty"}``; the answer never starts with 0.

    python -m vapo_lightning.tasks.digitwise --out vapo_lightning/assets/digitwise
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence

from vapo_lightning.tasks.sampling import disjoint_splits, draw, splits_main

__all__ = [
    "DATA_SOURCE",
    "MAX_DIGITS",
    "MIN_DIGITS",
    "check",
    "extract_answer",
    "generate",
    "is_correct",
    "make_problem",
    "make_splits",
    "solve",
    "with_slips",
]

DATA_SOURCE = "digitwise"
MIN_DIGITS, MAX_DIGITS = 2, 28
PROMPT_PREFIX = "Add digit by digit, mod 10: "


def solve(a: str, b: str, sums: Sequence[int] | None = None) -> str:
    """The worked solution: one ``x+y=z`` step per digit pair, then ``\\boxed{z...}``.
    `sums` overrides the step results (a demonstration with slips); default: the true ones."""
    sums = [(int(x) + int(y)) % 10 for x, y in zip(a, b)] if sums is None else sums
    steps = [f"{x}+{y}={z}" for x, y, z in zip(a, b, sums)]
    return " ".join(steps) + " \\boxed{" + "".join(map(str, sums)) + "}"


def make_problem(rng: random.Random, difficulty: int) -> dict:
    """Two `difficulty`-digit numbers (no leading zeros, nor in the answer), drawn from `rng`."""
    if not MIN_DIGITS <= difficulty <= MAX_DIGITS:
        raise ValueError(f"difficulty must be in [{MIN_DIGITS}, {MAX_DIGITS}], got {difficulty}")
    a0 = rng.randint(1, 9)
    b0 = rng.choice([d for d in range(1, 10) if (a0 + d) % 10])
    a = str(a0) + "".join(str(rng.randint(0, 9)) for _ in range(difficulty - 1))
    b = str(b0) + "".join(str(rng.randint(0, 9)) for _ in range(difficulty - 1))
    answer = "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b))
    return {
        "prompt": f"{PROMPT_PREFIX}{a} + {b}",
        "answer": answer,
        "solution": solve(a, b),
        "data_source": DATA_SOURCE,
        "difficulty": difficulty,
    }


def generate(
    n: int,
    seed: int,
    difficulties: Iterable[int] = range(MIN_DIGITS, MAX_DIGITS + 1),
    exclude: Iterable[str] = (),
    distinct: bool = True,
) -> list[dict]:
    """`n` problems, digit counts cycled evenly, none whose prompt is in `exclude`."""
    return draw(make_problem, n, seed, difficulties, exclude, distinct)


def make_splits(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation problems: validation first, train drawn excluding it."""
    return disjoint_splits(generate, n_train, n_val, seed)


def with_slips(row: dict, rng: random.Random, slip_rate: float) -> dict:
    """The row with a demonstration in which each step's result is, with probability
    `slip_rate`, replaced by one of the nine wrong digits; the box copies the working."""
    a, b = row["prompt"][len(PROMPT_PREFIX) :].split(" + ")
    sums = [(int(x) + int(y)) % 10 for x, y in zip(a, b)]
    sums = [rng.choice([d for d in range(10) if d != z]) if rng.random() < slip_rate else z for z in sums]
    return {**row, "solution": solve(a, b, sums)}


_BOXED = re.compile(r"\\boxed\{\s*(\d+)\s*\}")


def extract_answer(text: str) -> str | None:
    """The digit string in the last ``\\boxed{...}`` of `text`, or None if there is none."""
    found = _BOXED.findall(text)
    return found[-1] if found else None


def is_correct(response: str, answer: str) -> bool:
    """The verifier: the last boxed digit string equals the answer exactly."""
    return extract_answer(response) == str(answer)


def check(responses: Sequence[str], rows: Sequence[dict]) -> list[bool]:
    return [is_correct(r, row["answer"]) for r, row in zip(responses, rows)]


def main(args: list[str] | None = None) -> None:
    splits_main(make_splits, __doc__.split("\n")[0], n_train=4096, n_val=135, args=args)


if __name__ == "__main__":
    main()
