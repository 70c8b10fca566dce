"""Linux isolation primitives over ctypes: namespaces, Landlock, capabilities, rlimits
(the seccomp filter: `seccomp_filter`).

Everything here is stdlib-only and import-light, because it also runs inside the warm fork
server (started with ``python -I -S``) and in the sandboxed child after it dropped to an
unprivileged uid. Each primitive raises `OSError` when the kernel refuses; callers treat every
layer as optional and report which ones took effect.
"""

from __future__ import annotations

import ctypes
import os
import resource
import stat
import sys

IS_LINUX = sys.platform.startswith("linux")
libc = ctypes.CDLL(None, use_errno=True) if IS_LINUX else None
"""The C library, for every primitive here and in `seccomp_filter`."""

# x86_64 and aarch64 share the new-style numbers for Landlock; capset differs.
_SYS = (
    {
        "x86_64": {"capset": 126, "ll_create": 444, "ll_add": 445, "ll_restrict": 446},
        "aarch64": {"capset": 91, "ll_create": 444, "ll_add": 445, "ll_restrict": 446},
    }.get(os.uname().machine, {})
    if IS_LINUX
    else {}
)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 0x4000, 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

NOBODY = 65534
SANDBOX_UID_BASE = 2_000_000_000
"""A root server's sandboxes run as uid (and gid) SANDBOX_UID_BASE + the server's pid: one
uid per server, so concurrent runs (each server runs one at a time) share no per-user kernel
limit or accounting (pipe buffers, inotify, epoll watches, signals queued). Pids are below
2^22, so the range ends below 2^31, above the uids that systems allocate."""


def sandbox_uid(server_pid: int) -> int:
    return SANDBOX_UID_BASE + server_pid


def check(ret: int, what: str) -> int:
    """`ret` of a libc call; OSError with errno when it failed."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def prctl(option: int, arg: int = 0) -> None:
    check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def unshare(flags: int) -> None:
    check(libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    check(libc.setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() or None,
        ),
        f"mount {target}",
    )


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


ALL_NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET


def enter_namespaces(uid: int, gid: int, flags: int = ALL_NAMESPACES) -> int:
    """unshare a user namespace (+ the other namespaces in `flags`); maps uid to itself.

    The caller keeps its uid outside; inside it has every capability of the new namespace
    until `drop_capabilities`. A new PID namespace applies to the caller's next child.
    `flags` must include CLONE_NEWUSER. Returns the flags unshared.
    """
    unshare(flags)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
    _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    return flags


_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine) if IS_LINUX else None
_CLONE_PARENT, _SIGCHLD = 0x00008000, 17
_pylibc = ctypes.PyDLL(None, use_errno=True) if IS_LINUX else None  # keeps the GIL, as fork


def fork_sibling() -> int:
    """`os.fork()`, except that the child's parent is our parent (clone with CLONE_PARENT):
    it is reaped by, signals its exit to and may be waited for by our parent. The
    interpreter's fork hooks run as in `os.fork` (the caller must be single-threaded)."""
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    # clone(flags, stack=0 (the same, copied), ...): fork with one more flag
    pid = _pylibc.syscall(_SYS_CLONE, ctypes.c_ulong(_CLONE_PARENT | _SIGCHLD), 0, 0, 0, 0)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


# Built once, before any fork: in a forked sandbox, building them touches pages of the
# ctypes machinery (copy-on-write faults).
_CAP_HEADER = _CapHeader(0x20080522, 0)
_CAP_DATA = (_CapData * 2)()


def drop_capabilities() -> None:
    """Empty effective, permitted and inheritable sets (v3 capset: two 32-bit words)."""
    check(libc.syscall(_SYS["capset"], ctypes.byref(_CAP_HEADER), _CAP_DATA), "capset")


