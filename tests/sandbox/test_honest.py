"""Honest programs score exactly what they earn; the host-side comparison is type-strict."""

from __future__ import annotations

import pytest

from vapo_lightning.sandbox import Pool
from vapo_lightning.sandbox.compare import normalise_stdout, same_value
from vapo_lightning.sandbox.importers import from_asserts


@pytest.fixture(scope="module")
def pool():
    p = Pool(size=2)
    yield p
    p.close()


def _score(pool, code, tests, fn_name=None, timeout_s=10.0):
    r = pool.evaluate(code, tests, fn_name, timeout_s=timeout_s)
    assert r.total == len(tests)
    return r.passed


ADD = [
    {"input": [1, 2], "output": 3},
    {"input": [-5, 5], "output": 0},
    {"input": [10, 20], "output": 30},
]


def test_prints_while_returning(pool):
    code = "def add(a, b):\n    print('debug', a, b)\n    return a + b\n"
    assert _score(pool, code, ADD, "add") == 3


def test_partly_correct(pool):
    code = "def add(a, b):\n    return a + b if a > 0 else 99\n"
    assert _score(pool, code, ADD, "add") == 2


def test_raising_on_one_test(pool):
    code = "def add(a, b):\n    if a < 0:\n        raise ValueError('no')\n    return a + b\n"
    r = pool.evaluate(code, ADD, "add")
    assert (r.passed, r.per_test, r.errors[1]) == (2, [True, False, True], "ValueError")


def test_sys_exit_in_one_test_costs_only_that_test(pool):
    code = "import sys\ndef add(a, b):\n    if a < 0:\n        sys.exit(0)\n    return a + b\n"
    assert _score(pool, code, ADD, "add") == 2


def test_asyncio_and_a_duplex_pipe_work_without_sockets(pool):
    """The `no_sockets` filter keeps socketpair: asyncio's event loop and multiprocessing's
    duplex pipes are built on it (stdin mode too, where the program is a child process)."""
    code = (
        "import asyncio, multiprocessing.connection\n"
        "def add(a, b):\n"
        "    async def inner():\n"
        "        await asyncio.sleep(0)\n"
        "        return a + b\n"
        "    left, right = multiprocessing.connection.Pipe(duplex=True)\n"
        "    left.send(asyncio.run(inner()))\n"
        "    return right.recv()\n"
    )
    assert _score(pool, code, ADD, "add") == 3
    stdin = "import asyncio\nasync def main():\n    print(sum(map(int, input().split())))\nasyncio.run(main())\n"
    assert _score(pool, stdin, [{"input": "1 2\n", "output": "3\n"}]) == 1


def test_multiprocessing_with_the_programs_own_function(pool):
    """A process pool pickles the program's own function by reference: the program runs as a
    real module (`solution`, or `__main__` in stdin mode) that the workers can look it up in."""
    code = (
        "import multiprocessing\n"
        "def square(x):\n    return x * x\n"
        "def total(n):\n"
        "    with multiprocessing.Pool(2) as workers:\n"
        "        return sum(workers.map(square, range(n)))\n"
    )
    assert _score(pool, code, [{"input": [10], "output": 285}], "total", timeout_s=20) == 1
    stdin = code + "if __name__ == '__main__':\n    print(total(int(input())))\n"
    assert _score(pool, stdin, [{"input": "10\n", "output": "285\n"}], timeout_s=20) == 1


def test_slow_but_in_time(pool):
    code = "import time\ndef add(a, b):\n    time.sleep(0.2)\n    return a + b\n"
    assert _score(pool, code, ADD, "add", timeout_s=10) == 3


def test_timings_split_set_up_from_run(pool):
    """setup_ms ends when the sandbox reports ready (its layers), run_ms is the program."""
    code = "import time\ntime.sleep(0.3)\ndef add(a, b):\n    return a + b\n"
    r = pool.evaluate(code, ADD, "add")
    assert r.passed == 3
    assert r.run_ms >= 300 and r.setup_ms < 200, (r.setup_ms, r.run_ms)


SLOW_SERVER = """
import json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["dir"])  # as the server script imports its modules
import zygote
premake = zygote.Spares.premake_cgroups
def slow_premake(self):  # what a busy host does between the request and the sandbox's reply
    time.sleep(0.25)
    premake(self)
zygote.Spares.premake_cgroups = slow_premake
import server
del sys.path[0]
s = server.Server({"cgroup_root": args["cgroup_root"]})
header, raw = s.handle(args["request"])
s.close()
print(json.dumps(header))
"""


