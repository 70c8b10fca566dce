"""GSM8K-style word problems with small numbers: a real model's first task with RL signal.

A small instruct model (SmolLM2-135M-Instruct) solves about 1 GSM8K problem in 50, and about 1
in 20 of these stories with two-digit counts; with single-digit changes it starts near 1 in 6,
within reach, with room to learn (docs/own_model.md). A problem is a short story about one
person and one kind of thing, with `difficulty` (1 or 2) changes to a count, asked as a question:

    Mia has 11 pencils. She buys 9 more pencils. Then she gives 5 pencils to a friend. How
    many pencils does Mia have now?

Changes add or remove 2 to 9 things (every count stays in [1, 30]); the reference
solution works one sentence per change and ends with ``\\boxed{N}``. Answers are chains of
thought of roughly 50-200 tokens in the model's own words, so the length-adaptive λ of
VAPO §4.2 matters.

Everything is seeded: `generate(n, seed)` returns the same rows on every machine, and
`make_splits` gives disjoint train / validation problems (no prompt in both). Rows are
``{"prompt", "answer", "solution", "data_source": "word_problems", "difficulty"}``.

    python -m vapo_lightning.tasks.word_problems --out vapo_lightning/assets/word_problems
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from vapo_lightning.tasks.sampling import disjoint_splits, draw, splits_main

__all__ = ["DATA_SOURCE", "MAX_DIFFICULTY", "generate", "make_problem", "make_splits"]

DATA_SOURCE = "word_problems"
MAX_DIFFICULTY = 2
MAX_COUNT = 30
MAX_CHANGE = 9
MAX_START = 12

NAMES = {  # name -> pronoun
    "Mia": "She",
    "Noah": "He",
    "Ava": "She",
    "Liam": "He",
    "Emma": "She",
    "Leo": "He",
    "Zoe": "She",
    "Omar": "He",
    "Sara": "She",
    "Ben": "He",
    "Lily": "She",
    "Sam": "He",
    "Nina": "She",
    "Jack": "He",
    "Ella": "She",
    "Tom": "He",
}
THINGS = [
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "books",
    "cookies",
    "stamps",
    "coins",
    "shells",
    "cards",
    "balloons",
    "eggs",
    "flowers",
    "toy cars",
    "crayons",
    "buttons",
]
GAINS = [  # (sentence with {p} pronoun, {n} count, {t} things)
    "{p} buys {n} more {t}.",
    "{p} finds {n} more {t}.",
    "A friend gives {o} {n} {t}.",
    "{p} gets {n} {t} as a gift.",
]
LOSSES = [
    "{p} gives {n} {t} to a friend.",
    "{p} loses {n} {t}.",
    "{p} uses {n} {t}.",
    "{p} sells {n} {t}.",
]
THEN = ["Then ", "After that, ", "Later, "]  # before every change but the first


def _object(pronoun: str) -> str:
    return "her" if pronoun == "She" else "him"


def _sentence(rng: random.Random, gain: bool, n: int, pronoun: str, things: str, step: int) -> str:
    text = rng.choice(GAINS if gain else LOSSES).format(p=pronoun, n=n, t=things, o=_object(pronoun))
    if step == 0:
        return text
    return rng.choice(THEN) + text[0].lower() + text[1:]


def _work(count: int, gain: bool, n: int) -> tuple[str, int]:
    after = count + n if gain else count - n
    return f"{count} {'+' if gain else '-'} {n} = {after}.", after


def make_problem(rng: random.Random, difficulty: int) -> dict:
    """One story with `difficulty` changes to the count, drawn from `rng`."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in [1, {MAX_DIFFICULTY}], got {difficulty}")
    name = rng.choice(sorted(NAMES))
    pronoun, things = NAMES[name], rng.choice(THINGS)
    count = rng.randint(3, MAX_START)
    story, work = [f"{name} has {count} {things}."], []
    for step in range(difficulty):
        gain = count < 3 or (count <= MAX_COUNT - 2 and rng.random() < 0.5)
        n = rng.randint(2, min(MAX_CHANGE, MAX_COUNT - count if gain else count - 1))
        story.append(_sentence(rng, gain, n, pronoun, things, step))
        line, count = _work(count, gain, n)
        work.append(line)
    story.append(f"How many {things} does {name} have now?")
    return {
        "prompt": " ".join(story),
        "answer": str(count),
        "solution": " ".join(work) + f" \\boxed{{{count}}}",
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
    """`n` problems, difficulties cycled evenly, none whose prompt is in `exclude`."""
    return draw(make_problem, n, seed, difficulties, exclude, distinct)


def make_splits(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation problems: validation first, train drawn excluding it."""
    return disjoint_splits(generate, n_train, n_val, seed)


def main(args: list[str] | None = None) -> None:
    splits_main(make_splits, __doc__.split("\n")[0], n_train=2000, n_val=128, args=args)


if __name__ == "__main__":
    main()
