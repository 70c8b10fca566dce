"""Honest programs near the sandbox's limits: each passes, or meets a limit that the docs
state (`Limits`, docs/sandbox.md)."""

from __future__ import annotations

import pytest

from vapo_lightning.sandbox import Limits, Pool
from vapo_lightning.sandbox.importers import from_asserts


@pytest.fixture(scope="module")
def pool():
    p = Pool(size=1)
    yield p
    p.close()


def test_a_dict_with_int_keys_is_returned(pool):
    code = "def f(s):\n    return {i + 1: c for i, c in enumerate(s)}\n"
    imported = from_asserts("assert f('ab') == {1: 'a', 2: 'b'}", "f")  # MBPP's form
    tests = [
        *imported.tests,
        {"input": ["ab"], "output": {1: "a", 2: "b"}},
        {"input": ["ab"], "output": {1: "a", 3: "b"}},
    ]
    r = pool.evaluate(code, tests, "f")
    assert r.per_test == [True, True, False], r
    bad = "def f():\n    return {(1, 2): 3}\n"
    r = pool.evaluate(bad, [{"input": [], "output": 3}], "f")
    assert r.errors == ["TypeError"], r


THREADS = """
import threading
def f(n):
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(n)]
    for t in threads:
        t.start()
    stop.set()
    for t in threads:
        t.join()
    return n
"""


def test_48_threads_start_under_the_runs_pids_limit(pool):
    if "pids_cgroup" not in pool.layers:
        pytest.skip("no pids cgroup: RLIMIT_NPROC (Limits.processes) counts threads too")
    assert Limits().processes < 48 < Limits().pids
    r = pool.evaluate(THREADS, [{"input": [48], "output": 48}], "f", 30.0)
    assert r.passed == 1, r


SHARED_MEMORY = """
from multiprocessing import shared_memory
def f(mb):
    shm = shared_memory.SharedMemory(create=True, size=mb << 20)
    try:
        shm.buf[:] = b"\\1" * (mb << 20)
        return sum(shm.buf[:: 1 << 16])
    finally:
        shm.close()
        shm.unlink()
"""


def test_shared_memory_of_4_mb(pool):
    if "private_tmp" not in pool.layers:
        pytest.skip("no private /dev/shm here")
    r = pool.evaluate(SHARED_MEMORY, [{"input": [4], "output": 64}], "f", 30.0)
    assert r.passed == 1, r


def test_non_ascii_output_counts_its_bytes_not_json_escapes(pool):
    """2.8 MB of 'é' (1.4 M characters) as stdout and 3 MB as a returned string: under the
    run's 8 MB output cap, which JSON's \\u escapes (6 bytes a character) used to pass."""
    assert Limits().output_bytes == 8 << 20
    text = "é" * 1_400_000
    stdin = pool.evaluate(
        "print('é' * 1_400_000)\n",
        [{"input": "", "output": text}],
        timeout_s=30.0,
        limits=Limits(stdout_bytes=4 << 20),
    )
    assert (stdin.status, stdin.passed) == ("ok", 1), stdin
    returned = pool.evaluate("def f():\n    return 'é' * 1_500_000\n", [{"input": [], "output": "é" * 1_500_000}], "f")
    assert (returned.status, returned.passed) == ("ok", 1), returned
