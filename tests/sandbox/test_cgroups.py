"""Per-run cgroups: one memory limit for all of a run's processes and its memfd pages, and a
limit on its tasks; without cgroups the report says so and ``min_isolation="full"`` refuses.

The limits are checked against programs that stay under every per-process limit (RLIMIT_AS,
RLIMIT_FSIZE, RLIMIT_NPROC) and break only the per-run one. Skipped where this machine gives
no cgroup (not root, no cgroup v1 memory hierarchy).
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest

from vapo_lightning.rewards.code import CodeReward, missing_isolation
from vapo_lightning.sandbox import Limits, Pool
from vapo_lightning.sandbox.cgroups import DEFAULT_ROOT

NO_CGROUPS = "/proc/vapo-no-cgroups"  # nothing can be made there, even as root

# Forks n children that each fill `mb` MiB and hold it, all at once; "held" once all have.
CHILDREN_HOLD = """
def f(n, mb):
    import os, select
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    for _ in range(n):
        if os.fork() == 0:
            block = b"\\1" * (mb << 20)
            os.write(ready_w, b"+")
            os.read(hold_r, 1)  # blocks for as long as the parent lives
            os._exit(0)
    got = 0
    while got < n:
        if select.select([ready_r], [], [], 0.05)[0]:
            got += len(os.read(ready_r, n))
        elif os.waitpid(-1, os.WNOHANG)[0]:
            return "a child died"
    return "held"
"""

# Fills `files` memfds of `mb` MiB each (each under RLIMIT_FSIZE, none in any address space).
MEMFDS = """
def f(files, mb):
    import os
    fds = []
    for _ in range(files):
        fd = os.memfd_create("x")
        for _ in range(mb):
            os.write(fd, b"a" * (1 << 20))
        fds.append(fd)
    return "wrote"
"""

THREADS = """
def f(n):
    import threading
    stop = threading.Event()
    started = []
    for _ in range(n):
        t = threading.Thread(target=stop.wait)
        try:
            t.start()
        except RuntimeError:  # can't start new thread
            break
        started.append(t)
    stop.set()
    return len(started)
