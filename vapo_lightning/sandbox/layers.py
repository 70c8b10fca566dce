"""Linux isolation primitives over ctypes: namespaces, Landlock, capabilities, rlimits.

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
_libc = ctypes.CDLL(None, use_errno=True) if IS_LINUX else None

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

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

NOBODY = 65534


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
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


ALL_NAMESPACES = (
    CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET
)


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


def private_mounts(tmp_bytes: int) -> None:
    """In a fresh mount namespace: fresh tmpfs on /tmp and /dev/shm, fresh /proc (own PIDs)."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    opts = MS_NOSUID | MS_NODEV
    mount("tmpfs", "/tmp", "tmpfs", opts, f"size={tmp_bytes},mode=1777")
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", opts | MS_NOEXEC, "size=1m,mode=1777")
    mount("proc", "/proc", "proc", opts | MS_NOEXEC)


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


# Built once, before any fork: in a forked sandbox, building them touches ~30 pages of the
# ctypes machinery (copy-on-write faults).
_CAP_HEADER = _CapHeader(0x20080522, 0)
_CAP_DATA = (_CapData * 2)()


def drop_capabilities() -> None:
    """Empty effective, permitted and inheritable sets (v3 capset: two 32-bit words)."""
    _check(_libc.syscall(_SYS["capset"], ctypes.byref(_CAP_HEADER), _CAP_DATA), "capset")


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
    ret = _libc.syscall(_SYS["ll_create"], None, ctypes.c_size_t(0), ctypes.c_uint32(1))
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
    rs = _check(
        _libc.syscall(_SYS["ll_create"], ctypes.byref(attr), ctypes.c_size_t(size), 0),
        "landlock_create_ruleset",
    )
    try:
        for fd, allowed in rules:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                allowed &= LL_FILE_RIGHTS  # directory rights on a file: EINVAL
            rule = _PathBeneath(allowed & fs_all, fd)
            _check(_libc.syscall(_SYS["ll_add"], rs, 1, ctypes.byref(rule), 0), "landlock_add_rule")
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
    _check(_libc.syscall(_SYS["ll_restrict"], ruleset_fd, 0), "landlock_restrict_self")
    return landlock_parts(abi)


def landlock_restrict(rules: list[tuple[int, int]], abi: int) -> list[str]:
    """`landlock_ruleset` + `landlock_enforce` in one go. Returns the parts that took effect."""
    rs = landlock_ruleset(rules, abi)
    try:
        return landlock_enforce(rs, abi)
    finally:
        os.close(rs)


def set_limits(cpu_s: int, address_space: int, file_size: int, open_files: int, nproc: int) -> None:
    """Hard rlimits for the candidate (soft = hard so it cannot raise them back)."""
    for res, value in (
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, address_space),
        (resource.RLIMIT_FSIZE, file_size),
        (resource.RLIMIT_NOFILE, open_files),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ):
        resource.setrlimit(res, (value, value))


# --- seccomp: no socket that could reach, or leave a mark in, a network namespace ----------
class _SockFilter(ctypes.Structure):
    _fields_ = (
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    )


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter)))


# Audit arch and syscall numbers per machine (seccomp filters see raw numbers).
_SECCOMP_ABI = (
    {
        "x86_64": (0xC000003E, {"socket": 41, "connect": 42, "accept": 43, "sendto": 44,
                                "sendmsg": 46, "bind": 49, "listen": 50, "socketpair": 53,
                                "add_key": 248, "request_key": 249, "keyctl": 250,
                                "accept4": 288, "sendmmsg": 307, "io_uring_setup": 425}),
        "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "bind": 200, "listen": 201,
                                 "accept": 202, "connect": 203, "sendto": 206, "sendmsg": 211,
                                 "add_key": 217, "request_key": 218, "keyctl": 219,
                                 "accept4": 242, "sendmmsg": 269, "io_uring_setup": 425}),
    }.get(os.uname().machine)
    if IS_LINUX
    else None
)  # fmt: skip
_DENIED = ("socket", "connect", "accept", "accept4", "bind", "listen", "sendmsg", "sendmmsg",
           "io_uring_setup", "add_key", "request_key", "keyctl")  # fmt: skip
