"""The run's file system: a minimal root holding only what a program needs.

A copy of the host's mount tree would show every named Unix socket on the host (D-Bus,
journald's /dev/log, a database's, a container runtime's) one `connect()` away: Landlock
does not cover connecting to a socket by path, and the seccomp filter allows AF_UNIX (for
multiprocessing). So each sandbox, in its own mount namespace, builds a fresh tmpfs root
with the system's libraries and programs (/usr, /lib, /bin, ...), the interpreter's prefix,
the stdlib folders, four devices and the standard streams' links, all read-only, the run's
own /tmp and /dev/shm and a fresh /proc (its host-wide files hidden); `pivot_root` makes it
the root and the host's tree is detached. The server plans it once at
start (`plan`); each sandbox builds it before its uid drop. Named sockets that live below
these folders (none do on the usual layouts) are reachable still.

Stdlib only, as `layers`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

if __package__:
    from . import layers as L
else:  # imported by server.py run as a script
    import layers as L

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine) if L.IS_LINUX else None
_MNT_DETACH = 2
STAGE = "/tmp"
"""Where the new root is built, in the sandbox's own mount namespace (a tmpfs mounted there
hides the host's /tmp from this namespace only)."""


_OWN = ("/tmp", "/dev/shm", "/proc")
"""The run's own folders, mounted fresh in its root."""

LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
"""The standard streams' links, made in every root (the host's own point into its /proc)."""

HIDDEN = ("/proc/locks", "/proc/loadavg", "/proc/meminfo", "/proc/sys/fs/file-nr")
"""Files of the run's fresh /proc that show the whole host (every file lock, the task count
and load, the memory, the open files), so that concurrent runs could signal each other
through them: each reads as an empty file."""