"""


pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.isdir(f"{DEFAULT_ROOT}/memory"),
    reason="per-run cgroups need root and the cgroup v1 memory hierarchy",
)


@pytest.fixture(scope="module", params=["direct", "via_userns"])
def pool(request):
    pool = Pool(1, via_userns=request.param == "via_userns")
    assert {"memory_cgroup", "pids_cgroup"} <= set(pool.layers), pool.layers
    yield pool
    pool.close()


def test_processes_of_one_run_share_its_memory_limit(pool):
    limits = Limits(memory_mb=512)
    alone = pool.evaluate(CHILDREN_HOLD, [{"input": [1, 160], "output": "held"}], "f", 30.0, limits)
    assert (alone.status, alone.passed) == ("ok", 1), alone
    together = pool.evaluate(CHILDREN_HOLD, [{"input": [4, 160], "output": "held"}], "f", 30.0, limits)
    assert (together.status, together.passed) == ("memory_limit", 0), together


def test_memfd_pages_count_toward_the_run_limit(pool):
    limits = Limits(memory_mb=256)
    small = pool.evaluate(MEMFDS, [{"input": [8, 8], "output": "wrote"}], "f", 30.0, limits)
    assert (small.status, small.passed) == ("ok", 1), small
    big = pool.evaluate(MEMFDS, [{"input": [60, 8], "output": "wrote"}], "f", 30.0, limits)
    assert (big.status, big.passed) == ("memory_limit", 0), big


def test_pids_limit_bounds_the_runs_tasks(pool):
    tests = [{"input": [40], "output": 40}]
    roomy = pool.evaluate(THREADS, tests, "f", 30.0, Limits(processes=128, pids=256))
    assert (roomy.status, roomy.passed) == ("ok", 1), roomy
    tight = pool.evaluate(THREADS, tests, "f", 30.0, Limits(processes=128, pids=16))
    assert tight.status == "ok" and tight.errors == ["wrong"], tight


def test_report_lists_the_layers_and_each_run_cgroup_goes(pool):
    r = pool.evaluate("def f():\n    return 1\n", [{"input": [], "output": 1}], "f")
    assert {"memory_cgroup", "pids_cgroup"} <= set(r.layers)
    server = pool.servers[0].proc.pid
    with open("/proc/self/cgroup") as f:
        own = dict(line.split(":", 2)[1:] for line in f.read().splitlines())
    base = f"{DEFAULT_ROOT}/memory{own['memory'].rstrip('/')}/vapo-sandbox-{server}"
    runs = [d for d in os.listdir(base) if d.startswith("run-")]
    assert len(runs) == 2, runs  # the two spares' own; the finished run's is gone
    # another /tmp size: the spares are discarded, and their cgroups with them
    pool.evaluate("def f():\n    return 1\n", [{"input": [], "output": 1}], "f", 10.0, Limits(tmp_mb=32))
    runs = [d for d in os.listdir(base) if d.startswith("run-")]
    assert len(runs) == 2, runs


def test_without_cgroups_the_report_says_so_and_full_refuses(monkeypatch):
    pool = Pool(1, spares=1, cgroup_root=NO_CGROUPS)
    try:
        r = pool.evaluate("def f():\n    return 1\n", [{"input": [], "output": 1}], "f")
    finally:
        pool.close()
    assert r.passed == 1 and not {"memory_cgroup", "pids_cgroup"} & set(r.layers), r
    assert missing_isolation(r.layers, "full", is_root=True) == [
        "memory_cgroup",
        "pids_cgroup",
        "cpu_cgroup",
    ]
    import vapo_lightning.rewards.code as code_mod

    monkeypatch.setattr(code_mod, "Pool", functools.partial(Pool, cgroup_root=NO_CGROUPS))
    with pytest.raises(RuntimeError, match=r"(?s)Missing:.*memory_cgroup.*pids_cgroup.*cpu"):
        CodeReward(min_isolation="full", num_workers=1)
    CodeReward(min_isolation="strong", num_workers=1).close()


def test_a_dead_servers_folders_are_taken_over():
    """A server killed before it could clean up leaves its folders; where the cgroup is shared
    beyond one process tree (the root of a hierarchy), a later server whose pid is the dead
    one's finds them. It removes the stale run folders and keeps both layers."""
    from vapo_lightning.sandbox.cgroups import RunCgroups, _own_paths

    own = _own_paths()
    tag = f"vapo-sandbox-test-{os.getpid()}"
    stale = [os.path.join(DEFAULT_ROOT, c, own[c].lstrip("/"), tag) for c in ("memory", "pids")]
    for d in stale:
        os.makedirs(os.path.join(d, "run-1"))
    try:
        cgroups = RunCgroups(tag=tag)
        try:
            assert cgroups.available and cgroups.pids is not None
            assert [cgroups.memory, cgroups.pids] == stale
            assert not any(os.path.exists(os.path.join(d, "run-1")) for d in stale)
            made = cgroups.create(64 << 20, 16)
            assert cgroups.layers(made) == ["memory_cgroup", "pids_cgroup", "cpu_cgroup"]
            cgroups.remove(made)
        finally:
            cgroups.close()
        assert not any(os.path.exists(d) for d in stale)
    finally:  # a failed run must not leave folders that fail the next one
        for d in stale:
            for leftover in (os.path.join(d, "run-1"), d):
                with contextlib.suppress(OSError):
                    os.rmdir(leftover)


def test_a_folder_still_in_use_is_not_taken_over():
    """A stale run folder that still holds a task cannot be removed: the server takes the next
    free name and keeps its layers."""
    import subprocess

    from vapo_lightning.sandbox.cgroups import RunCgroups, _own_paths

    own = _own_paths()
    tag = f"vapo-sandbox-test-{os.getpid()}"
    busy = os.path.join(DEFAULT_ROOT, "pids", own["pids"].lstrip("/"), tag, "run-1")
    os.makedirs(busy)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"{busy}/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        cgroups = RunCgroups(tag=tag)
        try:
            assert cgroups.available and cgroups.pids == os.path.dirname(busy) + ".1"
        finally:
            cgroups.close()
    finally:
        sleeper.kill()
        sleeper.wait()  # a reaped task leaves its cgroup
        os.rmdir(busy)
        os.rmdir(os.path.dirname(busy))


def test_a_runs_cgroups_go_only_once_its_last_process_has_left():
    """The server removes a finished run's cgroups before it replies: a process still in
    them (here one the test put there) is killed and waited for, and the folders go."""
    import subprocess

    from vapo_lightning.sandbox.cgroups import RunCgroups

    cgroups = RunCgroups(tag=f"vapo-sandbox-test-{os.getpid()}")
    if not cgroups.available:
        cgroups.close()
        pytest.skip("no cgroups to make here")
    late = subprocess.Popen(["sleep", "60"])
    try:
        made = cgroups.create(64 << 20, 16)
        for d in made:
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(str(late.pid))
        cgroups.remove(made)
        assert late.wait(timeout=5) == -9
        assert not any(os.path.exists(d) for d in made), made
    finally:
        late.kill()
        late.wait()
        cgroups.close()
