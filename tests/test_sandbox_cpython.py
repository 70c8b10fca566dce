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
    print(sum(range(n)))
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