_LD_W_ABS, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW, _RET_EPERM, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050001, 0x80000000
_X32_BIT, _AF_UNIX = 0x40000000, 1
_SECCOMP_MODE_FILTER, PR_SET_SECCOMP = 2, 22


def _assemble(prog: list[tuple]) -> list[tuple[int, int, int, int]]:
    """(op, k, true-label, false-label) or a label string -> BPF (code, jt, jf, k)."""
    where, at = {}, 0
    for ins in prog:
        if isinstance(ins, str):
            where[ins] = at
        else:
            at += 1
    out = []
    for ins in prog:
        if isinstance(ins, str):
            continue
        op, k, jt, jf = (*ins, None, None)[:4]
        here = len(out) + 1
        out.append((op, where[jt] - here if jt else 0, where[jf] - here if jf else 0, k))
    return out


def no_sockets_filter() -> list[tuple[int, int, int, int]]:
    """The seccomp program: EPERM for every socket a candidate could use to send a packet, bind
    a name or pass a file descriptor — `socket()` of any family, `bind`, `connect`, `listen`,
    `accept*`, `sendmsg`/`sendmmsg`, `sendto` with an address, `io_uring_setup` (io_uring does
    socket operations without these syscalls) — but `socketpair(AF_UNIX)` and plain
    send/recv on it (asyncio's self-pipe, multiprocessing's duplex pipes). A datagram
    socketpair can still autobind an abstract name (SO_PASSCRED); it lives as long as the
    socket, so at most until the run's PID namespace ends, before the next run starts. Also
    refused: the kernel keyrings (`add_key`, `request_key`, `keyctl`), whose `request_key`
    upcalls run helpers such as the DNS resolver in the host's namespaces. Any other syscall ABI
    (32-bit compat, x32) kills the process: its numbers would get past the checks."""
    arch, nr = _SECCOMP_ABI
    prog: list = [
        (_LD_W_ABS, 4),  # seccomp_data.arch
        (_JEQ, arch, "native", "kill"),
        "native",
        (_LD_W_ABS, 0),  # seccomp_data.nr
        (_JSET, _X32_BIT, "kill", "denied"),
        "denied",
    ]
    prog += [(_JEQ, nr[name], "deny", None) for name in _DENIED]
    prog += [
        (_JEQ, nr["socketpair"], "socketpair", None),
        (_JEQ, nr["sendto"], "sendto", None),
        (_RET, _RET_ALLOW),
        "socketpair",
        (_LD_W_ABS, 16),  # args[0] (low word): the family
        (_JEQ, _AF_UNIX, "allow", "deny"),
        "sendto",
        (_LD_W_ABS, 48),  # args[4], the destination address: NULL only
        (_JEQ, 0, "sendto_hi", "deny"),
        "sendto_hi",
        (_LD_W_ABS, 52),
        (_JEQ, 0, "allow", "deny"),
        "allow",
        (_RET, _RET_ALLOW),
        "deny",
        (_RET, _RET_EPERM),
        "kill",
        (_RET, _RET_KILL_PROCESS),
    ]
    return _assemble(prog)


def seccomp_filter_array(program: list[tuple[int, int, int, int]]) -> _SockFprog:
    """The program as the kernel reads it (built before any fork: see `_CAP_HEADER`)."""
    insns = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    fprog = _SockFprog(len(program), insns)
    fprog._keep = insns  # the array must outlive the struct that points at it
    return fprog


NO_SOCKETS = seccomp_filter_array(no_sockets_filter()) if _SECCOMP_ABI else None


def seccomp_works() -> bool:
    """Whether `seccomp_no_sockets` can be installed here (tried in a throw-away child)."""
    if NO_SOCKETS is None:
        return False
    pid = os.fork()
    if pid == 0:
        try:
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            seccomp_no_sockets()
        except BaseException:
            os._exit(1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def seccomp_no_sockets() -> list[str]:
    """Installs `no_sockets_filter` on this process and its future children (needs
    no_new_privs or CAP_SYS_ADMIN). Returns the layer's name."""
    if NO_SOCKETS is None:
        raise OSError(0, "seccomp: syscall numbers unknown on this machine")
    _check(
        _libc.prctl(
            PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(NO_SOCKETS), 0, 0
        ),
        "seccomp",
    )
    return ["no_sockets"]
