"""The verdict, decided on the host: decode the sandbox's frames as plain JSON and compare.

Nothing the candidate controls is executed or trusted here: frames are parsed with `json.loads`
(NaN/Infinity refused), values compared by exact type with this module's own code, so
always-equal objects, patched builtins, exit codes and printed markers have nothing to act on.
A frame is bytes the candidate may have written itself: whatever it holds, parsing it fails
that test and never raises (only ASCII digits are numbers, invalid UTF-8 is not text).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import threading
from array import array
from itertools import accumulate

from vapo_lightning.sandbox.protocol import MAX_DEPTH, json_key

FLOAT_REL_TOL = 1e-9
"""Relative tolerance between a returned float and an expected float (a test may set 'tol'):
``|got - want| <= FLOAT_REL_TOL * max(|got|, |want|)``. Relative only, so that 0.0 does not
pass for 1e-12 or 2.5e-300: a tiny expected value is an answer like any other."""

FLOAT_ZERO_TOL = 1e-9
"""Where the expected float is exactly 0 (no relative tolerance can then be met but by 0.0
itself), a returned float within this absolute distance passes, as in evalplus: rounding
error around zero (``1e-17``) is not a wrong answer."""


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not plain JSON")


DIGITS_SLACK = 1000
"""Digits of numbers a frame may carry beyond twice those of its test's expected value
(`digit_budget`). Reading an int of n digits costs O(n^1.6), so a frame's numbers are read
only up to its budget: what a program writes then costs the judge no more than the expected
outputs' own size, plus the slack's digits per test."""


class TooManyDigits(ValueError):
    """A frame's numbers carry more digits than its budget (`decode`)."""


def digit_budget(want: object) -> int:
    """How many digits (ints' and floats' together) a frame for `want` may carry: twice the
    digits of the numbers in `want` (a float counts 24, its longest repr), plus
    `DIGITS_SLACK`. A value equal to `want` never needs more."""
    digits, stack = 0, [want]
    while stack:
        x = stack.pop()
        t = type(x)
        if t is int:  # (a bool is 1 digit of slack) decimal digits, from the bit length
            digits += int(x.bit_length() * 0.30103) + 2
        elif t is float:
            digits += 24
        elif t is list or t is tuple:
            stack += x
        elif t is dict:
            stack += x.values()
    return 2 * digits + DIGITS_SLACK


def _int_from_digits(text: str) -> int:
    """`int(text)` past Python's 4,300-digit int-to-str guard (which is process-wide, so not
    lifted here), by halves: each half is a smaller int, joined with one multiplication."""
    if len(text) <= 4000:
        return int(text)
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text)
    low = len(digits) // 2
    return sign * (_int_from_digits(digits[:-low]) * 10**low + _int_from_digits(digits[-low:]))


DEPTH_SLACK = 100
"""Levels of nesting a frame may have beyond its test's expected value (`depth_budget`)."""


class TooDeep(ValueError):
    """A frame nests deeper than its budget (`decode`)."""


def depth(value: object) -> int:
    """How deeply lists, tuples and dicts nest in `value`: 0 for a number, 1 for ``[1, 2]``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        x, level = stack.pop()
        t = type(x)
        if t is list or t is tuple or t is dict:
            level += 1
            deepest = max(deepest, level)
            stack += [(v, level) for v in (x.values() if t is dict else x)]
    return deepest


def depth_budget(want: object) -> int:
    """How deeply a frame for `want` may nest: `want`'s depth (at most `MAX_DEPTH`, the most
    a runner sends) plus `DEPTH_SLACK`. A value equal to `want` never needs more."""
    return min(depth(want), MAX_DEPTH) + DEPTH_SLACK


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # (as signed bytes: +1, -1)


def nesting(text: str) -> int:
    """How deeply the brackets of a JSON text nest, outside its strings; linear in the text,
    without recursion (the frame is checked before `json.loads` reads it)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    return max(accumulate(array("b", brackets.encode("ascii").translate(_STEPS))))


_recursion_lock = threading.Lock()


@contextlib.contextmanager
def _recursion_room(levels: int):
    """json's decoder takes one level of the recursion limit per nesting level: for a deep
    frame (within its budget) the limit is raised by `levels` while it is read, so that the
    caller's own stack depth cannot fail an honest answer (one such read at a time)."""
    if levels < 200:
        yield
        return
    with _recursion_lock:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + levels)
        try:
            yield
        finally:
            sys.setrecursionlimit(limit)


