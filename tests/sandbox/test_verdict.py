"""The host-side verdict on raw frames: whatever bytes a run sent back, `judge` returns one
verdict per test and never raises (a raise would turn a whole batch's rewards into errors)."""

from __future__ import annotations

import random
import sys

from vapo_lightning.sandbox import compare
from vapo_lightning.sandbox.compare import judge, same_value

FN_TESTS = [{"input": [], "output": 1}, {"input": [], "output": "é"}, {"input": [], "output": 2.5}]
STDIN_TESTS = [{"input": "", "output": "1"}, {"input": "", "output": "\ufffd"}]

# Pieces of frames a hostile program might write, valid and not.
PIECES = [
    b"0",
    b"1",
    b"2",
    b"00",
    b"-1",
    b"\xc2\xb2",
    b"\xd9\xa3",
    b"\xef\xbc\x91",
    b"999999999",
    b"1" * 12,
    b" ",
    b"  ",
    b"\n",
    b"R",
    b"E",
    b"O",
    b"X",
    b'"a"',
    b'"\\ud800"',
    b"\xff",
    b"\xc3",
    b"[",
    b"]",
    b"{",
    b"}",
    b"1e999",
    b"NaN",
    b"-Infinity",
    b"9" * 5000,
    b"[" * 5000,
    b"null",
    b"true",
    b'"\\u00e9"',
    b"\x00",
    b"0 R 1",
    b'1 O \xc2\xb2 "1"',
    b'0 O 0 "1"',
]


def _check(raw: bytes) -> None:
    for tests, fn_name in ((FN_TESTS, "f"), (STDIN_TESTS, None)):
        passed, errors = judge(raw, tests, fn_name)
        assert len(passed) == len(errors) == len(tests)
        assert all(type(p) is bool for p in passed)
        assert all((e is None) == p for p, e in zip(passed, errors))


def test_judge_never_raises_on_random_frames():
    rng = random.Random(0)
    for _ in range(3000):
        if rng.random() < 0.3:
            raw = rng.randbytes(rng.randrange(64))
        else:
            raw = b"".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 12)))
        _check(raw)


def test_non_ascii_digits_are_not_indices_or_exit_codes():
    # '²' and '٣' are digits to str.isdigit(); int() refuses the first, reads the second.
    raw = "² R 1\n٣ R 1\n0 R 1\n".encode()
    assert judge(raw, FN_TESTS[:1], "f") == ([True], [None])
    assert judge('0 O ² "1"\n'.encode(), STDIN_TESTS[:1], None) == ([False], ["bad frame"])
    assert judge('0 O ٠ "1"\n'.encode(), STDIN_TESTS[:1], None) == ([False], ["bad frame"])
    assert judge(b'0 O 0 "1"\n', STDIN_TESTS[:1], None) == ([True], [None])


def test_invalid_utf8_is_never_text():
    """Invalid bytes fail: they do not become U+FFFD, which an expected output may hold."""
    assert judge(b'0 R "\xff"\n', [{"input": [], "output": "\ufffd"}], "f")[0] == [False]
    assert judge(b'0 O 0 "\xff"\n', [{"input": "", "output": "\ufffd"}], None)[0] == [False]
    # The runner's encoding of stdout that was not UTF-8 (surrogateescape, then JSON).
    assert judge(b'0 O 0 "\\udcff"\n', [{"input": "", "output": "\ufffd"}], None) == (
        [False],
        ["invalid utf-8"],
    )
    assert judge('0 R "é"\n'.encode(), [{"input": [], "output": "é"}], "f")[0] == [True]


def test_long_ints_are_read_exactly():
    big = 7**20000  # 16,902 digits, past Python's 4,300-digit int-to-str guard
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        digits = str(big).encode()
    finally:
        sys.set_int_max_str_digits(limit)
    tests = [{"input": [], "output": big}, {"input": [], "output": -big}]
    raw = b"0 R " + digits + b"\n1 R -" + digits + b"\n"
    assert judge(raw, tests, "f") == ([True, True], [None, None])
    assert judge(b"0 R " + digits[:-1] + b"0\n", tests[:1], "f")[0] == [False]