def test_the_run_is_timed_from_the_sandbox_not_from_when_the_server_reads_it():
    """A server busy when the sandbox reports ready (here 0.25 s making the next spare's
    cgroups) still counts the whole program in run_ms: the sandbox stamps its start. The
    server runs as `WarmServer` starts it (isolated Python, from /), its spares slowed."""
    import json
    import os
    import subprocess
    import sys

    from vapo_lightning.sandbox import client

    code = "import time\ntime.sleep(0.3)\ndef add(a, b):\n    return a + b\n"
    args = {
        "dir": os.path.dirname(client.SERVER_SCRIPT),
        "cgroup_root": client.DEFAULT_CGROUP_ROOT,
        "request": {
            "code": code,
            "inputs": ["[1, 2]"],
            "fn_name": "add",
            "timeout_s": 10.0,
            "limits": client.Limits().__dict__,
        },
    }
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", SLOW_SERVER, json.dumps(args)],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    header = json.loads(out.stdout.strip().splitlines()[-1])
    assert header["status"] == "ok", header
    assert header["run_ms"] >= 300 and header["setup_ms"] < 200, header


def test_deep_recursion_with_raised_limit(pool):
    code = "import sys\nsys.setrecursionlimit(200000)\ndef depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
    assert _score(pool, code, [{"input": [100000], "output": 100000}], "depth") == 1


def test_timeout_fails_the_remaining_tests_only(pool):
    code = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b\n"
    r = pool.evaluate(code, ADD, "add", timeout_s=1.0)
    assert (r.passed, r.status, r.per_test) == (1, "timeout", [True, False, False])


def test_imports_beyond_the_preloaded_stdlib(pool):
    code = (
        "import graphlib, zlib, json.decoder, csv, email.utils\n"
        "def f():\n    return zlib.crc32(b'abc') + len(list(graphlib.TopologicalSorter("
        "{1: [2]}).static_order()))\n"
    )
    import zlib

    assert _score(pool, code, [{"input": [], "output": zlib.crc32(b"abc") + 2}], "f") == 1


def test_threads_and_tmp_files_work(pool):
    code = (
        "import threading, tempfile\ndef f():\n    out = []\n"
        "    t = threading.Thread(target=lambda: out.append(7))\n    t.start(); t.join()\n"
        "    with tempfile.NamedTemporaryFile('w+') as fh:\n        fh.write('x')\n"
        "    open('/tmp/scratch', 'w').write('y')\n    return out[0]\n"
    )
    assert _score(pool, code, [{"input": [], "output": 7}], "f") == 1


def test_leetcode_solution_class(pool):
    code = "class Solution:\n    def twice(self, x):\n        return 2 * x\n"
    assert _score(pool, code, [{"input": [4], "output": 8}], "twice") == 1


def test_inputs_are_fresh_for_every_test(pool):
    code = "def f(xs):\n    xs.append(0)\n    return len(xs)\n"
    tests = [{"input": [[1, 2]], "output": 3}, {"input": [[1, 2]], "output": 3}]
    assert _score(pool, code, tests, "f") == 2


def test_type_strict_comparison(pool):
    tests = [{"input": [], "output": 1}]
    assert _score(pool, "def f():\n    return True\n", tests, "f") == 0
    assert _score(pool, "def f():\n    return 1.0\n", tests, "f") == 0
    assert _score(pool, "def f():\n    return '1'\n", tests, "f") == 0
    assert _score(pool, "def f():\n    return 1\n", tests, "f") == 1
    assert _score(pool, "def f():\n    return (1, [2])\n", [{"input": [], "output": [1, [2]]}], "f") == 1


def test_stdin_mode(pool):
    code = "a, b = map(int, input().split())\nprint(a + b)   \nprint()\n"
    tests = [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "2 2\n", "output": "4"},
        {"input": "2 2\n", "output": "5\n"},
    ]
    assert _score(pool, code, tests) == 2


def test_stdin_mode_whole_output_not_a_prefix(pool):
    code = "print(3)\nprint('extra')\n"
    assert _score(pool, code, [{"input": "", "output": "3\n"}]) == 0
    assert _score(pool, "print(3)", [{"input": "", "output": "3\nextra"}]) == 0


def test_stdin_mode_nonzero_exit_fails_and_runs_are_separate(pool):
    code = "import sys\nn = int(sys.stdin.read())\nprint(n * 2)\nif n == 2:\n    raise SystemExit(3)\n"
    tests = [
        {"input": "1", "output": "2"},
        {"input": "2", "output": "4"},
        {"input": "3", "output": "6"},
    ]
    r = pool.evaluate(code, tests)
    assert (r.passed, r.errors[1]) == (2, "exit 3")


