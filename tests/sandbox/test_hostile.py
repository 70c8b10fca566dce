"""Hostile programs: each must score 0 and leave the host intact.

Every program is paired with expected outputs that only cheating could produce (a secret, a
value the program never computes), so a pass would mean the sandbox or the verdict leaked.
After every run we check the host: no process left running as the sandbox uid, the canary
paths outside the sandbox not created, the secret file untouched, the pool still healthy.
The programs are the files in `programs/` (`helpers.PROGRAMS` lists them); the host is the
`host` fixture (`conftest.py`). What one run could leave for the next: test_hostile_leaks.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.sandbox.helpers import KEY_SYSCALLS, PROGRAMS, TOKEN, assert_host_intact, program
from vapo_lightning.sandbox import Pool


@pytest.mark.slow
@pytest.mark.parametrize("name,code,fn_name,tests,timeout_s", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_hostile_program_scores_zero(host, name, code, fn_name, tests, timeout_s):
    lst = host["listener"]
    for key, value in (
        ("@HOME@", repr(host["home"])),
        ("@TCP@", str(lst.tcp.getsockname()[1])),
        ("@UDP@", str(lst.udp.getsockname()[1])),
        ("@TOKEN@", TOKEN),
    ):
        code = code.replace(key, value)
    result = host["pool"].evaluate(code, tests, fn_name, timeout_s=timeout_s)
    assert result.total == len(tests)
    assert result.passed == 0, result
    assert "uid_drop" in result.layers or os.geteuid() != 0
    assert_host_intact(host)


def test_there_are_at_least_40_hostile_programs():
    assert len(PROGRAMS) >= 40
    assert len({p[0] for p in PROGRAMS}) == len(PROGRAMS)


def test_escaped_pipe_holder_does_not_hold_up_the_run(host):
    code = program("escaped_pipe_holder")
    result = host["pool"].evaluate(code, [{"input": [], "output": 1}], "f", timeout_s=20)
    assert (result.passed, result.status) == (1, "ok"), result
    assert_host_intact(host)


def test_no_sockets_refuses_what_could_mark_a_shared_network_namespace(host):
    """The seccomp filter (`seccomp_filter.sandbox_filter`): no socket but AF_UNIX ones, no
    io_uring, no keyrings; a Unix socket works but reaches nothing of the host (the host's
    abstract name is in another network namespace), and so do a socketpair and descriptor
    passing on it. A syscall of another ABI (x32 here) kills the process."""
    pool = host["pool"]
    if "no_sockets" not in pool.layers or KEY_SYSCALLS is None:
        pytest.skip("no seccomp filter on this machine")
    code = program("refused_syscalls", ADD_KEY=KEY_SYSCALLS[0])
    refused = ("inet", "netlink", "pair_inet", "io_uring", "add_key")
    want = dict.fromkeys(refused, "EPERM") | {
        "host_unix": "ECONNREFUSED",
        "send_fds": "ok",
        "pair": "ok",
    }
    code = code.replace("@TOKEN@", TOKEN)
    result = pool.evaluate(code, [{"input": [], "output": want}], "f")
    assert result.passed == 1, result
    if os.uname().machine == "x86_64":  # x32 socket(): the filter's numbers would not match
        x32 = program("x32_socket")
        result = pool.evaluate(x32, [{"input": [], "output": 1}], "f")
        assert (result.passed, result.status) == (0, "crashed"), result
    assert_host_intact(host)


def test_closing_a_pool_leaves_none_of_its_processes():
    """The server's children (spares, and the mount-namespace holder of a root server) all end
    with it, and none of them keeps the host's pipes open."""
    pool = Pool(size=1)
    server = pool.servers[0].proc
    pool.evaluate("def f():\n    return 1\n", [{"input": [], "output": 1}], "f")
    children = [
        int(pid)
        for tid in os.listdir(f"/proc/{server.pid}/task")
        for pid in Path(f"/proc/{server.pid}/task/{tid}/children").read_text().split()
    ]
    assert children  # the spares at least

    def host_pipes() -> list[tuple[int, str, str]]:
        held = [(p, fd, os.readlink(f"/proc/{p}/fd/{fd}")) for p in children for fd in "01"]
        return [h for h in held if h[2].startswith("pipe:")]

    # Only the server may hold the pipes to the host (a spare forked after the run lets go
    # of them within its first steps: waited for, up to 5 s).
    deadline = time.monotonic() + 5
    while host_pipes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host_pipes() == []
    pool.close()
    assert server.returncode is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in children):
        time.sleep(0.01)
    assert not [p for p in children if os.path.exists(f"/proc/{p}")]


def test_many_idle_sandboxes_do_not_starve_a_run():
    """RLIMIT_NPROC (32 processes) counts per user namespace: 40 idle sandboxes forked ahead,
    all of one uid, leave a run its whole allowance (stdin mode forks one child per test)."""
    pool = Pool(size=1, spares=40)
    try:
        result = pool.evaluate("print(input())", [{"input": "x", "output": "x"}] * 3)
        assert (result.passed, result.status) == (3, "ok"), result
        assert "userns" in result.layers or os.geteuid() != 0 or "pidns" not in result.layers
    finally:
        pool.close()


# pidfd_getfd and ptrace syscall numbers
TRACE_SYSCALLS = {"x86_64": (438, 101), "aarch64": (438, 117)}.get(os.uname().machine)


@pytest.mark.skipif(TRACE_SYSCALLS is None, reason="syscall numbers unknown here")
def test_the_program_cannot_reach_into_the_runner(host):
    """Stdin mode: the program is a child of the runner, which holds the result pipe. Taking
    that pipe (pidfd_getfd) would let it write a frame of its own choosing (here: exit status 0
    and the expected output, although it exits 1); ptrace-attaching would do the same."""
    getfd, ptrace = TRACE_SYSCALLS
    code = program("forge_through_the_runner", GETFD=getfd)
    result = host["pool"].evaluate(code, [{"input": "", "output": "forged"}])
    assert (result.passed, result.errors) == (0, ["exit 1"]), result
    attach = program("ptrace_the_runner", PTRACE=ptrace)
    result = host["pool"].evaluate(attach, [{"input": "", "output": "refused"}])
    assert result.passed == 1, result
    assert_host_intact(host)


def test_no_process_of_a_run_is_dumpable(host):
    """A crashing candidate must not start a piped core_pattern helper (apport,
    systemd-coredump), which runs in the host's namespaces: the program's process is not
    dumpable and cannot make itself so; a child that execs (dumpable again) has RLIMIT_CORE 1,
    at which the kernel skips core dumps, piped ones included (the program's prctl 3 and 4:
    PR_GET_DUMPABLE, PR_SET_DUMPABLE)."""
    code = program("make_dumpable")
    result = host["pool"].evaluate(code, [{"input": [], "output": [0, 0, "(1, 1)"]}], "f")
    assert result.passed == 1, result
    assert_host_intact(host)
