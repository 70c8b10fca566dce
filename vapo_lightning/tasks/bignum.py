"""A synthetic task where a tool pays: one sum or product of integers up to five digits.

A problem is one line of arithmetic, ``What is 4821*397?`` (``+`` or ``*``, no spaces). The
reference solution calls the tool: it writes the expression as a Python program between
``<code>`` and ``</code>``, the rollout runs it and appends its standard output (trailing
newlines stripped) between ``<output>`` and ``</output>`` as an observation (context, not
actions), and the model copies the printed number into the box::

    <code>print(4821*397)</code><output>1913937</output> \\boxed{1913937}

`bare` is the same answer without the tool (``\\boxed{1913937}``). Both end with the last
``\\boxed{}`` holding the answer, and the observation holds none, so ``MathReward`` scores
either form as it scores any math answer.

The difficulty is the operands' length: with operands of ``m`` and ``n`` digits (1 to 5 each),
the level is ``(m + n) // 2``, 1 to 5 (level 1: ``3+4``, ``7*8``, ``47+8``; level 3:
``4821*397``; level 5: two 5-digit numbers). Every level holds thousands of distinct problems,
so the shipped splits can be stratified and the SFT set still has problems of every level
left. The two forms split the task in two:

- with the tool, every level is the same skill: copy the operands into the program (up to 11
  characters) and copy the printed number (up to 10 digits) into the box, which a tiny model
  learns;
- without it, the model must compute the answer in its head, which a tiny model does for a
  digit added to a small number and fails at for a product of two 3-digit numbers.

So the tool pays more the harder the problem, and RL on a warm start that mixes both forms at
every level (``data.answer_only_fraction``) has a share of tool calls to move per level. With
the project's digit-splitting BPE (trained on the segments, as the SFT tokenizes them) a tool
answer is 25-51 tokens with EOS, 7-16 of them the observation, and a bare one 6-15; the
chat-formatted prompt is 23-31. ``</code>`` is three tokens (``</`` or ``)</``, ``code``,
``>``), so a rollout stops on the decoded text, not on one token id.

Everything is seeded: `generate(n, seed)` returns the same rows on every machine;
`make_splits` gives disjoint train / validation problems. Rows are ``{"prompt", "answer",
"solution", "data_source": "bignum", "difficulty"}``; ``solution`` is the tool form.

    python -m vapo_lightning.tasks.bignum --out vapo_lightning/assets/bignum
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence

from vapo_lightning.tasks.arithmetic import boxed, extract_boxed_int
from vapo_lightning.tasks.sampling import disjoint_splits, draw, splits_main

__all__ = [
    "DATA_SOURCE",
    "MAX_DIFFICULTY",
    "MAX_DIGITS",
    "bare",
    "check",
    "digit_counts",
    "generate",
    "is_correct",
    "make_problem",
    "make_splits",
    "observation",
    "operands",
    "tool_call",
]

DATA_SOURCE = "bignum"
MAX_DIGITS = 5
MAX_DIFFICULTY = MAX_DIGITS  # (5 + 5) // 2
OPS = "+*"
PROMPT_PREFIX = "What is "
CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
_PROBLEM = re.compile(r"What is (\d+)([+*])(\d+)\?")


def digit_counts(difficulty: int) -> list[tuple[int, int]]:
    """The operand lengths ``(m, n)`` of a level: every pair with ``(m + n) // 2 == difficulty``."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in [1, {MAX_DIFFICULTY}], got {difficulty}")
    span = range(1, MAX_DIGITS + 1)
    return [(m, n) for m in span for n in span if (m + n) // 2 == difficulty]


def _number(rng: random.Random, digits: int) -> int:
    """A uniform integer of exactly `digits` digits (0-9 for one digit)."""
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a * b


def tool_call(a: int, op: str, b: int) -> str:
    """The model text of the tool call: ``<code>print(4821*397)</code>``."""
    return f"{CODE_OPEN}print({a}{op}{b}){CODE_CLOSE}"


def observation(stdout: str) -> str:
    """What the rollout appends after a tool call: ``<output>`` + stdout with its trailing
    newlines stripped + ``</output>``."""
    return f"{OUTPUT_OPEN}{stdout.rstrip(chr(10))}{OUTPUT_CLOSE}"


def make_problem(rng: random.Random, difficulty: int) -> dict:
    """One row of the given level, drawn from `rng`: operand lengths uniform among the level's
    `digit_counts`, then the operands, then the operation."""
    m, n = rng.choice(digit_counts(difficulty))
    a, b = _number(rng, m), _number(rng, n)
    op = rng.choice(OPS)
    answer = str(_value(a, op, b))
    return {
        "prompt": f"{PROMPT_PREFIX}{a}{op}{b}?",
        "answer": answer,
        "solution": tool_call(a, op, b) + observation(answer + "\n") + " " + boxed(answer),
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
    """`n` problems, levels cycled evenly, none whose prompt is in `exclude`.

    With `distinct`, no prompt repeats; ``distinct=False`` allows repeats (large SFT sets),
    exclusions still hold. Level 1, the smallest, has 3,800 distinct problems.
    """
    return draw(make_problem, n, seed, difficulties, exclude, distinct)


def make_splits(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation problems: validation first, train drawn excluding it."""
    return disjoint_splits(generate, n_train, n_val, seed)


def bare(row: dict) -> str:
    """The row's answer without the tool: ``\\boxed{1913937}`` (the SFT prepends the space
    that starts every response)."""
    return boxed(row["answer"])


def operands(prompt: str) -> tuple[int, str, int]:
    """``(a, op, b)`` of a task prompt (the task's own, or a chat-formatted one holding it)."""
    found = _PROBLEM.findall(prompt)
    if not found:
        raise ValueError(f"not a {DATA_SOURCE} prompt: {prompt!r}")
    a, op, b = found[-1]
    return int(a), op, int(b)


def is_correct(response: str, answer: str | int) -> bool:
    """The last boxed integer of the response equals the answer (either form)."""
    got = extract_boxed_int(response)
    return got is not None and got == int(answer)


def check(responses: Sequence[str], rows: Sequence[dict]) -> list[bool]:
    return [is_correct(r, row["answer"]) for r, row in zip(responses, rows)]


def main(args: list[str] | None = None) -> None:
    splits_main(make_splits, __doc__.split("\n")[0], n_train=4096, n_val=200, args=args)


if __name__ == "__main__":
    main()
