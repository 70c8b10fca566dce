"""Per-run cgroups on cgroup v2 (`cgroups.RunCgroups` with ``version`` 2).

This host may be v1 for memory, pids and cpu (hybrid: a cgroup2 mount with none of them free,
at /sys/fs/cgroup/unified). What runs against the real v2 tree there: detecting it, the
server's and each run's folders, sandboxes joining them, ``cgroup.kill`` of a dead server's
leftovers and the folders' removal. What cannot (the controllers are v1's): enabling memory,
pids and cpu in ``cgroup.subtree_control`` and the kernel enforcing the limits; the limit
files are written to a tree of plain files instead, named as the kernel's cgroup-v2.rst does.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from vapo_lightning.sandbox import Pool, cgroups
from vapo_lightning.sandbox.cgroups import DEFAULT_ROOT, RunCgroups

V2_ROOT = next(
    (r for r in (DEFAULT_ROOT, f"{DEFAULT_ROOT}/unified") if os.path.exists(f"{r}/cgroup.controllers")),
    None,
)
real_tree = pytest.mark.skipif(os.geteuid() != 0 or V2_ROOT is None, reason="needs root and a cgroup2 mount")


def _populated(base: str) -> bool:
    """Whether a run folder below `base` holds a process (its ``cgroup.events``)."""
    for d in os.listdir(base):
        if d.startswith("run-"):
            with open(f"{base}/{d}/cgroup.events") as f:
                if "populated 1" in f.read():
                    return True
    return False


def _own_v2() -> str:
    with open("/proc/self/cgroup") as f:
        return next(line[3:] for line in f.read().splitlines() if line.startswith("0::"))


@real_tree
def test_runs_join_their_own_v2_cgroup_and_the_folders_go_with_the_server():
    pool = Pool(1, spares=1, cgroup_root=V2_ROOT)
    server = pool.servers[0].proc.pid
    base = os.path.join(V2_ROOT, _own_v2().lstrip("/"), f"vapo-sandbox-{server}")
    try:
        code = "def f():\n    return open('/proc/self/cgroup').read()\n"
        r = pool.evaluate(code, [{"input": [], "output": ""}], "f")
        assert r.status == "ok" and r.errors == ["wrong"], r
        assert os.path.isdir(base)
        pool.spare_sessions()  # (the next spare is forked after the reply: now it is)
        end = time.monotonic() + 20  # it joins its folder first thing, on its own
        while not _populated(base) and time.monotonic() < end:
            time.sleep(0.02)
        assert _populated(base), "the spare is in its run's folder"
    finally:
        pool.close()
    assert not os.path.exists(base)


@real_tree
def test_a_new_server_kills_and_removes_a_dead_servers_v2_leftovers():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid: no server runs under it
    stale = os.path.join(V2_ROOT, _own_v2().lstrip("/"), f"vapo-sandbox-{dead.pid}")
    os.makedirs(f"{stale}/run-1")
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        with open(f"{stale}/run-1/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        cgroups = RunCgroups(V2_ROOT)
        try:
            assert cgroups.version == 2 and cgroups.available
            assert sleeper.wait(timeout=30) == -9  # killed through cgroup.kill
            assert not os.path.exists(stale)
        finally:
            cgroups.close()
    finally:
        sleeper.kill()
        sleeper.wait()
        for d in (f"{stale}/run-1", stale):
            if os.path.isdir(d):
                os.rmdir(d)


# The interface files the kernel makes in a new v2 cgroup, for a tree of plain files.
FAKE_FILES = {
    "cgroup.controllers": "memory pids cpu\n",
    "cgroup.subtree_control": "memory pids\n",
    "cgroup.procs": "",
    "cgroup.kill": "",
    "memory.max": "",
    "memory.swap.max": "",
    "memory.events": "low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\noom_group_kill 0\n",
    "pids.max": "",
    "cpu.weight": "",
}


def test_v2_limits_are_written_to_the_kernels_files(tmp_path, monkeypatch):
    """memory.max, memory.swap.max 0 (no swap) and pids.max in each run's cgroup; cpu.weight
    in the server's; the OOM kills read from memory.events. Plain files stand in for the
    kernel's: a new folder gets them as the kernel would make them."""
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777):
        real_mkdir(path, mode)
        if str(path).startswith(str(tmp_path)):
            for name, text in FAKE_FILES.items():
                with open(os.path.join(path, name), "w") as f:
                    f.write(text)

    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids cpu\n")
    (root / "cgroup.subtree_control").write_text("memory pids cpu\n")
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/"})
    cg = RunCgroups(str(root), tag="vapo-sandbox-test")
    assert (cg.version, cg.available, cg.cpu) == (2, True, str(root / "vapo-sandbox-test"))
    assert (root / "vapo-sandbox-test" / "cpu.weight").read_text() == "100"
    run = cg.create(256 << 20, 64)
    assert run == [str(root / "vapo-sandbox-test" / "run-1")]
    written = {n: Path(run[0], n).read_text() for n in ("memory.max", "memory.swap.max")}
    assert written == {"memory.max": str(256 << 20), "memory.swap.max": "0"}
    assert Path(run[0], "pids.max").read_text() == "64"
    assert cg.oom_kills(run) == 2
    assert cg.layers(run) == ["memory_cgroup", "pids_cgroup", "cpu_cgroup"]
