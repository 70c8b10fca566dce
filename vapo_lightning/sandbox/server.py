"""The warm fork server: a clean, single-threaded process that forks one sandbox per request.

Started by the host as ``python -I -S -B server.py`` with an empty environment (so that the
candidate's inherited memory and /proc/self/environ hold no secrets), before the trainer starts
CUDA or threads; fork() from here is cheap and safe. Process tree of one request, as an
unprivileged user (or as root with ``via_userns``):

    server (real uid, child subreaper)          deadline, byte caps, SIGKILL, reaping
     ├─ zygote   forks each sandbox (CLONE_PARENT: the server's child), never holds a request
     └─ C   uid of its own, new user/net/mnt/pid/ipc/uts namespaces; reports P2's pid, waits
         └─ P2  pid 1 of the new PID namespace: private /tmp, /dev/shm, /proc; rlimits,
             │  no capabilities, Landlock, scrubbed env, then `runner`
             └─ P3 ...  stdin mode: one child per test

As root (the default there) there is no C: the server forks P2 straight into a new PID
namespace; P2 makes its mount/IPC/UTS namespaces and mounts as root, then drops to the server's own sandbox uid
and enters a user namespace of its own before anything else. Its network namespace is the
server's own (nothing up), made once, when the seccomp filter (`layers.sandbox_filter`)
keeps every run from writing to it; otherwise P2 makes one of its own too. A holder process
(`_start_mount_ns_holder`) takes each run's mount namespace off the run's exit path.

Each sandbox (P2, or C on the unprivileged path) first joins a memory and a pids cgroup of
its run's own (`cgroups`), made with its spare and removed after the run, so that everything
the run starts or fills counts against one limit. A run's reply goes out before the next
spares are forked: their cgroups are made before it (the finished run's removed), the zygote
is asked for them after it and forks them while the host judges the run; its answers (their
pids) are read when the next run needs a spare or has ended.

When P2 exits, the kernel kills everything left in its PID namespace (double-fork daemons
included); without a PID namespace the server, as subreaper, kills its leftover descendants.
(As pid 1 the candidate ignores signals it sends itself; that only ever hurts it.)
Protocol on stdin/stdout: 4-byte big-endian length + JSON request; reply is length + JSON
header, then ``header["raw_len"]`` raw bytes of the result pipe (the host decodes them).
The request ``{"op": "spares"}`` is answered with ``{"spare_sids": [...]}``: the session ids of
the idle spares, once the spares a run leaves to fork after its reply are forked.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time

if __package__:
    from . import cgroups as CG
    from . import layers as L
    from . import runner
else:  # run as a script (`-I` leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cgroups as CG
    import layers as L
    import runner

    del sys.path[0]

# Imported once here so that the candidate's imports of them are free. Not `random`, `queue`
# (-> threading), `statistics` or `tempfile` (-> random): they register after-fork hooks that
# run in every forked sandbox and cost ~180 page faults (~0.4 ms of CPU) per fork on this kind
# of VM (benchmarks/results/sandbox.md); the candidate that needs them imports them itself.
PRELOAD = [
    "abc",
    "array",
    "bisect",
    "calendar",
    "cmath",
    "collections",
    "collections.abc",
    "contextlib",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "io",
    "itertools",
    "math",
    "numbers",
    "operator",
    "re",
    "string",
    "struct",
    "textwrap",
    "typing",
    "unicodedata",
]

SANDBOX_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp/work",
    "TMPDIR": "/tmp/work",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "PYTHONIOENCODING": "utf-8",
}
"""The whole environment of a sandbox. The server adopts it at start (its own is already
scrubbed by the host), so that a sandbox inherits it instead of rewriting `os.environ`
after the fork (~140 page faults, ~0.5 ms there)."""

READ_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class Spare:
    """A sandbox forked ahead of its request: every layer set up, P2 blocked reading `req_w`."""

    def __init__(self, c_pid, ctl_r, res_r, req_w, host_dir, tmp_mb, cgroups, cg_limits) -> None:
        self.c_pid, self.ctl_r, self.res_r, self.req_w = c_pid, ctl_r, res_r, req_w
        self.host_dir, self.tmp_mb = host_dir, tmp_mb
        self.cgroups, self.cg_limits = cgroups, cg_limits  # its run's cgroups, their limits
        self.ctl = b""
        self.p2_pid: int | None = None
        self.p2_fd: int | None = None
        self.c_reaped = False


class Server:
    def __init__(self, opts: dict) -> None:
        self.opts = opts
        self.host_tmp = os.environ.get("TMPDIR") or "/tmp"
        os.environ.clear()
        os.environ.update(SANDBOX_ENV)
        self.is_root = os.geteuid() == 0
        # The sandboxes' uid: one per server (`L.SANDBOX_UID_BASE`); without root, ours.
        self.uid = L.sandbox_uid(os.getpid()) if self.is_root else os.getuid()
        self.abi = L.landlock_abi() if opts.get("landlock", True) else 0
        self.namespaces = opts.get("namespaces", True)
        # As root, each sandbox is forked straight into a new PID namespace (`unshare
        # (CLONE_NEWPID)` here, undone by `setns` after the fork), makes its own mount, IPC,
        # UTS and network namespaces as root, drops to the sandbox uid and then enters a user
        # namespace of its own (per-user kernel state: keyrings, RLIMIT_NPROC's count). One
        # process fewer per run than the unprivileged path through C (~0.8 ms of CPU). Not a
        # network namespace shared by a server's runs, unless the seccomp filter keeps every
        # run from writing to it (below).
        self.direct = False
        if self.is_root and self.namespaces and not opts.get("via_userns", False):
            self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            try:
                L.unshare(L.CLONE_NEWPID)
            except OSError:  # no CAP_SYS_ADMIN (a container): the user-namespace path
                os.close(self.own_pid_ns)
            else:
                L.setns(self.own_pid_ns, L.CLONE_NEWPID)
                self.direct = True
        self.holder_pid, self.holder_w = _start_mount_ns_holder() if self.direct else (None, None)
        # No socket but Unix ones, which cannot send a packet (`layers.sandbox_filter`): then a
        # network namespace can serve all of this server's runs, taking turns, since none can
        # leave a mark in it (its counters cannot move), and it is made once
        # here instead of once per run (~0.6 ms of CPU with its teardown, the largest cost of a
        # run that isolation adds: benchmarks/results/sandbox_cpu.md).
        self.filter_works = L.seccomp_works()
        self.seccomp = bool(opts.get("seccomp", True)) and self.filter_works
        self.shared_netns = False
        if self.direct and self.seccomp:
            with contextlib.suppress(OSError):
                L.unshare(L.CLONE_NEWNET)
                self.shared_netns = True
        self.read_fds = [
            os.open(p, os.O_PATH | os.O_CLOEXEC) for p in READ_PATHS if os.path.exists(p)
        ]
        self.dev_fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in DEVICES if os.path.exists(p)]
        # The interpreter, reachable inside so that a program may start it (multiprocessing's
        # spawn and forkserver, subprocess): read and execute for Landlock; when it lives below
        # a directory the sandbox uid may not search (/root), `L.expose_below` mounts it back
        # (a root server's direct path only: the others cannot reach it to mount it).
        self.python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        self.prefix = os.path.realpath(sys.base_prefix)
        self.prefix_fd = os.open(self.prefix, os.O_PATH | os.O_CLOEXEC)
        self.hidden = L.unsearchable_ancestor(self.prefix) if self.is_root else None
        # The stdlib, opened now: after the uid drop its path may no longer be searchable.
        self.stdlib = {
            p: os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            for p in sys.path
            if os.path.isdir(p)
        }
        try:
            L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
            self.subreaper = True
        except OSError:
            self.subreaper = False
        self.probe_layers: list[str] = ["mountns"]  # optimistic until the probe ran
        # A memory and a pids cgroup per run (`cgroups`), made with each spare; their limits
        # those of the last request until a request asks for others.
        self.cgroups = CG.RunCgroups(opts.get("cgroup_root", CG.DEFAULT_ROOT))
        self.cg_limits = _cgroup_limits(DEFAULT_LIMITS)
        # Sandboxes forked ahead, oldest first: with two, one is always ready even when
        # requests come back to back (setting one up takes longer than a short run).
        self.depth = max(1, int(opts.get("spares", 2)))
        self.spares: list[Spare] = []
        self.refill_tmp_mb = int(DEFAULT_LIMITS["tmp_mb"])  # the spares' tmpfs: the last run's
        # Cgroups made for the spares a run leaves to fork after its reply, with their limits
        self.cg_ready: list[tuple[list[str], tuple[int, int]]] = []
        self.asked: list[tuple] = []  # spares the zygote was asked for, its answer not read
        self.zygote_pid, self.zygote = self._start_zygote()

    # --- the zygote: the only process that forks sandboxes ---------------------------------
    def _start_zygote(self) -> tuple[int, socket.socket]:
        """Forks the process that forks every sandbox, now, before any request exists.

        A sandbox forked here, after requests were handled, would inherit them: objects that
        frames still reference and freed memory never overwritten, where a program could read
        another run's code and inputs. The zygote is a copy of this process as it is now and
        only ever receives the pipes of a sandbox to fork; it forks with CLONE_PARENT, so each
        sandbox is still this server's child (waited for, reaped and signalled as before)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        pid = os.fork()
        if pid:
            theirs.close()
            return pid, ours
        try:
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            _new_session()  # stdio on /dev/null: the host's pipes stay the server's alone
            ours.close()
            if self.holder_w is not None:
                os.close(self.holder_w)
            while True:
                msg, fds, _, _ = socket.recv_fds(theirs, 4096, 3, socket.MSG_CMSG_CLOEXEC)
                if len(msg) < 4 or len(fds) != 3:  # the server is gone or shutting down
                    os._exit(0)
                (tmp_mb,) = struct.unpack("=i", msg[:4])
                host_dir, *cgroups = msg[4:].decode().split("\0")
                try:
                    pid = self._fork_sandbox(fds, host_dir or None, tmp_mb, cgroups)
                except OSError as err:
                    pid = -max(1, err.errno or 1)
                for fd in fds:
                    os.close(fd)
                theirs.send(struct.pack("=i", pid))
        finally:
            os._exit(0)

    def _fork_sandbox(self, fds: list[int], host_dir: str | None, tmp_mb: int, cgroups) -> int:
        """In the zygote: forks one sandbox (C, or P2 straight into a new PID namespace)."""
        ctl_w, res_w, req_r = fds
        gc.freeze()  # the sandbox's collections skip (and so do not copy) the zygote's objects
        if self.direct:
            L.unshare(L.CLONE_NEWPID)  # our next child is pid 1 of a new PID namespace
        try:
            pid = L.fork_sibling()
        except OSError:
            if self.direct:  # else every later unshare fails
                L.setns(self.own_pid_ns, L.CLONE_NEWPID)
            raise
        if pid == 0:
            active = self._join_cgroups(cgroups, ctl_w)
            sandbox = self._direct if self.direct else self._child
            sandbox(ctl_w, res_w, req_r, host_dir, tmp_mb, active)
        if self.direct:  # and the one after it is not
            L.setns(self.own_pid_ns, L.CLONE_NEWPID)
        return pid

    # --- inside the sandbox ------------------------------------------------------------------
    def _join_cgroups(self, cgroups: list[str], ctl_w: int) -> list[str]:
        """First thing in a new sandbox (P2 or C), while it still may: into its run's cgroups,
        so that every process it starts and every page it charges is counted there."""
        try:
            CG.join(cgroups)
        except OSError as err:
            os.write(ctl_w, f"X cgroup: {err}\n".encode()[:500])
            return []
        return self.cgroups.layers(cgroups)

    def _direct(self, ctl_w, res_w, req_r, host_dir: str | None, tmp_mb: int, active: list[str]):
        """P2 forked by a root server into a new PID namespace: never returns."""
        try:
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            _new_session()
            active += ["session", "pidns"]
            with contextlib.suppress(OSError):
                L.unshare(L.CLONE_NEWNS | L.CLONE_NEWIPC | L.CLONE_NEWUTS)
                active.append("mountns")
            if self.shared_netns:  # the server's own, nothing up; `_p2` adds the seccomp filter
                active.append("netns")
            else:
                with contextlib.suppress(OSError):
                    L.unshare(L.CLONE_NEWNET)
                    active.append("netns")
        except BaseException as err:
            os.write(ctl_w, f"X P2 {type(err).__name__}: {err}\n".encode()[:500])
            os._exit(72)
        self._p2(ctl_w, res_w, req_r, host_dir, tmp_mb, active)

    def _child(self, ctl_w, res_w, req_r, host_dir: str | None, tmp_mb: int, active: list[str]):
        """Process C: never returns. Exits right after forking P2 when we are a subreaper
        (P2 is then re-parented to the server), else waits for it."""
        try:
            _new_session()
            active.append("session")
            uid = gid = self.uid
            if self.is_root:
                L.drop_privileges(uid, gid)
                active += ["uid_drop", "own_uid"]
            else:
                gid = os.getgid()
            if self.namespaces:
                try:
                    L.enter_namespaces(uid, gid)
                    active += ["userns", "netns", "pidns", "mountns"]
                except OSError:
                    pass
            p2 = os.fork()
            if p2 == 0:
                self._p2(ctl_w, res_w, req_r, host_dir, tmp_mb, active)
            os.write(ctl_w, f"P {p2}\n".encode())
            if self.subreaper:
                os._exit(0)
            os.close(res_w)
            _, status = os.waitpid(p2, 0)
            os._exit(0 if status == 0 else 1)
        except BaseException as err:
            os.write(ctl_w, f"X C {type(err).__name__}: {err}\n".encode()[:500])
            os._exit(70)

    def _p2(self, ctl_w, res_w, req_r, host_dir, tmp_mb, active) -> None:
        """Process P2, pid 1 of the new PID namespace when there is one: never returns.

        Sets up everything that does not depend on the request, then blocks reading it."""
        try:
            if not self.subreaper:
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            workdir = host_dir
            if "mountns" in active:
                L.private_mounts(int(tmp_mb) << 20)
                active.append("private_tmp")
                if self.hidden is not None and os.geteuid() == 0:  # (root: the direct path)
                    L.expose_below(self.hidden, self.prefix)
            if os.geteuid() == 0:  # a root server's direct child: mounts done, root no more
                L.drop_privileges(self.uid, self.uid)
                active += ["uid_drop", "own_uid"]
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)  # (cleared by the uid change)
                with contextlib.suppress(OSError):  # unprivileged now; may be refused
                    L.enter_namespaces(self.uid, self.uid, flags=L.CLONE_NEWUSER)
                    active.append("userns")
            if "mountns" in active:
                os.mkdir("/tmp/work", 0o700)
                workdir = "/tmp/work"
            os.chdir(workdir)
            if workdir != SANDBOX_ENV["HOME"]:  # the server's environment is SANDBOX_ENV
                os.environ["HOME"] = os.environ["TMPDIR"] = workdir
            active.append("clean_env")
            caps_dropped = False
            with contextlib.suppress(OSError, KeyError):  # (KeyError: no capset number here)
                L.drop_capabilities()
                caps_dropped = True
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)  # no privilege from setuid or file-cap binaries
            ruleset = None
            if self.abi:
                work_fd = os.open(workdir, os.O_PATH)
                everything = L.landlock_fs_all(self.abi)
                rules = [(fd, L.LL_READ) for fd in (*self.read_fds, self.prefix_fd)]
                rules += [(fd, L.LL_READ) for fd in self.stdlib.values()]
                rules += [(fd, L.LL_FILE_RIGHTS & ~L.LL_FS_EXECUTE) for fd in self.dev_fds]
                rules += [(work_fd, everything)]
                if "private_tmp" in active:  # fresh tmpfs of this run only: all of it is ours
                    rules.append((os.open("/proc", os.O_PATH), L.LL_READ))
                    rules += [
                        (os.open(p, os.O_PATH), everything)
                        for p in ("/tmp", "/dev/shm")
                        if os.path.isdir(p)
                    ]
                try:
                    ruleset = L.landlock_ruleset(rules, self.abi)
                except OSError as err:  # reported; the host decides whether it may run
                    os.write(ctl_w, f"X P2 Landlock: {err}\n".encode()[:500])
            keep = {ctl_w, res_w, req_r, *self.stdlib.values()}
            if ruleset is not None:
                keep.add(ruleset)
            _close_fds_except(keep)
            # Not dumpable (set last: namespaces and maps are written): the program cannot
            # ptrace or take file descriptors from this process (the runner, in stdin mode),
            # and a crash starts no core_pattern helper. The filter keeps it so.
            L.prctl(L.PR_SET_DUMPABLE, 0)
            if self.filter_works:
                try:
                    active += L.seccomp_sandbox(no_sockets=self.seccomp)
                except OSError as err:
                    if self.shared_netns:  # without the filter, the namespace would carry data
                        raise
                    os.write(ctl_w, f"X P2 seccomp: {err}\n".encode()[:500])
            sys.meta_path.append(runner.DirFdFinder(self.stdlib))
            # --- ready: wait for the request (EOF: the server is gone or discards us) ---
            (n,) = struct.unpack(">I", _read_exact(req_r, 4))
            req = json.loads(_read_exact(req_r, n))
            os.close(req_r)
            if self.subreaper:  # our parent is the server now (C has exited)
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            lim = req["limits"]
            L.set_limits(
                cpu_s=int(req["timeout_s"]) + 1,
                address_space=int(lim["memory_mb"]) << 20,
                file_size=int(lim["file_mb"]) << 20,
                open_files=int(lim["open_files"]),
                nproc=int(lim["processes"]),
            )
            active.append("rlimits")
            if caps_dropped:
                active.append("no_caps")
            sys.executable = sys._base_executable = self.python
            stdin_mode = req["fn_name"] is None
            own_pidns = "pidns" in active
            confine = None
            if ruleset is not None:
                if stdin_mode and not own_pidns:
                    # Landlock in each test's child, so that we can still find (in /proc)
                    # and kill what a test leaves running before the next one starts.
                    L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
                    active += L.landlock_parts(self.abi)

                    def confine() -> None:
                        L.landlock_enforce(ruleset, self.abi)
                        os.close(ruleset)
                else:
                    try:
                        active += L.landlock_enforce(ruleset, self.abi)
                    except OSError as err:
                        os.write(ctl_w, f"X P2 Landlock: {err}\n".encode()[:500])
                    os.close(ruleset)
            elif stdin_mode and not own_pidns:
                L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
            # Also our check that the server is alive (else EPIPE): see PDEATHSIG above.
            os.write(ctl_w, ("L " + json.dumps(active) + "\n").encode())
            os.close(ctl_w)
            if stdin_mode:
                runner.run_stdin_mode(
                    req["code"], req["inputs"], res_w, int(lim["stdout_bytes"]), own_pidns, confine
                )
            else:
                runner.run_function_mode(req["code"], req["inputs"], req["fn_name"], res_w)
            os._exit(0)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.write(ctl_w, f"X P2 {type(err).__name__}: {err}\n".encode()[:500])
            os._exit(72)

    # --- outside: spares ---------------------------------------------------------------------
    def _ask_spare(self, tmp_mb: int) -> tuple:
        """Sends the zygote a new spare's pipes and cgroups; `_spare_forked` takes its pid."""
        host_dir = None
        if not self.namespaces or "mountns" not in self.probe_layers:
            import tempfile  # only without namespaces (see PRELOAD)

            host_dir = tempfile.mkdtemp(prefix="vapo-sandbox-", dir=self.host_tmp)
            if self.is_root:
                os.chown(host_dir, self.uid, self.uid)
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        res_r, res_w = os.pipe2(os.O_CLOEXEC)
        req_r, req_w = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # most requests then fit in one write
            fcntl.fcntl(req_w, fcntl.F_SETPIPE_SZ, 1 << 20)
        cgroups, cg_limits = [], self.cg_limits
        while self.cg_ready and not cgroups:  # made before the last reply; else now
            cgroups, cg_limits = self.cg_ready.pop(0)
        if not cgroups:
            cgroups, cg_limits = self.cgroups.create(*self.cg_limits), self.cg_limits
        try:
            msg = struct.pack("=i", int(tmp_mb)) + "\0".join([host_dir or "", *cgroups]).encode()
            socket.send_fds(self.zygote, [msg], [ctl_w, res_w, req_r])
        except OSError:
            for fd in (ctl_r, res_r, req_w):
                os.close(fd)
            self.cgroups.remove(cgroups)
            raise
        finally:
            for fd in (ctl_w, res_w, req_r):
                os.close(fd)
        return ctl_r, res_r, req_w, host_dir, tmp_mb, cgroups, cg_limits

    def _spare_forked(self, asked: tuple) -> Spare:
        """The zygote's answer (a pid) to the oldest request still unanswered, `asked`."""
        ctl_r, res_r, req_w, host_dir, tmp_mb, cgroups, cg_limits = asked
        reply = self.zygote.recv(4)
        if len(reply) != 4:
            raise RuntimeError("the zygote is gone")
        (pid,) = struct.unpack("=i", reply)
        if pid < 0:
            for fd in (ctl_r, res_r, req_w):
                os.close(fd)
            self.cgroups.remove(cgroups)
            if host_dir is not None:
                _remove_tree(host_dir)
            raise OSError(-pid, f"fork in the zygote: {os.strerror(-pid)}")
        sp = Spare(pid, ctl_r, res_r, req_w, host_dir, tmp_mb, cgroups, cg_limits)
        if self.direct:  # no C in between: P2 is our child, its session id its pid
            sp.p2_pid, sp.p2_fd, sp.c_reaped = pid, os.pidfd_open(pid), True
        return sp

    def _fork_spare(self, tmp_mb: int) -> Spare:
        self._collect()  # the zygote answers in order
        return self._spare_forked(self._ask_spare(tmp_mb))

    def _collect(self) -> None:
        """Takes the zygote's answers to the spares `deferred` asked for: into `spares`."""
        while self.asked:
            with contextlib.suppress(OSError):  # that fork failed: `handle` forks anew
                self.spares.append(self._spare_forked(self.asked.pop(0)))

    def _settle(self, sp: Spare, deadline: float) -> None:
        """Learns P2's pid from C and, when we are a subreaper, reaps C (P2 is then ours)."""
        while sp.p2_pid is None and _pid_line(sp.ctl) is None and time.perf_counter() < deadline:
            r, _, _ = select.select([sp.ctl_r], [], [], max(0.0, deadline - time.perf_counter()))
            if not r:
                break
            chunk = os.read(sp.ctl_r, 4096)
            if not chunk:
                break
            sp.ctl += chunk
        line = _pid_line(sp.ctl)
        if sp.p2_pid is None and line is not None and line.startswith(b"P "):
            try:
                sp.p2_pid = int(line[2:])
                sp.p2_fd = os.pidfd_open(sp.p2_pid)
            except (ValueError, OSError):
                sp.p2_pid = sp.p2_fd = None
        if self.subreaper and not sp.c_reaped:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(sp.c_pid, 0)  # C exits right after forking P2 (or after an error)
            sp.c_reaped = True

    def _discard(self, sp: Spare) -> None:
        self._settle(sp, time.perf_counter() + 5.0)
        if sp.p2_fd is not None:
            _pidfd_kill(sp.p2_fd)
        for fd in (sp.req_w, sp.ctl_r, sp.res_r):
            os.close(fd)
        if not sp.c_reaped:  # (a reaped pid may belong to someone else by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(sp.c_pid, signal.SIGKILL)
            os.waitpid(sp.c_pid, 0)
        if sp.p2_fd is not None:
            if self.subreaper or self.direct:  # P2 is our child
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(sp.p2_pid, 0)
            os.close(sp.p2_fd)
        self.cgroups.remove(sp.cgroups)
        if sp.host_dir is not None:
            _remove_tree(sp.host_dir)

    def _take_spare(self, tmp_mb: int, deadline: float) -> Spare:
        while self.spares or self.asked:
            if not self.spares:  # (the zygote may still be forking the ones asked for)
                self._collect()
                continue
            sp = self.spares.pop(0)
            self._settle(sp, deadline)
            alive = sp.p2_fd is not None and not select.select([sp.p2_fd], [], [], 0)[0]
            alive = alive and _state(sp.p2_pid) not in "TtZX"  # not stopped by someone
            if sp.tmp_mb == tmp_mb and alive:
                return sp
            self._discard(sp)  # killed by someone (reduced isolation) or other tmpfs size
        sp = self._fork_spare(tmp_mb)
        self._settle(sp, deadline)
        return sp

    def _hold_mount_ns(self, sp: Spare) -> None:
        if self.holder_w is not None and sp.p2_pid is not None:
            with contextlib.suppress(OSError):
                os.write(self.holder_w, struct.pack("=i", sp.p2_pid))

    def _refill(self, tmp_mb: int) -> list[int]:
        """Forks spares up to the depth; returns their session ids (C's pids)."""
        while len(self.spares) < self.depth:
            self.spares.append(self._fork_spare(tmp_mb))
        return [sp.c_pid for sp in self.spares]

    def _premake_cgroups(self) -> None:
        """During a run: the cgroups of the spares `deferred` will fork after its reply."""
        while len(self.spares) + len(self.asked) + len(self.cg_ready) < self.depth:
            self.cg_ready.append((self.cgroups.create(*self.cg_limits), self.cg_limits))

    def deferred(self) -> None:
        """The work a run leaves for after its reply: asking the zygote for the next spares
        (up to the depth), without waiting for its answers (`_collect`, at the next request),
        so that the zygote forks them while the host judges the run. An error leaves the rest
        to `handle`."""
        with contextlib.suppress(OSError):
            while len(self.spares) + len(self.asked) < self.depth:
                self.asked.append(self._ask_spare(self.refill_tmp_mb))

    # --- outside: one request ----------------------------------------------------------------
    def handle(self, req: dict, blob: bytes | None = None) -> tuple[dict, bytes]:
        """Runs one request (`blob`: its JSON as received, passed on to the sandbox as is)."""
        t0 = time.perf_counter()
        deadline = t0 + float(req["timeout_s"])
        cap = int(req["limits"]["output_bytes"])
        sp = self._take_spare(int(req["limits"]["tmp_mb"]), deadline)
        self.cg_limits = _cgroup_limits(req["limits"])  # and the next spares'
        if sp.cgroups and sp.cg_limits != self.cg_limits:
            try:
                self.cgroups.set_limits(sp.cgroups, *self.cg_limits)
            except OSError:  # not this run's limit: the host may not rely on it
                self._discard(sp)
                sp = self._fork_spare(sp.tmp_mb)
                self._settle(sp, deadline)
        self._hold_mount_ns(sp)
        if sp.p2_fd is None and self.subreaper:  # C failed (its error is in sp.ctl)
            self._discard(sp)
            header = _parse_ctl(sp.ctl)
            header.update(status="crashed", exit_code=70, raw_len=0)
            header["spare_sids"] = self._refill(sp.tmp_mb)
            return header, b""
        if blob is None:
            blob = json.dumps(req).encode()
        pending = memoryview(struct.pack(">I", len(blob)) + blob)
        os.set_blocking(sp.req_w, False)
        # With a subreaper, P2 is our child and its exit ends the run; otherwise C's does.
        watch_pid = sp.p2_pid if self.subreaper and sp.p2_pid is not None else sp.c_pid
        watch_fd = sp.p2_fd if watch_pid == sp.p2_pid else os.pidfd_open(sp.c_pid)
        ctl, raw, status, t_ready = sp.ctl, bytearray(), None, None
        poller = select.poll()
        for fd in (sp.ctl_r, sp.res_r, watch_fd):
            poller.register(fd, select.POLLIN)
        if pending:
            poller.register(sp.req_w, select.POLLOUT)
        done = False
        while not done:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                status = "timeout"
                break
            events = poller.poll(remaining * 1000)
            for fd, _ in events:
                if fd == watch_fd:
                    done = True
                elif fd == sp.req_w:
                    try:
                        pending = pending[os.write(fd, pending) :]
                    except OSError:  # P2 died before reading it all
                        pending = memoryview(b"")
                    if not pending:
                        poller.unregister(fd)
                        # while the run goes on: the cgroups of the spare that replaces it
                        self._premake_cgroups()
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        poller.unregister(fd)
                    elif fd == sp.ctl_r:
                        ctl += chunk[:4096]
                        if t_ready is None and (ctl.startswith(b"L ") or b"\nL " in ctl):
                            t_ready = time.perf_counter()
                    else:
                        raw += chunk
            if len(raw) > cap:
                status = "output_limit"
                break
            if done:
                _drain(sp.res_r, raw, cap)
        for fd in (sp.p2_fd, watch_fd):
            if fd is not None:
                _pidfd_kill(fd)
        if not sp.c_reaped:  # C is waiting on P2 (no subreaper)
            with contextlib.suppress(OSError):
                os.kill(sp.c_pid, signal.SIGKILL)
        _, wait_status = os.waitpid(watch_pid, 0)
        if not sp.c_reaped and watch_pid != sp.c_pid:
            os.waitpid(sp.c_pid, 0)
        if watch_fd != sp.p2_fd:
            os.close(watch_fd)
        if sp.p2_fd is not None:
            os.close(sp.p2_fd)
        self._collect()  # (answered by now) all spares known before any leftover is killed
        header = _parse_ctl(ctl)
        layers = header["layers"]
        if status is not None or "pidns" not in layers:
            self._reap_leftovers()  # orphans exist only without a PID namespace, or after kills
        if self.cgroups.oom_kills(sp.cgroups) and status != "output_limit":
            # Its processes together reached the run's memory limit and the kernel killed one:
            # the run fails as a whole (what the others sent may depend on the lost one).
            status = "memory_limit"
            raw = bytearray()
        self.cgroups.remove(sp.cgroups)
        for fd in (sp.ctl_r, sp.res_r, sp.req_w):
            os.close(fd)
        if sp.host_dir is not None:
            _remove_tree(sp.host_dir)
        t_end = time.perf_counter()
        code = os.waitstatus_to_exitcode(wait_status)
        if status is None:
            status = "ok" if code == 0 else "crashed"
        if not {"pidns", "landlock_scope"} & set(layers):
            # Nothing kept this run from signalling or ptracing the idle spares (same uid, no
            # PID namespace, no Landlock scoping): they may be tampered with; start afresh.
            for other in self.spares:
                self._discard(other)
            self.spares = []
        # The next runs' sandboxes are forked after the reply, while the host judges this
        # run (`deferred`); the ones already forked are listed here.
        self.refill_tmp_mb = sp.tmp_mb
        self._premake_cgroups()  # (made during the run unless it was killed first)
        spare_sids = [other.c_pid for other in self.spares]
        header.update(
            status=status,
            exit_code=code,
            raw_len=min(len(raw), cap),
            setup_ms=((t_ready or t_end) - t0) * 1e3,
            run_ms=(t_end - (t_ready or t_end)) * 1e3,
            spare_sids=spare_sids,
        )
        return header, bytes(raw[:cap])

    def _reap_leftovers(self) -> None:
        """Subreaper duty: SIGKILL and reap every remaining descendant (escaped daemons),
        sparing the spares."""
        keep = {self.zygote_pid} | ({self.holder_pid} if self.holder_pid else set())
        for sp in self.spares:
            self._settle(sp, time.perf_counter() + 5.0)
            keep.update((sp.c_pid, sp.p2_pid))
        runner.kill_tree(os.getpid(), keep)

    def probe(self) -> dict:
        """One empty run, to learn which layers this machine grants."""
        self.probe_layers = ["mountns"]  # optimistic for the probe itself
        req = {
            "code": "",
            "inputs": [],
            "fn_name": "f",
            "timeout_s": 10.0,
            "limits": DEFAULT_LIMITS,
        }
        header, _ = self.handle(req)
        self.probe_layers = header["layers"]
        self.deferred()
        self._collect()
        header["spare_sids"] = [sp.c_pid for sp in self.spares]
        if "mountns" not in self.probe_layers:
            for sp in self.spares:  # they expected namespaces: set up again with a host dir
                self._discard(sp)
            self.spares = []
            header["spare_sids"] = self._refill(DEFAULT_LIMITS["tmp_mb"])
        return header