def test_syntax_error_scores_zero_with_reason(pool):
    r = pool.evaluate("def f(:\n", [{"input": [], "output": 1}], "f")
    assert (r.passed, r.errors) == (0, ["SyntaxError"])


def test_no_tests_is_zero_of_zero(pool):
    r = pool.evaluate("def f(): pass", [], "f")
    assert (r.passed, r.total) == (0, 0)


def test_a_sandbox_that_fails_to_set_up_is_a_setup_error_not_a_crash(pool):
    """A set-up failure after the sandbox forked (here: a file limit the kernel refuses) ends
    the sandbox before the program ran: `setup_error` with the sandbox's message, told from a
    program that ends its own process (`crashed`, the program's fault)."""
    from vapo_lightning.sandbox import Limits

    tests = [{"input": "1\n", "output": "1\n"}]
    r = pool.evaluate("print(input())", tests, limits=Limits(open_files=2**40))
    assert r.status == "setup_error" and r.passed == 0
    assert any("not allowed to raise maximum limit" in e for e in r.setup_errors), r
    r = pool.evaluate("def f(x):\n    import os\n    os._exit(3)", [{"input": [1], "output": 1}], fn_name="f")
    assert r.status == "crashed" and r.passed == 0
    assert pool.evaluate("print(input())", tests).passed == 1  # the pool is fine afterwards


def test_same_value_rules():
    assert same_value([1, {"a": None}], [1, {"a": None}])
    assert not same_value(True, 1) and not same_value(1, True) and not same_value(1, 1.0)
    assert same_value(0.1 + 0.2, 0.3) and not same_value(0.3001, 0.3)
    assert same_value(0.3001, 0.3, tol=1e-3) and not same_value(0.302, 0.3, tol=1e-3)
    assert not same_value([1, 2], [1, 2, 3]) and not same_value({"a": 1}, {"a": 1, "b": 2})


def test_normalise_stdout():
    assert normalise_stdout("1 \n2\t\n\n") == normalise_stdout("1\n2")
    assert normalise_stdout(" 1") != normalise_stdout("1")
    assert normalise_stdout("1\n\n2") != normalise_stdout("1\n2")


def test_stdin_mode_invalid_utf8_fails(pool):
    """Bytes that are not UTF-8 fail the test; they are not read as U+FFFD."""
    bad = "import sys\nsys.stdout.buffer.write(b'\\xff\\n')\n"
    assert _score(pool, bad, [{"input": "", "output": "\ufffd"}]) == 0
    good = "import sys\nsys.stdout.buffer.write('\\ufffd é\\n'.encode())\n"
    assert _score(pool, good, [{"input": "", "output": "\ufffd é"}]) == 1


def test_returns_an_int_past_the_int_to_str_guard(pool):
    """Python refuses str() of ints over 4,300 digits by default; an answer may be longer."""
    code = "def f(n):\n    return 7 ** n\n"
    tests = [{"input": [20000], "output": 7**20000}, {"input": [3], "output": 343}]
    assert _score(pool, code, tests, "f") == 2


def test_a_tolerance_test_accepts_an_int(pool):
    """`assert abs(area(2, 3) - 6.0) < 1e-6` holds for an int 6; so does the imported test."""
    imported = from_asserts("assert abs(area(2, 3) - 6.0) < 1e-6", "area")
    code = "def area(a, b):\n    return a * b\n"
    assert _score(pool, code, imported.tests, "area") == 1
    assert _score(pool, "def area(a, b):\n    return True\n", imported.tests, "area") == 0


SPAWN_CODE = """
import multiprocessing as mp
import sys

def square(x):
    return x * x

def squares(method, n):
    with mp.get_context(method).Pool(2) as pool:
        return pool.map(square, range(n))

if __name__ == "__main__":
    print(squares(sys.stdin.read().strip(), 4))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_multiprocessing_spawn_and_forkserver(pool, method):
    """Both start a fresh interpreter (the forkserver then serves forks over a Unix socket),
    which re-imports the program: the interpreter, the stdlib and the program must be reachable
    inside the sandbox. Function mode and stdin mode (a `__main__` guarded script)."""
    want = [0, 1, 4, 9]
    assert _score(pool, SPAWN_CODE, [{"input": [method, 4], "output": want}], "squares") == 1
    assert _score(pool, SPAWN_CODE, [{"input": method, "output": str(want)}]) == 1
