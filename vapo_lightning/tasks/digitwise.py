"""A synthetic task for token-level credit assignment: digit-by-digit sums mod 10.

A problem lists K labelled digit pairs, K = `difficulty` from 2 to 26 (labels a to z):
``Add each pair mod 10: a43 b75 c18``. The reference solution works one pair per
labelled step, in order: ``a) 4+3=7 b) 7+5=2 c) 1+8=9``; the answer is the digits it wrote,
``729``. The labels let a small model find the next pair by matching, as in the arithmetic
task (the label and its two digits sit together, so one position of the prompt holds a whole
pair), and what it must get right is each step. The task has the three properties VAPO's
argument is about (arXiv 2504.05118, §3-4):

- long responses of very different lengths: with the project's digit-splitting BPE a
  correct response is 8 tokens per step plus EOS, 17 tokens at K = 2 and 209 at K = 26, so the
  length-adaptive λ_actor = 1 − 1/(0.05·l) (§4.2) spans 0 to 0.90;
- one verifiable outcome at the end (`is_correct`: the whole response is the K steps, and the
  digits they write are the answer);
- local mistakes: each step depends on its own pair only, so one wrong digit anywhere makes
  the answer wrong while every other step stays right. A critic that reads the step can tell
  where a response went wrong; a group mean cannot.

The SFT warm start learns from demonstrations with slips (`with_slips`: each step's result
replaced by another digit with probability `slip_rate`, as a careless writer would), so at
temperature 1 it errs at about that rate per step and exact success falls with K:
(1 − 0.075)^K is 0.86 at K = 2 and 0.13 at K = 26 for a 7.5 % slip rate.

Everything is seeded: `generate(n, seed)` returns the same rows on every machine;
`make_splits` gives disjoint train / validation problems. Rows are ``{"prompt", "answer",
"solution", "data_source": "digitwise", "difficulty"}``.

    python -m vapo_lightning.tasks.digitwise --out vapo_lightning/assets/digitwise
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterable, Sequence

from vapo_lightning.tasks.sampling import disjoint_splits, draw, splits_main

__all__ = [
    "DATA_SOURCE",
    "MAX_DIGITS",
    "MIN_DIGITS",
    "check",
    "generate",
    "is_correct",
    "make_problem",
    "make_splits",
    "pairs",
    "solve",
    "steps",
    "with_slips",
]

DATA_SOURCE = "digitwise"
LABELS = string.ascii_lowercase
MIN_DIGITS, MAX_DIGITS = 2, len(LABELS)
PROMPT_PREFIX = "Add each pair mod 10: "
_PAIR = re.compile(r"([a-z])(\d)(\d)")
_STEP = re.compile(r"([a-z])\) (\d)\+(\d)=(\d)")


def solve(pairs: Sequence[tuple[int, int]], sums: Sequence[int] | None = None) -> str:
    """The worked solution: one labelled ``x+y=z`` step per pair. `sums` overrides the
    steps' results (a demonstration with slips); default: the true ones."""
    sums = [(x + y) % 10 for x, y in pairs] if sums is None else sums
    return " ".join(f"{label}) {x}+{y}={z}" for label, (x, y), z in zip(LABELS, pairs, sums))


def make_problem(rng: random.Random, difficulty: int) -> dict:
    """`difficulty` labelled digit pairs, drawn from `rng`."""
    if not MIN_DIGITS <= difficulty <= MAX_DIGITS:
        raise ValueError(f"difficulty must be in [{MIN_DIGITS}, {MAX_DIGITS}], got {difficulty}")
    ps = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(difficulty)]
    prompt = PROMPT_PREFIX + " ".join(f"{label}{x}{y}" for label, (x, y) in zip(LABELS, ps))
    return {
        "prompt": prompt,
        "answer": "".join(str((x + y) % 10) for x, y in ps),
        "solution": solve(ps),
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
    """`n` problems, pair counts cycled evenly, none whose prompt is in `exclude`."""
    return draw(make_problem, n, seed, difficulties, exclude, distinct)


def make_splits(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation problems: validation first, train drawn excluding it."""
    return disjoint_splits(generate, n_train, n_val, seed)


def pairs(prompt: str) -> list[tuple[int, int]]:
    """The digit pairs of a prompt (the task's own, or one that holds it, chat-formatted)."""
    return [(int(x), int(y)) for _, x, y in _PAIR.findall(prompt[prompt.rindex(PROMPT_PREFIX) :])]


def with_slips(row: dict, rng: random.Random, slip_rate: float) -> dict:
    """The row with a demonstration in which each step's result is, with probability
    `slip_rate`, replaced by one of the nine wrong digits (the operands stay right)."""
    ps = pairs(row["prompt"])
    sums = [(x + y) % 10 for x, y in ps]
    sums = [rng.choice([d for d in range(10) if d != z]) if rng.random() < slip_rate else z for z in sums]
    return {**row, "solution": solve(ps, sums)}


def steps(response: str) -> list[tuple[str, int, int, int]] | None:
    """The labelled steps of a response, or None unless the response (stripped) is steps
    only, labelled a, b, c, ... in order."""
    text = " ".join(response.split())
    found = _STEP.findall(text)
    if not found or " ".join(f"{a}) {x}+{y}={z}" for a, x, y, z in found) != text:
        return None
    if "".join(a for a, *_ in found) != LABELS[: len(found)]:
        return None
    return [(a, int(x), int(y), int(z)) for a, x, y, z in found]


def is_correct(response: str, answer: str) -> bool:
    """The verifier: the response is labelled steps only, and the digits they write are the
    answer (one per pair, in order)."""
    found = steps(response)
    return found is not None and "".join(str(z) for *_, z in found) == str(answer)


def check(responses: Sequence[str], rows: Sequence[dict]) -> list[bool]:
    return [is_correct(r, row["answer"]) for r, row in zip(responses, rows)]


def main(args: list[str] | None = None) -> None:
    splits_main(make_splits, __doc__.split("\n")[0], n_train=4096, n_val=125, args=args)


if __name__ == "__main__":
    main()
