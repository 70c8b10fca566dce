"""The verdict, decided on the host: decode the sandbox's frames as plain JSON and compare.

Nothing the candidate controls is executed or trusted here: frames are parsed with `json.loads`
(NaN/Infinity refused), values compared by exact type with this module's own code, so
always-equal objects, patched builtins, exit codes and printed markers have nothing to act on.
"""

from __future__ import annotations

import json
import math

FLOAT_REL_TOL = 1e-9
"""Relative tolerance between a returned float and an expected float (a test may set 'tol')."""


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not plain JSON")


def decode(text: str) -> object:
    return json.loads(text, parse_constant=_no_constants)


def same_value(got: object, want: object, tol: float | None = None) -> bool:
    """Type-strict equality of plain JSON values: 1 != 1.0 != True, [1] != [1.0]."""
    if type(got) is not type(want):
        return False
    if type(want) is float:
        if tol is not None:
            return abs(got - want) <= tol
        return math.isclose(got, want, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_REL_TOL)
    if type(want) is list:
        return len(got) == len(want) and all(same_value(g, w, tol) for g, w in zip(got, want))
    if type(want) is dict:
        return got.keys() == want.keys() and all(same_value(got[k], want[k], tol) for k in want)
    return got == want  # None, bool, int, str


def normalise_stdout(text: str) -> str:
    """Trailing whitespace per line and trailing blank lines do not count; nothing else."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _frames(raw: bytes, n: int) -> dict[int, tuple[str, str]]:
    """First frame per test index: {i: (kind, rest)}; malformed lines are ignored."""
    found: dict[int, tuple[str, str]] = {}
    for line in raw.decode("utf-8", "replace").split("\n"):
        parts = line.split(" ", 2)
        if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 9:
            continue
        i = int(parts[0])
        if 0 <= i < n and i not in found:
            found[i] = (parts[1], parts[2])
    return found


def judge(
    raw: bytes, tests: list[dict], fn_name: str | None
) -> tuple[list[bool], list[str | None]]:
    """Per-test pass/fail and failure reasons, from the raw frames of one run."""
    frames = _frames(raw, len(tests))
    passed: list[bool] = []
    errors: list[str | None] = []
    for i, test in enumerate(tests):
        ok, why = False, "missing"
        if i in frames:
            kind, rest = frames[i]
            try:
                ok, why = _judge_one(kind, rest, test, fn_name)
            except (ValueError, TypeError, RecursionError):
                ok, why = False, "undecodable"
        passed.append(ok)
        errors.append(None if ok else why)
    return passed, errors


def _judge_one(kind: str, rest: str, test: dict, fn_name: str | None) -> tuple[bool, str]:
    if fn_name is not None:
        if kind == "E":
            return False, str(decode(rest))[:100]
        if kind != "R":
            return False, "bad frame"
        return (
            (True, "")
            if same_value(decode(rest), test["output"], test.get("tol"))
            else (False, "wrong")
        )
    if kind != "O":
        return False, "bad frame"
    code, text = rest.split(" ", 1)
    if int(code) != 0:
        return False, f"exit {code}"
    got = decode(text)
    if type(got) is not str:
        return False, "bad frame"
    want = test["output"]
    if not isinstance(want, str):
        return False, "expected output is not text"
    return (True, "") if normalise_stdout(got) == normalise_stdout(want) else (False, "wrong")