def decode(text: str, max_digits: int = DIGITS_SLACK, max_depth: int = DEPTH_SLACK) -> object:
    """One frame's JSON, its numbers read only while their digits stay within `max_digits`
    (`TooManyDigits` past it) and only if it nests at most `max_depth` deep (`TooDeep`,
    checked before decoding: json's C decoder, under a recursion limit that a trainer raised,
    would overflow the C stack on a forged frame a million brackets deep). Either fails the
    test."""
    if text.count("[") + text.count("{") > max_depth and nesting(text) > max_depth:
        raise TooDeep
    left = max_digits

    def spend(digits: str) -> None:
        nonlocal left
        left -= len(digits)
        if left < 0:
            raise TooManyDigits

    def parse_int(digits: str) -> int:
        spend(digits)
        return _int_from_digits(digits)

    def parse_float(digits: str) -> float:
        spend(digits)
        return float(digits)

    with _recursion_room(max_depth):
        return json.loads(text, parse_constant=_no_constants, parse_int=parse_int, parse_float=parse_float)


def same_value(got: object, want: object, tol: float | None = None) -> bool:
    """Type-strict equality of plain JSON values: 1 != 1.0 != True, [1] != [1.0].

    An expected tuple is met by the list a returned tuple travels as (``[1, 2]``), as an
    expected dict's keys are by their JSON text. With a tolerance (a test written as
    ``abs(f(x) - want) < tol``) a float is met by any real number, int or float, as Python's
    own assert would accept it; never by a bool. Iterative: any depth."""
    pairs = [(got, want)]
    while pairs:
        got, want = pairs.pop()
        if type(want) is tuple:  # as the transport delivers it
            want = list(want)
        if tol is not None and type(want) is float and type(got) in (int, float):
            if not abs(got - want) <= tol:
                return False
        elif type(got) is not type(want):
            return False
        elif type(want) is float:
            if want == 0.0:
                close = abs(got) <= FLOAT_ZERO_TOL
            else:
                close = math.isclose(got, want, rel_tol=FLOAT_REL_TOL)
            if not close:
                return False
        elif type(want) is list:
            if len(got) != len(want):
                return False
            pairs += zip(got, want)
        elif type(want) is dict:
            if any(type(k) is not str for k in want):  # keys as the program's travel: JSON's
                want = {json_key(k): v for k, v in want.items()}
            if got.keys() != want.keys():
                return False
            pairs += ((got[k], want[k]) for k in want)
        elif got != want:  # None, bool, int, str
            return False
    return True


def normalise_stdout(text: str) -> str:
    """Trailing whitespace per line and trailing blank lines do not count; nothing else."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


_INDEX = re.compile(rb"[0-9]{1,9}")
_EXIT = re.compile(r"-?[0-9]{1,9}")


def _frames(raw: bytes, n: int) -> dict[int, tuple[str, str]]:
    """First frame per test index: {i: (kind, rest)}; malformed lines (not UTF-8, no ASCII
    index) are ignored."""
    found: dict[int, tuple[str, str]] = {}
    for line in raw.split(b"\n"):
        parts = line.split(b" ", 2)
        if len(parts) != 3 or not _INDEX.fullmatch(parts[0]):
            continue
        i = int(parts[0])
        if i < n and i not in found:
            try:
                found[i] = (parts[1].decode("ascii"), parts[2].decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return found


def judge(raw: bytes, tests: list[dict], fn_name: str | None) -> tuple[list[bool], list[str | None]]:
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
            except TooManyDigits:
                ok, why = False, "too many digits"
            except TooDeep:
                ok, why = False, "nested too deeply"
            except Exception:  # any frame the candidate wrote: a failed test, never an error
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
        want = test["output"]
        got = decode(rest, digit_budget(want), depth_budget(want))
        return (True, "") if same_value(got, want, test.get("tol")) else (False, "wrong")
    if kind != "O":
        return False, "bad frame"
    code, text = rest.split(" ", 1)
    if not _EXIT.fullmatch(code):
        return False, "bad frame"
    if int(code) != 0:
        return False, f"exit {code}"
    got = decode(text)
    if type(got) is not str:
        return False, "bad frame"
    if not _is_utf8(got):  # the runner passes invalid bytes on as lone surrogates
        return False, "invalid utf-8"
    want = test["output"]
    if not isinstance(want, str):
        return False, "expected output is not text"
    return (True, "") if normalise_stdout(got) == normalise_stdout(want) else (False, "wrong")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