DEFAULT_LIMITS = {
    "memory_mb": 2048,
    "file_mb": 16,
    "open_files": 128,
    "processes": 32,
    "pids": 256,
    "tmp_mb": 64,
    "stdout_bytes": 1 << 20,
    "output_bytes": 8 << 20,
}


def _cgroup_limits(limits: dict) -> tuple[int, int]:
    """(memory bytes, tasks) of a run's cgroups: `memory_mb` for all of the run together."""
    return int(limits["memory_mb"]) << 20, int(limits.get("pids", DEFAULT_LIMITS["pids"]))


def _start_mount_ns_holder() -> tuple[int, int]:
    """Forks the process that takes each run's mount namespace off the run's exit path.

    The last process to leave a mount namespace unmounts everything in it and then waits for an
    RCU grace period (`synchronize_rcu_expedited` in `namespace_unlock`): median 0.12 ms, p90
    1.2 ms here, on every run's critical path, the CPU idle meanwhile (results/sandbox_cpu.md).
    Sent a sandbox's pid when its run starts, the holder opens that process's mount namespace
    and keeps it until the next run's arrives, so that P2's exit no longer tears it down: the
    holder's close does, while the next run goes on (HumanEval throughput +1-9 % in six
    alternated rounds, `probe_sandbox_cpu.py --humaneval 5`). One run's namespace, with its
    /tmp, outlives the run until the next one starts; the holder never enters it and never runs
    candidate code. Returns its pid and the pipe to it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(r)
        os.set_blocking(w, False)  # a stopped holder must not stop the server: runs go on
        return pid, w
    try:
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        _new_session()  # stdio on /dev/null: the host's pipes stay the server's alone
        _close_fds_except({r})
        own = os.stat("/proc/self/ns/mnt").st_ino
        held = None
        while True:
            msg = os.read(r, 4)
            if len(msg) < 4:  # the server is gone or shutting down
                os._exit(0)
            try:
                fd = os.open(f"/proc/{struct.unpack('=i', msg)[0]}/ns/mnt", os.O_RDONLY)
            except OSError:  # already gone: its exit did the teardown
                continue
            if os.fstat(fd).st_ino == own:  # not yet in a namespace of its own
                os.close(fd)
                continue
            if held is not None:
                os.close(held)  # the previous run's namespace: torn down here
            held = fd
    finally:
        os._exit(0)


def _parse_ctl(ctl: bytes) -> dict:
    layers, errors = [], []
    for line in ctl.decode("utf-8", "replace").splitlines():
        if line.startswith("L "):
            layers = json.loads(line[2:])
        elif line.startswith("X "):
            errors.append(line[2:])
    return {"layers": layers, "setup_errors": errors}


def _state(pid: int) -> str:
    """The one-letter state of a process ('?' when unreadable)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
        return chr(stat[stat.rindex(b")") + 2])
    except (OSError, ValueError, IndexError):
        return "?"


