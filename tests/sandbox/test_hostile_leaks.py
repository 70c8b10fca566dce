"""What one run could leave for the next, or take from a run beside it: state the kernel keeps
per namespace or per user, files, SysV shared memory and sockets held by a daemon, the bytes of
earlier requests in a sandbox's memory, a user's share of pipe buffers. The programs are
files in `programs/`; the host is the `host` fixture (`conftest.py`).
"""

from __future__ import annotations

import os
import secrets
import threading
import time

import pytest

from tests.sandbox.helpers import KEY_SYSCALLS, assert_host_intact, program
from vapo_lightning.sandbox import Pool


@pytest.mark.skipif(KEY_SYSCALLS is None, reason="add_key/keyctl numbers unknown here")
@pytest.mark.parametrize("seccomp", [True, False], ids=["no_sockets", "sockets_allowed"])
def test_no_kernel_state_crosses_runs(host, seccomp):
    """State kept by the kernel per namespace or per user, not per process: network counters
    (/proc/net/snmp counts datagrams with no route) and the uid's user keyring. Each run has a
    user namespace of its own, and a network namespace that either is its own (sockets allowed)
    or that no run can write to (`no_sockets`: a server's runs share it, and the filter refuses
    the keyring syscalls too), so the next run (and a fresh pool) sees neither."""
    add_key, keyctl = KEY_SYSCALLS
    writer = program("kernel_state_writer", ADD_KEY=add_key)
    probe = program("kernel_state_probe", KEYCTL=keyctl)
    reader = "import ctypes\n" + probe + "def f():\n    return probe()\n"
    pool = host["pool"] if seccomp else Pool(size=1, seccomp=False)
    fresh = Pool(size=1, seccomp=seccomp)
    try:
        no_sockets = "no_sockets" in pool.layers
        assert no_sockets == (seccomp and "no_sockets" in fresh.layers)
        wrote = ["refused", "no key"] if no_sockets else ["sent", "written"]
        result = pool.evaluate(writer, [{"input": [], "output": wrote}], "f")
        assert result.passed == 1, result
        # The check can fail: within the writer's own run, both are seen (with `no_sockets`
        # neither can be written: the sockets_allowed case is the one that shows it).
        both = writer + probe + "def h():\n    f()\n    return probe()\n"
        counted = ["0", False] if no_sockets else ["37", True]
        seen = pool.evaluate(both, [{"input": [], "output": counted}], "h")
        assert seen.passed == 1, seen
        for p in (pool, pool, pool, fresh):  # whichever server of the pool runs it, or another
            result = p.evaluate(reader, [{"input": [], "output": ["0", False]}], "f")
            assert result.passed == 1, result
    finally:
        fresh.close()
        if not seccomp:
            pool.close()
    assert_host_intact(host)


@pytest.mark.parametrize("seccomp", [True, False], ids=["no_sockets", "sockets_allowed"])
def test_no_cross_run_leakage(host, seccomp):
    """Files, SysV shared memory, and sockets held by a daemon (a UDP port and an abstract
    Unix name, where sockets are allowed: they live in the run's network namespace) are all
    gone for the next run."""
    pool = host["pool"] if seccomp else Pool(size=2, seccomp=False)
    try:
        _no_cross_run_leakage(pool)
    finally:
        if not seccomp:
            pool.close()
    assert_host_intact(host)


def _no_cross_run_leakage(pool) -> None:
    writer = program("crossrun_writer")
    assert pool.evaluate(writer, [{"input": [], "output": "written"}], "f").passed == 1
    reader = program("crossrun_reader")
    for _ in range(3):  # whichever server of the pool runs it
        result = pool.evaluate(reader, [{"input": [], "output": "clean"}], "f")
        assert result.passed == 1, result


def _scanner(halves: list[tuple[str, str]]) -> str:
    """A program that looks for each `a + b` in all of its readable memory without ever
    building that string itself (it finds `a`, then compares what follows with `b`)."""
    return program("memory_scanner", HALVES=repr([(a.encode(), b.encode()) for a, b in halves]))


def test_no_byte_of_an_earlier_request_is_in_a_later_run():
    """A sandbox forked after earlier requests were handled would inherit them (objects still
    referenced, freed memory never overwritten) and could copy a sibling sample's code and
    inputs. Every later run's whole address space is searched for the earlier request's code
    and inputs, over more runs than there are spares forked ahead."""
    code_mark = ("vapo-code-" + secrets.token_hex(6), secrets.token_hex(6))
    input_mark = ("vapo-input-" + secrets.token_hex(6), secrets.token_hex(6))
    pool = Pool(size=1, spares=2)
    try:
        earlier = f"MARK = {''.join(code_mark)!r}\ndef f(x):\n    return len(x)\n"
        given = "".join(input_mark)
        tests = [{"input": [given], "output": len(given)}] * 3
        assert pool.evaluate(earlier, tests, "f").passed == 3
        scanner = _scanner([code_mark, input_mark])
        # The check can fail: within the run that holds them, both are found.
        both = scanner + f"HELD = {''.join(code_mark)!r}\ndef g(x):\n    return f()\n"
        want = sorted([code_mark[0], input_mark[0]])
        held = pool.evaluate(both, [{"input": [given], "output": want}], "g")
        assert held.passed == 1, held
        for _ in range(4):
            later = pool.evaluate(scanner, [{"input": [], "output": []}], "f")
            assert later.passed == 1, later
    finally:
        pool.close()


def test_concurrent_runs_share_no_per_user_limit():
    """Two runs at once, on two servers: one fills its user's pipe-buffer allowance
    (fs.pipe-user-pages-soft, 64 MiB by default), which with a shared uid would leave the
    other unable to size a pipe (F_SETPIPE_SZ: EPERM). Each server's sandboxes have a uid of
    their own."""
    hog = program("pipe_hog")
    sized = program("pipe_sizer")
    pool = Pool(size=2)
    try:
        assert pool.servers[0].uid != pool.servers[1].uid or os.geteuid() != 0
        results = {}
        first = threading.Thread(
            target=lambda: results.update(hog=pool.evaluate(hog, [{"input": [], "output": True}], "f"))
        )
        first.start()
        time.sleep(1.0)  # the hog holds its pipes for 4 s
        results["sized"] = pool.evaluate(sized, [{"input": [], "output": 1 << 20}], "f")
        first.join()
        assert results["hog"].passed == 1, results["hog"]
        assert results["sized"].passed == 1 or os.geteuid() != 0, results["sized"]
    finally:
        pool.close()
