"""Honest programs meet what `python prog.py < input` gives them: each program here also runs
under the host's own interpreter as a subprocess, and the sandbox must match that reference
(how a program ends, the /dev links it opens, the values its function receives and
returns)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vapo_lightning.sandbox import Pool


@pytest.fixture(scope="module")
def pool():
    p = Pool(size=1)
    yield p
    p.close()


def reference(tmp_path, code: str, stdin: str = "") -> subprocess.CompletedProcess:
    """CPython's own run of `code` as a script, `stdin` on its standard input."""
    prog = tmp_path / "prog.py"
    prog.write_text(code)
    return subprocess.run(
        [sys.executable, str(prog)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def assert_as_cpython(pool, tmp_path, code: str, stdin: str) -> None:
    """Stdin mode and execute mode end with CPython's exit status and stdout."""
    want = reference(tmp_path, code, stdin)
    assert want.returncode == 0 and want.stdout, want  # (the reference itself works)
    r = pool.evaluate(code, [{"input": stdin, "output": want.stdout}], timeout_s=20.0)
    assert r.passed == 1, r
    if not stdin:  # execute mode: stdin empty
        e = pool.execute(code, timeout_s=20.0)
        assert (e.exit_code, e.stdout) == (want.returncode, want.stdout), e


# How a program ends: its non-daemon threads, its atexit functions, its own closed stdout.
ENDINGS = {
    "main_in_a_thread": """
import sys, threading
def main():
    n = int(sys.stdin.readline() or 5)
    def depth(k):
        return 0 if k == 0 else 1 + depth(k - 1)
    print(depth(200_000) + n)
threading.stack_size(1 << 26)
sys.setrecursionlimit(10**6)
threading.Thread(target=main).start()
""",
    "atexit_flushes_a_buffer": """
import atexit, io, os, sys
buffer = io.StringIO()
atexit.register(lambda: os.write(1, buffer.getvalue().encode()))
n = int(sys.stdin.readline() or 5)
buffer.write(f"{n * n}\\n")
""",
    "stdout_closed_at_the_end": """
import sys
print(int(sys.stdin.readline() or 5) + 1)
sys.stdout.close()
""",
    "sys_exit_waits_for_threads": """
import sys, threading, time
def late():
    time.sleep(0.2)
    print("late", flush=True)
threading.Thread(target=late).start()
sys.exit(0)
""",
}


@pytest.mark.parametrize("name", sorted(ENDINGS))
@pytest.mark.parametrize("stdin", ["7\n", ""])
def test_a_program_ends_as_cpython_ends_it(pool, tmp_path, name, stdin):
    assert_as_cpython(pool, tmp_path, ENDINGS[name], stdin)


DEV_LINKS = """
import os
text = open("/dev/stdin").read()
print("read", len(text), flush=True)
with open("/dev/stdout", "a") as out:
    out.write(text.upper())
print(sorted(set(os.listdir("/dev/fd")) & {"0", "1", "2"}))
with open("/dev/stderr", "w") as err:
    err.write("to stderr\\n")
"""


@pytest.mark.parametrize("stdin", ["abc\ndef\n", ""])
def test_dev_stdin_stdout_and_fd_are_there(pool, tmp_path, stdin):
    assert_as_cpython(pool, tmp_path, DEV_LINKS, stdin)


def passes_in_cpython(tmp_path, code: str, asserts: list[str]) -> bool:
    """Whether the asserts pass under CPython, after the program."""
    return reference(tmp_path, code + "\n" + "\n".join(asserts) + "\n").returncode == 0


# MBPP's own reference solution of problem 278, and its three tests.
MBPP_278 = """
def count_first_elements(test_tup):
  for count, ele in enumerate(test_tup):
    if isinstance(ele, tuple):
      break
  return (count)
"""
MBPP_278_TESTS = [
    "assert count_first_elements((1, 5, 7, (4, 6), 10) ) == 3",
    "assert count_first_elements((2, 9, (5, 7), 11) ) == 2",
    "assert count_first_elements((11, 15, 5, 8, (2, 3), 8) ) == 4",
]
# Arguments that are hashed or typed: a tuple as a dict key or set member, a dict's int and
# tuple keys, a namedtuple-free tuple inside a list.
TYPED = """
def f(pairs, table, point):
    seen = {p for p in pairs}
    return [len(seen), type(pairs[0]).__name__, table[(1, 2)], table[3], type(point).__name__]
"""
TYPED_TESTS = ["assert f([(1, 2), (1, 2), (3, 4)], {(1, 2): 'a', 3: 'b'}, (0, 0)) == [2, 'tuple', 'a', 'b', 'tuple']"]


@pytest.mark.parametrize(
    "code, asserts, fn_name",
    [(MBPP_278, MBPP_278_TESTS, "count_first_elements"), (TYPED, TYPED_TESTS, "f")],
)
def test_tuple_and_keyed_arguments_arrive_as_the_assert_passes_them(pool, tmp_path, code, asserts, fn_name):
    from vapo_lightning.sandbox.importers import from_asserts

    assert passes_in_cpython(tmp_path, code, asserts)
    imported = from_asserts(asserts, fn_name)
    assert imported.skipped == 0
    r = pool.evaluate(code, imported.tests, fn_name)
    assert r.passed == r.total == len(asserts), r


def test_an_expected_tuple_is_met_by_the_returned_tuple(pool, tmp_path):
    code = "def f(n):\n    return (n, [n + 1, (n + 2,)], {'k': (n,)})\n"
    want = (1, [2, (3,)], {"k": (1,)})
    assert passes_in_cpython(tmp_path, code, [f"assert f(1) == {want!r}"])
    tests = [{"input": [1], "output": want}, {"input": [2], "output": want}]
    r = pool.evaluate(code, tests, "f")
    assert r.per_test == [True, False], r


def test_a_value_nested_900_deep_is_returned(pool, tmp_path):
    code = "def f(n):\n    v = [0]\n    for _ in range(n - 1):\n        v = [v]\n    return v\n"
    want: list = [0]
    for _ in range(899):
        want = [want]
    assert passes_in_cpython(tmp_path, code, ["w = [0]", "for _ in range(899): w = [w]", "assert f(900) == w"])
    tests = [{"input": [900], "output": want}, {"input": [899], "output": want}]
    r = pool.evaluate(code, tests, "f")
    assert r.per_test == [True, False], r


THREADS = """
import sys, threading
def start(n):
    stop = threading.Event()
    started = 0
    try:
        for _ in range(n):
            threading.Thread(target=stop.wait).start()
            started += 1
    finally:
        stop.set()
    return started
if __name__ == "__main__":
    print(start(int(sys.stdin.readline())))
"""


def test_a_run_starts_as_many_threads_as_its_pids_limit_allows(pool, tmp_path):
    """`Limits.pids` (256) tasks: the runner and 255 threads in function mode; the runner,
    the program and its 254 threads in stdin mode."""
    if not {"pids_cgroup", "memory_cgroup"} <= set(pool.layers):
        pytest.skip("no per-run cgroups: RLIMIT_NPROC (Limits.processes) bounds threads")
    assert_as_cpython(pool, tmp_path, THREADS, "254\n")
    r = pool.evaluate(THREADS, [{"input": [255], "output": 255}], "start", 30.0)
    assert r.passed == 1, r