def plan(paths: list[str], devices: list[str]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """In the server, at start: what each sandbox's root will hold. Returns the folders to
    make (parents first) and the entries, (kind, path, target): kind ``link`` for a symlink
    (/lib -> usr/lib, `target` its text), else ``dir``, ``file`` or ``dev`` for a bind
    mount of `path`. A path below one already planned is left out."""
    entries: list[tuple[str, str, str]] = []
    for p in [*paths, *devices]:
        if not os.path.lexists(p) or any(p.startswith(e[1] + "/") for e in entries):
            continue
        if os.path.islink(p):
            entries.append(("link", p, os.readlink(p)))
        else:
            kind = "dev" if p in devices else ("dir" if os.path.isdir(p) else "file")
            entries.append((kind, p, ""))
    entries += [("link", p, target) for p, target in LINKS.items()]
    folders = {*_OWN} | {p for kind, p, _ in entries if kind == "dir"}
    for p in [*folders, *(p for _, p, _ in entries)]:
        while (p := os.path.dirname(p)) != "/":
            folders.add(p)
    return sorted(folders, key=lambda f: f.count("/")), entries


def build(layout: tuple[list[str], list[tuple[str, str, str]]], tmp_bytes: int, read_only: bool):
    """In a sandbox's fresh mount namespace, with CAP_SYS_ADMIN there: the minimal root of
    `layout` (`plan`), read-only (`_read_only`), a fresh /proc (own PIDs, `HIDDEN` files
    empty), its own /dev/shm and /tmp (tmpfs of `tmp_bytes` each; the run's memory cgroup
    bounds their pages with the rest), `pivot_root` into it and the host's tree detached. `read_only` (a root server's direct path): the root server may, and must,
    make every bind mount read-only; in a user namespace (the host's mount flags are locked
    there) the devices must be, the rest may be. There a path the sandbox uid cannot reach
    (an interpreter below a mode-700 /root) is left out: the stdlib is then imported through
    folders the server opened (`fd_import.DirFdFinder`). Returns the paths left out."""
    folders, entries = layout
    L.mount("none", "/", None, L.MS_REC | L.MS_PRIVATE)
    L.mount("tmpfs", STAGE, "tmpfs", L.MS_NOSUID | L.MS_NODEV, "size=256k,mode=755")
    for folder in folders:
        os.mkdir(STAGE + folder, 0o755)
    left_out, bound = [], []
    for kind, path, link in entries:
        if kind == "link":
            os.symlink(link, STAGE + path)
        elif _bind(kind, path, STAGE + path, read_only):
            bound.append((kind, STAGE + path))
        else:
            left_out.append(path)
    _read_only(bound, read_only)
    opts = L.MS_NOSUID | L.MS_NODEV
    L.mount("tmpfs", f"{STAGE}/dev/shm", "tmpfs", opts | L.MS_NOEXEC, f"size={tmp_bytes},mode=1777")
    # (proc while the host's is in view: a user namespace may mount one only then)
    L.mount("proc", f"{STAGE}/proc", "proc", opts | L.MS_NOEXEC)
    try:  # the host's tree goes below /tmp, is detached there, then /tmp is mounted over it
        _pivot_root(STAGE, f"{STAGE}/tmp")
    except OSError as err:  # e.g. a root on initramfs: `private_folders` instead
        L.libc.umount2(STAGE.encode(), _MNT_DETACH)
        raise NoPivot(err) from err
    os.chdir("/")
    L.check(L.libc.umount2(b"/tmp", _MNT_DETACH), "umount2 /tmp")
    L.mount("tmpfs", "/tmp", "tmpfs", opts, f"size={tmp_bytes},mode=1777")
    _hide(HIDDEN)
    return left_out


class NoPivot(OSError):
    """`pivot_root` was refused; the host's tree is as it was (`private_folders` then)."""


def private_folders(tmp_bytes: int) -> None:
    """Without a minimal root (`NoPivot`): fresh /tmp, /dev/shm and /proc over the host's,
    in this mount namespace. The host's other folders (and their sockets) stay visible."""
    opts = L.MS_NOSUID | L.MS_NODEV
    L.mount("tmpfs", "/tmp", "tmpfs", opts, f"size={tmp_bytes},mode=1777")
    if os.path.isdir("/dev/shm"):
        L.mount("tmpfs", "/dev/shm", "tmpfs", opts | L.MS_NOEXEC, f"size={tmp_bytes},mode=1777")
    L.mount("proc", "/proc", "proc", opts | L.MS_NOEXEC)


def _hide(paths: tuple[str, ...]) -> None:
    """Bind-mounts an empty file over each of `paths` of the new /proc (a program cannot
    unmount them, as it cannot unmount anything of its root). The file is the run's own
    (made in its /tmp, then unlinked: the mounts keep it), so a write to it reaches no one
    else."""
    empty = "/tmp/.empty"
    os.close(os.open(empty, os.O_CREAT | os.O_WRONLY, 0o444))
    for path in paths:
        if os.path.exists(path):
            L.mount(empty, path, None, L.MS_BIND)
    os.unlink(empty)


def _bind(kind: str, path: str, target: str, read_only: bool) -> bool:
    """Bind-mounts `path` at `target` (a folder `plan` listed, or a file made here); False
    when the sandbox uid cannot reach it."""
    if kind != "dir":
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    try:
        L.mount(path, target, None, L.MS_BIND | L.MS_REC)
    except PermissionError:
        if read_only:  # root: a real failure
            raise
        return False  # unreachable to this uid: left out (an empty folder)
    return True


def _read_only(bound: list[tuple[str, str]], read_only: bool) -> None:
    """The staged root read-only, with every bind mount in it: one `mount_setattr` over the
    tree. A device stays usable (reads and writes of /dev/null work; its times, the host's,
    can no longer be set). Where the kernel lacks `mount_setattr` (before 5.12), each bind
    mount is remounted instead: the devices always, the folders and files with `read_only`,
    and the root's own tmpfs."""
    try:
        _mount_setattr_read_only(STAGE)
        return
    except OSError:
        pass
    for kind, target in bound:
        if kind == "dev" or read_only:
            _remount_read_only(target)
    with contextlib.suppress(OSError):  # nothing more is made in the root itself
        L.mount("none", STAGE, None, L.MS_REMOUNT | L.MS_RDONLY | L.MS_NOSUID | L.MS_NODEV)


_KEPT_FLAGS = L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC | 1024 | 2048 | 4096
"""A mount's flags that a read-only remount keeps (nosuid, nodev, noexec, noatime,
nodiratime, relatime: in a user namespace the kernel refuses to clear the host's)."""


def _remount_read_only(target: str) -> None:
    flags = os.statvfs(target).f_flag & _KEPT_FLAGS  # (statvfs's ST_* bits are MS_*'s)
    L.mount("none", target, None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | flags)


_SYS_MOUNT_SETATTR = 442  # (one number on every architecture, since Linux 5.12)
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 1


def _mount_setattr_read_only(path: str) -> None:
    """The mount at `path` and every mount below it read-only, in one system call (it only
    adds a restriction, which a user namespace may: the host's locked flags stay)."""
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)  # set, clear, propagation, userns
    ret = L.libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE, ctypes.byref(attr), 32)
    L.check(ret, "mount_setattr")


def _pivot_root(new_root: str, put_old: str) -> None:
    if _SYS_PIVOT_ROOT is None:
        raise OSError(0, "pivot_root: syscall number unknown on this machine")
    L.check(L.libc.syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")