def test_floats_compare_relatively_with_a_floor_only_at_zero():
    # 0.0 is not an answer to a tiny nonzero expected value, however tiny.
    for want in (1e-12, 7.5e-10, 2.5e-300, -3e-11):
        assert not same_value(0.0, want), want
        assert same_value(want * (1 + 1e-12), want), want
    assert not same_value(1e-12, 2e-12)
    # At exactly 0 expected, rounding error passes; a real difference does not.
    assert same_value(1e-17, 0.0) and same_value(-0.0, 0.0) and same_value(-5e-10, 0.0)
    assert not same_value(1e-6, 0.0)
    # Elsewhere: relative to the values' size.
    assert same_value(1e12 + 1.0, 1e12) and not same_value(1.0 + 1e-6, 1.0)


def test_a_frames_digits_are_read_only_up_to_its_budget(monkeypatch):
    """Forged frames of million-digit ints are refused before any is read (reading one costs
    the host ~0.6 s); a value as long as the expected one is still read exactly."""
    read = []
    real = compare._int_from_digits
    monkeypatch.setattr(compare, "_int_from_digits", lambda t: read.append(len(t)) or real(t))
    million = b"9" * 999_999
    tests = [{"input": [], "output": 5}] * 8
    raw = b"".join(b"%d R [%s]\n" % (i, million) for i in range(8))
    assert judge(raw, tests, "f") == ([False] * 8, ["too many digits"] * 8)
    floats = b"".join(b"%d R %s.5\n" % (i, million) for i in range(8))
    assert judge(floats, tests, "f") == ([False] * 8, ["too many digits"] * 8)
    many = b"0 R [" + b",".join([b"7" * 900] * 50) + b"]\n"
    assert judge(many, tests[:1], "f") == ([False], ["too many digits"])
    assert sum(read) <= compare.DIGITS_SLACK * 9
    # The budget follows the expected value: twice its digits.
    big = 10**30000 - 1
    raw = b"0 R " + b"9" * 30000 + b"\n1 R [" + b"9" * 30000 + b", 1]\n"
    assert judge(raw, [{"input": [], "output": big}, {"input": [], "output": [big, 1]}], "f") == (
        [True, True],
        [None, None],
    )


# Forged frames millions of brackets deep, judged by a process whose recursion limit a
# trainer raised (sympy-based graders do): json's C decoder would overflow the C stack.
DEEP_FRAMES = """
import sys
from vapo_lightning.sandbox.compare import judge
sys.setrecursionlimit(100_000)
n = 2_000_000
fn_tests = [{"input": [], "output": [[1]]}] * 2
fn = judge(b"0 R " + b"[" * n + b"]" * n + b"\\n1 E " + b"[" * n + b"\\n", fn_tests, "f")
text = judge(b"0 O 0 " + b"{" * n + b"\\n", [{"input": "", "output": "1"}], None)
print(fn, text)
"""


def test_a_frame_nested_past_its_budget_fails_before_it_is_decoded():
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo}
    out = subprocess.run([sys.executable, "-c", DEEP_FRAMES], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out  # (a segfault is -11)
    deep = "nested too deeply"
    assert out.stdout.strip() == f"{([False, False], [deep, deep])} {([False], [deep])}", out


def test_a_deep_expected_value_is_read_and_compared_at_any_stack_depth():
    want = [1]
    for _ in range(compare.MAX_DEPTH - 1):
        want = [want]
    frame = b"0 R " + b"[" * compare.MAX_DEPTH + b"1" + b"]" * compare.MAX_DEPTH + b"\n"

    def nested_call(levels: int):  # a trainer's stack, deep below the judge
        return nested_call(levels - 1) if levels else judge(frame, [{"input": [], "output": want}], "f")

    assert nested_call(sys.getrecursionlimit() // 2) == ([True], [None])
    assert compare.depth(want) == compare.MAX_DEPTH
    assert same_value([[1, 2]], ((1, 2),)) and not same_value([[1, 2]], ((1, 3),))
