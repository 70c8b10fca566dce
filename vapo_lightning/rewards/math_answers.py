"""Final answers of math text: extraction, and the spelling-only comparison that settles a
check without math-verify.

The answer is the last ``\\boxed{}`` / ``\\fbox{}``, else the last ``Answer:`` line (DAPO's
prompt format), else the last ``#### N`` line (GSM8K's), else the last number written as
``The answer is N`` (lm-evaluation-harness's GSM8K chain-of-thought pattern, the way small
instruct models end). `fast_verdict` decides equal
spellings and integers (AIME's "033" vs 33); everything else goes to math-verify
(`vapo_lightning.rewards.math`).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

__all__ = ["answer_forms", "extract_answer", "fast_verdict", "gold_answer", "number_text"]

# ----------------------------------------------------------------------------- extraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_LINE = re.compile(r"(?i)answer\s*:[ \t]*([^\n]*)")
_GSM8K_LINE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"(?i)\bthe (?:final )?answer is:?[ \t]*\$?(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_BRACE_NEXT = re.compile(r"[ \t\n]*\{")  # ``\boxed{5}``, ``\boxed { 5 }``
_BOX_TOKEN = re.compile(r" +([^\s$]+)")  # ``\boxed 5``: one TeX token-ish run
_MAX_BOX_SCAN = 10_000  # a box whose closing brace is further away than this is not an answer


def last_box_span(text: str) -> tuple[int, int, int] | None:
    """Where the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 5`` is: (start, end) of
    its content and the end of the box itself; None if absent or unclosed (a response
    truncated inside its box has no answer)."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    if not _BRACE_NEXT.match(text, i) and text[i : i + 1] == " ":  # ``\boxed 5``
        match = _BOX_TOKEN.match(text, i, i + _MAX_BOX_SCAN)
        return (match.start(1), match.end(1), match.end(1)) if match else None
    while i < len(text) and text[i] in " \t\n":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, j, end = 0, i, min(len(text), i + _MAX_BOX_SCAN)
    while j < end:
        c = text[j]
        if c == "\\":  # ``\{``, ``\}`` and ``\\`` are not group braces
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1, j, j + 1
        j += 1
    return None


def _last_box(text: str) -> str | None:
    span = last_box_span(text)
    return text[span[0] : span[1]] if span else None


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for last in pattern.finditer(text):  # noqa: B007 - keep the last one
        pass
    return last


def _answer_line(text: str) -> str | None:
    """The last ``Answer: ...`` line's answer; when the line holds none (``**Final
    Answer:**``), the next non-empty line's."""
    last = _last_match(_ANSWER_LINE, text)
    if last is None:
        return None
    if _clean(last.group(1)):
        return last.group(1)
    below = text[last.end() :].lstrip()
    return below.split("\n", 1)[0] if below else None


def _clean(answer: str) -> str:
    """Strips markdown emphasis, math delimiters and a final full stop around an answer."""
    answer = answer.strip().strip("*").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left + right):
            answer = answer[len(left) : -len(right)].strip()
    return answer.rstrip(".").strip()


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{}`` or ``\\fbox{}`` (braces balanced,
    ``\\boxed 5`` too), else the last ``Answer: ...`` line (DAPO; the line below it when it
    ends there), else the last ``#### N`` line (GSM8K), else the number of the last ``The
    answer is N`` (commas dropped). None when there is none or it is empty."""
    gsm8k = _last_match(_GSM8K_LINE, response)
    for found in (_last_box(response), _answer_line(response), gsm8k and gsm8k.group(1)):
        if found is not None and (answer := _clean(found)):
            return answer
    answer_is = _last_match(_ANSWER_IS, response)
    return answer_is.group(1).replace(",", "") if answer_is else None


def answer_forms(response: str) -> tuple[bool, bool]:
    """(has a final answer `extract_answer` reads, that answer is the last box): the shares a
    run logs as ``*/answer_share`` and ``*/boxed_share``, so a right answer in a form the
    reward cannot read shows as a low answer share, not only as a low accuracy."""
    if extract_answer(response) is None:
        return False, False
    box = _last_box(response)
    return True, box is not None and bool(_clean(box))


def number_text(value: int | float) -> str:
    """A number as an answer is written: 142.0 -> "142", 1e-05 -> "0.00001" (math-verify
    reads Python's "1e-05" as the expression e - 5)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # JSON's 142.0 for AMC's 142
    return format(Decimal(repr(value)), "f") if isinstance(value, float) else str(value)


def gold_answer(ground_truth: Any) -> str | None:
    """The ground truth as an answer string: bare ("3/4"), LaTeX, a number, or a solution
    ending in ``#### 18`` / a box. None when missing. A value that is no answer (a dict such
    as verl's ``reward_model``, a list, NaN) raises `ValueError`: its text would match nothing."""
    if ground_truth is None or isinstance(ground_truth, bool):
        return None
    if not isinstance(ground_truth, str | int | float) or (
        isinstance(ground_truth, float) and not math.isfinite(ground_truth)
    ):
        raise ValueError(
            f"a math ground truth must be a string or a number, got {type(ground_truth).__name__} "
            f"{ground_truth!r:.80} (point data.answer_field at the answer itself)"
        )
    text = (ground_truth if isinstance(ground_truth, str) else number_text(ground_truth)).strip()
    if "####" in text or any(c in text for c in _BOX_COMMANDS):
        return extract_answer(text)
    return _clean(text) or None


# ------------------------------------------------------------------------- fast path

_SPACING = re.compile(r"\\[,;:! ]|\\left\b|\\right\b|\$")
_INTEGER = re.compile(r"[+-]?\d{1,60}")


def _normalise(answer: str) -> str:
    """Spelling-only changes: spacing macros, ``\\left``/``\\right``, ``\\dfrac``, and
    whitespace except between two letters/digits (``\\pi r`` must not become ``\\pir``)."""
    answer = _SPACING.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"(?<![A-Za-z0-9])\s+|\s+(?![A-Za-z0-9])", "", answer)


def fast_verdict(pred: str, gold: str) -> bool | None:
    """True / False when it is certain without math-verify, else None."""
    pred, gold = _normalise(pred), _normalise(gold)
    if pred == gold:
        return True
    if _INTEGER.fullmatch(pred) and _INTEGER.fullmatch(gold):
        return int(pred) == int(gold)  # AIME's "033" vs 33
    return None
