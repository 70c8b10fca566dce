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


def unsearchable_ancestor(path: str) -> str | None:
    """The highest directory on the way to `path` that others may not search (e.g. a mode-700
    /root holding the interpreter), or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        parent = "/" + "/".join(parts[:i])
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent
    return None


def expose_below(hidden: str, path: str) -> None:
    """As root in a fresh mount namespace: an empty tmpfs over `hidden` (its contents no longer
    visible), and `path` (below it) bind-mounted back read-only at its own place, so that every
    path into it stays as it was (an interpreter's RUNPATH, sys.path) while nothing else of
    `hidden` is there. (The bind's source must be a mount of this namespace: opened here.)"""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
        os.makedirs(path, 0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
    finally:
        os.close(fd)
    mount("none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


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


# --- seccomp: no socket that could reach, or leave a mark in, a network namespace -----------
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
        "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "ptrace": 101, "prctl": 157,
                                "add_key": 248, "request_key": 249, "keyctl": 250,
                                "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300,
                                "process_vm_readv": 310, "process_vm_writev": 311,
                                "io_uring_setup": 425, "pidfd_getfd": 438}),
        "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "ptrace": 117, "prctl": 167,
                                 "add_key": 217, "request_key": 218, "keyctl": 219,
                                 "inotify_init1": 26, "fanotify_init": 262,
                                 "process_vm_readv": 270, "process_vm_writev": 271,
                                 "io_uring_setup": 425, "pidfd_getfd": 438}),
    }.get(os.uname().machine)
    if IS_LINUX
    else None
)  # fmt: skip
_DENIED_ALWAYS = {
    "no_ptrace": ("ptrace", "pidfd_getfd", "process_vm_readv", "process_vm_writev"),
    "no_fs_watch": ("inotify_init", "inotify_init1", "fanotify_init"),
}
_DENIED_NO_SOCKETS = ("io_uring_setup", "add_key", "request_key", "keyctl")
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


def sandbox_filter(no_sockets: bool) -> list[tuple[int, int, int, int]]:
    """The seccomp program of every sandbox, and what it refuses (EPERM) and why:

    - `no_ptrace`: ptrace, pidfd_getfd and process_vm_readv/writev, so that the program
      cannot reach into another process of its run, such as the runner that holds the
      result pipe in stdin mode (the runner is also not dumpable, which the kernel checks
      for these calls; the filter also covers children that exec and so become dumpable).
    - `not_dumpable`: prctl(PR_SET_DUMPABLE), so that the program cannot make itself
      dumpable again: a crash then never starts a piped core_pattern helper in the host's
      namespaces (RLIMIT_CORE = 1 stops that for exec'd children as well).
    - `no_fs_watch`: inotify and fanotify, which would show a run the file opens of the
      concurrent runs on the directories they all read (/usr, the stdlib), and whose
      instances count against a per-user limit.
    - `no_sockets` (when asked): every socket but AF_UNIX ones, from `socket()` or
      `socketpair()`, and `io_uring_setup` (io_uring does socket operations without these
      syscalls), so that nothing can send a packet or move a counter of the network
      namespace. Unix sockets stay (asyncio's self-pipe, multiprocessing's pipes, its
      forkserver and managers): a path name lives in the run's private /tmp, an abstract
      name in the network namespace only as long as the socket, i.e. at most until the
      run's PID namespace ends, before the next run of that namespace starts (a server's
      runs take turns). Also refused then: the kernel keyrings (`add_key`, `request_key`,
      `keyctl`), whose `request_key` upcalls run helpers such as the DNS resolver in the
      host's namespaces.

    Any other syscall ABI (32-bit compat, x32) kills the process: its numbers would get past
    the checks."""
    arch, nr = _SECCOMP_ABI
    denied = [name for names in _DENIED_ALWAYS.values() for name in names if name in nr]
    denied += list(_DENIED_NO_SOCKETS) if no_sockets else []
    prog: list = [
        (_LD_W_ABS, 4),  # seccomp_data.arch
        (_JEQ, arch, "native", "kill"),
        "native",
        (_LD_W_ABS, 0),  # seccomp_data.nr
        (_JSET, _X32_BIT, "kill", "denied"),
        "denied",
    ]
    prog += [(_JEQ, nr[name], "deny", None) for name in denied]
    prog += [(_JEQ, nr["prctl"], "prctl", None)]
    if no_sockets:
        prog += [
            (_JEQ, nr["socketpair"], "unix_only", None),
            (_JEQ, nr["socket"], "unix_only", None),
        ]
    prog += [(_RET, _RET_ALLOW), "prctl", (_LD_W_ABS, 16)]  # args[0] (low word): the option
    prog += [(_JEQ, PR_SET_DUMPABLE, "deny", "allow")]
    if no_sockets:
        prog += ["unix_only", (_LD_W_ABS, 16), (_JEQ, _AF_UNIX, "allow", "deny")]  # family
    prog += [
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


FILTERS = (
    {flag: seccomp_filter_array(sandbox_filter(flag)) for flag in (False, True)}
    if _SECCOMP_ABI
    else {}
)


def seccomp_works() -> bool:
    """Whether `seccomp_sandbox` can be installed here (tried in a throw-away child)."""
    if not FILTERS:
        return False
    pid = os.fork()
    if pid == 0:
        try:
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            seccomp_sandbox(no_sockets=True)
        except BaseException:
            os._exit(1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def seccomp_sandbox(no_sockets: bool) -> list[str]:
    """Installs `sandbox_filter` on this process and its future children (needs no_new_privs
    or CAP_SYS_ADMIN). Returns the names of the layers it provides."""
    if not FILTERS:
        raise OSError(0, "seccomp: syscall numbers unknown on this machine")
    prog = FILTERS[no_sockets]
    _check(
        _libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0),
        "seccomp",
    )
    return [*_DENIED_ALWAYS, "not_dumpable", *(["no_sockets"] if no_sockets else [])]