def drop_privileges(uid: int = NOBODY, gid: int = NOBODY) -> None:
    """Real root -> `uid`/`gid` for good (saved ids too; supplementary groups cleared)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    prctl(PR_SET_DUMPABLE, 1)  # reset by the uid change; needed to write our own uid_map


# --- Landlock -----------------------------------------------------------------------------
LL_FS_EXECUTE, LL_FS_WRITE_FILE, LL_FS_READ_FILE, LL_FS_READ_DIR = 1, 2, 4, 8
LL_FS_TRUNCATE, LL_FS_IOCTL_DEV = 1 << 14, 1 << 15
_LL_FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
LL_NET_ALL = 0b11  # BIND_TCP | CONNECT_TCP (ABI >= 4)
LL_SCOPE_ALL = 0b11  # ABSTRACT_UNIX_SOCKET | SIGNAL (ABI >= 6)
LL_READ = LL_FS_EXECUTE | LL_FS_READ_FILE | LL_FS_READ_DIR
LL_FILE_RIGHTS = LL_FS_EXECUTE | LL_FS_WRITE_FILE | LL_FS_READ_FILE | LL_FS_TRUNCATE


class _RulesetAttr(ctypes.Structure):
    _fields_ = (("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64))


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def landlock_abi() -> int:
    if not IS_LINUX or "ll_create" not in _SYS:
        return 0
    ret = libc.syscall(_SYS["ll_create"], None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(ret, 0)


def landlock_fs_all(abi: int) -> int:
    return _LL_FS_ALL_BY_ABI.get(abi, (1 << 16) - 1)


def landlock_ruleset(rules: list[tuple[int, int]], abi: int) -> int:
    """A Landlock ruleset fd: `rules` are (O_PATH fd, allowed access bits).

    Everything else on the file system is denied; TCP bind/connect are denied (ABI >= 4);
    signals to and abstract Unix sockets of processes outside the domain are denied (ABI >= 6).
    Built ahead of time; `landlock_enforce` applies it to the calling process.
    """
    fs_all = landlock_fs_all(abi)
    attr = _RulesetAttr(fs_all, LL_NET_ALL if abi >= 4 else 0, LL_SCOPE_ALL if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else (16 if abi >= 4 else 8)
    rs = check(
        libc.syscall(_SYS["ll_create"], ctypes.byref(attr), ctypes.c_size_t(size), 0),
        "landlock_create_ruleset",
    )
    try:
        for fd, allowed in rules:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                allowed &= LL_FILE_RIGHTS  # directory rights on a file: EINVAL
            rule = _PathBeneath(allowed & fs_all, fd)
            check(libc.syscall(_SYS["ll_add"], rs, 1, ctypes.byref(rule), 0), "landlock_add_rule")
    except BaseException:
        os.close(rs)
        raise
    return rs


def landlock_parts(abi: int) -> list[str]:
    """The layer names a ruleset of this ABI provides."""
    done = ["landlock_fs"]
    done += ["landlock_tcp"] if abi >= 4 else []
    done += ["landlock_scope"] if abi >= 6 else []
    return done


def landlock_enforce(ruleset_fd: int, abi: int) -> list[str]:
    """Confines this process (and its future children) with the ruleset; closes nothing."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    check(libc.syscall(_SYS["ll_restrict"], ruleset_fd, 0), "landlock_restrict_self")
    return landlock_parts(abi)


MALLOC_ARENAS = 2
"""glibc's malloc arenas per process in a sandbox (its default, 8 per core, reserves 64 MiB
of address space for each thread that makes one, so a threaded program would fill its
address-space limit with arenas before its memory)."""
_M_ARENA_MAX = -8


def limit_malloc_arenas() -> None:
    """`MALLOC_ARENAS` for this process and the children it forks (`mallopt`; the environment
    variable is read only when a process starts)."""
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


def thread_stack_bytes() -> int:
    """The stack a new thread reserves: glibc's default, RLIMIT_STACK's soft limit (8 MiB
    counted where that is unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return soft if 0 < soft != resource.RLIM_INFINITY else 8 << 20


def set_limits(cpu_s: int, address_space: int, file_size: int, open_files: int, nproc: int) -> None:
    """Hard rlimits for the candidate (soft = hard so it cannot raise them back).

    RLIMIT_CORE is 1, not 0: the kernel skips a piped core_pattern (apport, systemd-coredump)
    only at 1, and it holds for children that exec (which are dumpable again)."""
    for res, value in (
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, address_space),
        (resource.RLIMIT_FSIZE, file_size),
        (resource.RLIMIT_NOFILE, open_files),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_CORE, 1),  # 1 byte: no core file, and no piped core_pattern helper
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ):
        resource.setrlimit(res, (value, value))
