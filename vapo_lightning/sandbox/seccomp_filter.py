"""The seccomp filter of every sandbox: no socket that could reach, or leave a mark in, a
network namespace; no reaching into another process; no way back to being dumpable.

`sandbox_filter` writes the BPF program (what it refuses, and why), assembled here in Python;
`FILTERS` holds it as the kernel reads it, built at import (before any fork); `seccomp_sandbox`
installs it. Stdlib-only, as `layers`.
"""

from __future__ import annotations

import ctypes
import os

if __package__:
    from . import layers as L
else:  # imported by server.py run as a script
    import layers as L


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
        "x86_64": (
            0xC000003E,
            {
                "socket": 41,
                "socketpair": 53,
                "ptrace": 101,
                "prctl": 157,
                "add_key": 248,
                "request_key": 249,
                "keyctl": 250,
                "inotify_init": 253,
                "inotify_init1": 294,
                "fanotify_init": 300,
                "process_vm_readv": 310,
                "process_vm_writev": 311,
                "io_uring_setup": 425,
                "pidfd_getfd": 438,
                "fcntl": 72,
                "flock": 73,
            },
        ),
        "aarch64": (
            0xC00000B7,
            {
                "socket": 198,
                "socketpair": 199,
                "ptrace": 117,
                "prctl": 167,
                "add_key": 217,
                "request_key": 218,
                "keyctl": 219,
                "inotify_init1": 26,
                "fanotify_init": 262,
                "process_vm_readv": 270,
                "process_vm_writev": 271,
                "io_uring_setup": 425,
                "pidfd_getfd": 438,
                "fcntl": 25,
                "flock": 32,
            },
        ),
    }.get(os.uname().machine)
    if L.IS_LINUX
    else None
)
_DENIED_ALWAYS = {
    "no_ptrace": ("ptrace", "pidfd_getfd", "process_vm_readv", "process_vm_writev"),
    "no_fs_watch": ("inotify_init", "inotify_init1", "fanotify_init", "flock"),
}
_DENIED_NO_SOCKETS = ("io_uring_setup", "add_key", "request_key", "keyctl")
_LD_W_ABS, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW, _RET_EPERM, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050001, 0x80000000
_X32_BIT, _AF_UNIX = 0x40000000, 1
_SECCOMP_MODE_FILTER, PR_SET_SECCOMP = 2, 22
_SIGKILL = 9
F_NOTIFY = 1026  # fcntl's dnotify command (F_LINUX_SPECIFIC_BASE + 2)


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
    - `dies_with_server`: prctl(PR_SET_PDEATHSIG) to any signal but SIGKILL, so that the
      program cannot clear the parent-death signal its sandbox set (it would outlive a
      killed server, re-parented to init); setting SIGKILL again is harmless.
    - `no_fs_watch`: inotify, fanotify and dnotify (`fcntl(F_NOTIFY)`), which would show a
      run the file opens of the concurrent runs on the directories they all read (/usr, the
      stdlib), and whose instances count against a per-user limit; and `flock`, whose locks
      on those shared files two colluding runs could see (a bit at a time). POSIX record
      locks (`fcntl(F_SETLK)`, `F_OFD_SETLK`) stay: sqlite3 needs them on its files in /tmp,
      and seccomp cannot tell a shared file from the run's own (docs/sandbox.md).
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
    prog += [(_JEQ, nr["prctl"], "prctl", None), (_JEQ, nr["fcntl"], "fcntl", None)]
    if no_sockets:
        prog += [
            (_JEQ, nr["socketpair"], "unix_only", None),
            (_JEQ, nr["socket"], "unix_only", None),
        ]
    prog += [(_RET, _RET_ALLOW), *_argument_checks(no_sockets)]
    prog += ["allow", (_RET, _RET_ALLOW), "deny", (_RET, _RET_EPERM)]
    return _assemble([*prog, "kill", (_RET, _RET_KILL_PROCESS)])


def _argument_checks(no_sockets: bool) -> list:
    """The checks of `sandbox_filter` on a syscall's arguments (seccomp_data.args[i]'s low
    word is at 16 + 8 i): prctl's option (and PR_SET_PDEATHSIG's signal), fcntl's command,
    the address family of socket() and socketpair()."""
    prog: list = ["prctl", (_LD_W_ABS, 16)]  # args[0]: the option
    prog += [(_JEQ, L.PR_SET_DUMPABLE, "deny", None), (_JEQ, L.PR_SET_PDEATHSIG, None, "allow")]
    prog += [(_LD_W_ABS, 24), (_JEQ, _SIGKILL, "allow", "deny")]  # args[1]: the signal
    prog += ["fcntl", (_LD_W_ABS, 24), (_JEQ, F_NOTIFY, "deny", "allow")]  # args[1]: the cmd
    if no_sockets:
        prog += ["unix_only", (_LD_W_ABS, 16), (_JEQ, _AF_UNIX, "allow", "deny")]  # family
    return prog


def seccomp_filter_array(program: list[tuple[int, int, int, int]]) -> _SockFprog:
    """The program as the kernel reads it (built at import, before any fork: in a forked
    sandbox, building it would touch pages of the ctypes machinery)."""
    insns = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    fprog = _SockFprog(len(program), insns)
    fprog._keep = insns  # the array must outlive the struct that points at it
    return fprog


FILTERS = {flag: seccomp_filter_array(sandbox_filter(flag)) for flag in (False, True)} if _SECCOMP_ABI else {}


def seccomp_works() -> bool:
    """Whether `seccomp_sandbox` can be installed here (tried in a throw-away child)."""
    if not FILTERS:
        return False
    pid = os.fork()
    if pid == 0:
        try:
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
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
    L.check(
        L.libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0),
        "seccomp",
    )
    layers = [*_DENIED_ALWAYS, "not_dumpable", "dies_with_server"]
    return layers + (["no_sockets"] if no_sockets else [])
