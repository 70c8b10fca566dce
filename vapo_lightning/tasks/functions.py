"""A synthetic program-writing task: write ``f(x)`` in Python from a table of its values.

The prompt shows an integer function on six consecutive inputs that always include 0 and 1,
``Write f(x) in Python: f(-1) = -1, f(0) = 2, f(1) = 5, ...``, and the reference solution is
a short fenced program (``def f(x):\\n    return 3 * x + 2``). Functions come from templates
of graded difficulty:

1. one operation: ``x + b``, ``x - b``, ``a * x`` (a constant read off ``f(0)`` or ``f(1)``)
2. affine: ``a * x + b``, ``a * x - b``, ``b - a * x`` (the slope is a difference)
3. modular: ``x % m``, ``x // m``, ``x % m + b``, ``x // m - b`` (a period or a run length)
4. piecewise and square: ``max(x, c)``, ``min(x, c)``, ``abs(x - b)``, ``abs(x) + b``,
   ``x * x + b`` and their mirror images
5. compositions: ``abs(a * x - b)``, ``max(a * x, c)``, ``(a * x + b) % m``, ``x * x - a * x``

A problem is kept only if the table decides the function: the simplest explanations that
match the six shown values (any line first, then the templates by difficulty) agree with it
on all of [-40, 40], so a kink or wrap-around is always inside the window and the reference
is the simplest explanation (a table that looks like a line means that line). Each row's
tests are the six shown points plus six held-out inputs drawn from [-40, 40] outside the
window, so a lookup table of the prompt fails. The tests are in the format `CodeReward` reads
(function mode, ``fn_name = "f"``) and are judged by the sandbox (`check`).

Everything is seeded: `generate(n, seed)` returns the same rows on every machine, and
`make_splits` gives disjoint train / validation problems (no prompt in both). Rows are
``{"prompt", "solution", "tests", "fn_name": "f", "data_source": "functions", "difficulty"}``.

    python -m vapo_lightning.tasks.functions --out vapo_lightning/assets/functions
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vapo_lightning.jsonl import read_jsonl, write_jsonl
from vapo_lightning.tasks.sampling import disjoint_splits, draw, splits_main

__all__ = [
    "DATA_SOURCE",
    "FN_NAME",
    "MAX_DIFFICULTY",
    "TEMPLATES",
    "Problem",
    "check",
    "generate",
    "make_problem",
    "make_splits",
    "problems",
    "read_jsonl",
    "solve",
    "write_jsonl",
]

DATA_SOURCE = "functions"
FN_NAME = "f"
PROMPT_PREFIX = "Write f(x) in Python: "
TABLE_SIZE = 6
WINDOW_STARTS = range(-5, 1)  # shown: start, ..., start + TABLE_SIZE - 1 (always 0 and 1)
PROBE = range(-40, 41)  # functions that agree on all of these are the same function here
NUM_HELD_OUT = 6

_A, _B, _M, _C = range(2, 10), range(1, 100), range(2, 6), range(-15, 16)

TEMPLATES: dict[int, list[tuple[str, dict[str, range]]]] = {
    1: [("x + {b}", {"b": _B}), ("x - {b}", {"b": _B}), ("{a} * x", {"a": _A})],
    2: [
        ("{a} * x + {b}", {"a": _A, "b": _B}),
        ("{a} * x - {b}", {"a": _A, "b": _B}),
        ("{b} - {a} * x", {"a": _A, "b": _B}),
    ],
    3: [
        ("x % {m}", {"m": _M}),
        ("x // {m}", {"m": _M}),
        ("x % {m} + {b}", {"m": _M, "b": _B}),
        ("x % {m} - {b}", {"m": _M, "b": _B}),
        ("x // {m} + {b}", {"m": _M, "b": _B}),
        ("x // {m} - {b}", {"m": _M, "b": _B}),
    ],
    4: [
        ("max(x, {c})", {"c": _C}),
        ("min(x, {c})", {"c": _C}),
        ("abs(x - {b})", {"b": range(1, 6)}),
        ("abs(x + {b})", {"b": range(1, 6)}),
        ("abs(x) + {b}", {"b": _B}),
        ("abs(x) - {b}", {"b": _B}),
        ("x * x + {b}", {"b": _B}),
        ("x * x - {b}", {"b": _B}),
    ],
    5: [
        ("abs({a} * x - {b})", {"a": range(2, 6), "b": range(1, 25)}),
        ("max({a} * x, {c})", {"a": range(2, 6), "c": _C}),
        ("({a} * x + {b}) % {m}", {"a": range(2, 5), "b": range(1, 5), "m": range(3, 6)}),
        ("x * x - {a} * x", {"a": _A}),
        ("x * x + {a} * x", {"a": _A}),
        ("{a} * abs(x) - {b}", {"a": range(2, 6), "b": _B}),
    ],
}
"""Expression templates by difficulty, with the range of each constant."""
MAX_DIFFICULTY = max(TEMPLATES)


@dataclass(frozen=True)
class Problem:
    """One function shown on one window: ``expr`` is a Python expression in ``x``."""

    expr: str
    start: int
    difficulty: int

    @property
    def shown(self) -> list[int]:
        return list(range(self.start, self.start + TABLE_SIZE))


def solve(expr: str) -> str:
    """The reference solution: a fenced Python block defining ``f``."""
    return f"```python\ndef {FN_NAME}(x):\n    return {expr}\n```"


def _instances() -> list[tuple[int, str]]:
    """Every (difficulty, expression) the templates produce, simplest first."""
    out = []
    for level, templates in TEMPLATES.items():
        for template, ranges in templates:
            names = list(ranges)
            for values in itertools.product(*(ranges[k] for k in names)):
                out.append((level, template.format(**dict(zip(names, values)))))
    return out


def _rivals() -> list[str]:
    """The explanations a reader tries first (constants, ``x``, any line): never posed, but
    simpler than every template, so a table that looks like a line means that line."""
    return [f"{a} * x + {b}" for a in range(-9, 10) for b in range(-199, 200)]


@functools.cache
def problems() -> dict[int, tuple[Problem, ...]]:
    """All problems the table decides, by difficulty (see the module docstring)."""
    probe = list(PROBE)
    values: dict[str, tuple[int, tuple[int, ...]]] = {}  # expression -> (level, on PROBE)
    for level, expr in [*_instances(), *((0, e) for e in _rivals())]:
        fn = eval(f"lambda x: {expr}")  # our own templates, never model output
        vals = tuple(fn(x) for x in probe)
        if level == 0 or len(set(vals)) > 1:  # (3 * x + 1) % 3 is a constant: no table
            values.setdefault(expr, (level, vals))
    by_level: dict[int, list[Problem]] = {level: [] for level in TEMPLATES}
    for start in WINDOW_STARTS:
        lo = probe.index(start)
        groups: dict[tuple[int, ...], list[str]] = {}
        for expr, (_, vals) in values.items():
            groups.setdefault(vals[lo : lo + TABLE_SIZE], []).append(expr)
        for members in groups.values():
            simplest = min(values[e][0] for e in members)
            answers = {values[e][1] for e in members if values[e][0] == simplest}
            if len(answers) > 1:
                continue  # equally simple explanations disagree off the table
            # The simplest template instance computing the simplest explanation.
            posed = [e for e in members if values[e][0] > 0 and values[e][1] in answers]
            if posed:
                expr = min(posed, key=lambda e: values[e][0])
                by_level[values[expr][0]].append(Problem(expr, start, values[expr][0]))
    return {level: tuple(ps) for level, ps in by_level.items()}


def make_problem(rng: random.Random, difficulty: int) -> dict:
    """One row of the given difficulty, drawn from `rng` (its held-out inputs too)."""
    if difficulty not in TEMPLATES:
        raise ValueError(f"difficulty must be in [1, {MAX_DIFFICULTY}], got {difficulty}")
    problem = rng.choice(problems()[difficulty])
    fn = eval(f"lambda x: {problem.expr}")  # our own templates, never model output
    shown = problem.shown
    held_out = sorted(rng.sample([x for x in PROBE if x not in shown], NUM_HELD_OUT))
    table = ", ".join(f"{FN_NAME}({x}) = {fn(x)}" for x in shown)
    return {
        "prompt": PROMPT_PREFIX + table,
        "solution": solve(problem.expr),
        "tests": [{"input": [x], "output": fn(x)} for x in shown + held_out],
        "fn_name": FN_NAME,
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
    """`n` problems, difficulties cycled evenly, none whose prompt is in `exclude`; with
    ``distinct=False`` prompts may repeat (large SFT sets). See `sampling.draw`."""
    return draw(make_problem, n, seed, difficulties, exclude, distinct)


def make_splits(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation problems: validation first, train drawn excluding it."""
    return disjoint_splits(generate, n_train, n_val, seed)


def check(responses: Sequence[str], rows: Sequence[dict], timeout_s: float = 5.0) -> list[bool]:
    """Whether each response's program passes every test of its row, run in the sandbox.

    The program is found and the tests are read exactly as `CodeReward` does
    (`extract_code`, `from_ground_truth`), so SFT validation and the RL reward agree.
    """
    from vapo_lightning.rewards.code import extract_code  # imports Lightning: only when checking
    from vapo_lightning.sandbox import evaluate
    from vapo_lightning.sandbox.importers import from_ground_truth

    if len(responses) != len(rows):
        raise ValueError(f"{len(responses)} responses for {len(rows)} rows")

    def one(pair: tuple[str, dict]) -> bool:
        response, row = pair
        imported = from_ground_truth(row["tests"], row["fn_name"])
        result = evaluate(extract_code(response), imported.tests, imported.fn_name, timeout_s)
        return result.status == "ok" and result.passed == result.total > 0

    with ThreadPoolExecutor(2, thread_name_prefix="functions-check") as ex:
        return list(ex.map(one, zip(responses, rows)))


def main(args: list[str] | None = None) -> None:
    splits_main(make_splits, __doc__.split("\n")[0], n_train=2048, n_val=200, args=args)


if __name__ == "__main__":
    main()
