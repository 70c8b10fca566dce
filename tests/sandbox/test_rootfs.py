"""The run's minimal root (`sandbox.rootfs`): what it holds, and the way back when the kernel
refuses `pivot_root`."""

from __future__ import annotations

import os
import sys

import pytest

from vapo_lightning.sandbox import layers as L
from vapo_lightning.sandbox import rootfs
from vapo_lightning.sandbox.isolation import DEVICES, READ_PATHS


def test_plan_lists_each_path_once_with_its_parents_first():
    prefix = os.path.realpath(sys.base_prefix)
    folders, entries = rootfs.plan([*READ_PATHS, prefix, f"{prefix}/lib"], list(DEVICES))
    paths = [p for _, p, _ in entries]
    assert len(paths) == len(set(paths))
    assert f"{prefix}/lib" not in paths  # below the prefix, which is planned
    for i, folder in enumerate(folders):
        assert os.path.dirname(folder) in ("/", *folders[:i]), folder
    assert {"/tmp", "/dev/shm", "/proc"} <= set(folders)
    assert all(kind == "dev" for kind, p, _ in entries if p in DEVICES)
    links = {p: target for kind, p, target in entries if kind == "link"}
    assert links["/dev/stdin"] == "/proc/self/fd/0" and links["/dev/fd"] == "/proc/self/fd"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")
def test_a_refused_pivot_root_leaves_the_hosts_tree_as_it_was(monkeypatch):
    """In a throw-away child with a mount namespace of its own: the build stops at the
    refused pivot, the staging tmpfs is gone, and the run's own folders can still be made."""
    layout = rootfs.plan(list(READ_PATHS), list(DEVICES))
    before = os.stat("/tmp").st_dev
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            L.unshare(L.CLONE_NEWNS)

            def refuse(new_root: str, put_old: str) -> None:
                raise OSError(22, "pivot_root refused")

            rootfs._pivot_root = refuse
            try:
                rootfs.build(layout, 1 << 20, read_only=True)
            except rootfs.NoPivot:
                unchanged = os.stat("/tmp").st_dev == before and os.path.isdir("/usr/bin")
                rootfs.private_folders(1 << 20)
                fresh = os.stat("/tmp").st_dev != before and os.listdir("/tmp") == []
                code = 0 if unchanged and fresh else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\0"