def _pid_line(ctl: bytes) -> bytes | None:
    """C's report: ``P <pid of P2>`` or ``X <error>``, once a whole line of it arrived."""
    for line in ctl.split(b"\n")[:-1]:
        if line.startswith((b"P ", b"X C ")):
            return line
    return None


def _pidfd_kill(fd: int) -> None:
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(fd, signal.SIGKILL)


def _drain(fd: int, raw: bytearray, cap: int) -> None:
    """Reads what is already in the pipe, without waiting for holders to close it."""
    os.set_blocking(fd, False)
    try:
        while len(raw) <= cap:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            raw += chunk
    except BlockingIOError:
        return


def _new_session() -> None:
    """A session of our own (no controlling terminal), stdio on /dev/null."""
    os.setsid()
    fd = os.open("/dev/null", os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(fd, target)
    os.close(fd)


def _close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def main() -> None:
    opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    for name in PRELOAD + list(opts.get("preload", ())):
        __import__(name)
    server = Server(opts)
    probe = server.probe()
    out = sys.stdout.buffer

    def send(header: dict, raw: bytes = b"") -> None:
        blob = json.dumps(header).encode()
        out.write(struct.pack(">I", len(blob)) + blob + raw)
        out.flush()

    send(
        {
            "ready": True,
            "probe": probe,
            "subreaper": server.subreaper,
            "pid": os.getpid(),
            "uid": server.uid,
        }
    )
    while True:
        server.deferred()
        try:
            (n,) = struct.unpack(">I", _read_exact(0, 4))
            blob = _read_exact(0, n)
            req = json.loads(blob)
        except EOFError:  # the host closed us: the spares go too
            with contextlib.suppress(RuntimeError):
                server._collect()
            for sp in server.spares:
                server._discard(sp)
            for dirs, _ in server.cg_ready:
                server.cgroups.remove(dirs)
            server.zygote.close()
            os.waitpid(server.zygote_pid, 0)
            if server.holder_w is not None:
                os.close(server.holder_w)
                os.waitpid(server.holder_pid, 0)
            server.cgroups.close()
            return
        if req.get("op") == "spares":  # which processes are idle spares (none forking now)
            server._collect()
            send({"spare_sids": [sp.c_pid for sp in server.spares]})
            continue
        try:
            header, raw = server.handle(req, blob)
        except Exception as err:  # a server bug must not hang the host
            header, raw = {"status": "server_error", "error": repr(err), "raw_len": 0}, b""
        send(header, raw)


if __name__ == "__main__":
    main()
