"""How a sandbox is set up: the server-wide choices (`Isolation`), made once before any
request, and what each new sandbox does before it runs the program (C and P2 in the process
tree of `server`).

`Isolation(opts)` runs in the server at start: it picks the sandbox uid, whether sandboxes are
forked straight into a new PID namespace (root), starts the mount namespace holder, makes the
network namespace a server's runs share when the seccomp filter allows it, and opens what
the Landlock rules and the import finder need while the server can still reach it. Its
`fork_sandbox` runs in the zygote; `_direct`, `_child` and `_p2` run in the sandbox and never
return. P2's steps, in order: mounts (as root), the uid drop and a user namespace of its own,
working directory and environment, no capabilities, no new privileges, the Landlock ruleset,
every other file descriptor closed, not dumpable, seccomp; then it reads the request, sets its
rlimits, enforces Landlock and runs the program.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import time

if __package__:
    from . import cgroups as CG
    from . import fd_import, rootfs, runner
    from . import layers as L
    from . import protocol as P
    from . import seccomp_filter as SF
    from .zygote import close_fds_except, new_session, start_mount_ns_holder
else:  # imported by server.py run as a script
    import cgroups as CG
    import fd_import
    import layers as L
    import protocol as P
    import rootfs
    import runner
    import seccomp_filter as SF
    from zygote import close_fds_except, new_session, start_mount_ns_holder

SANDBOX_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp/work",
    "TMPDIR": "/tmp/work",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "PYTHONIOENCODING": "utf-8",
    "MALLOC_ARENA_MAX": str(L.MALLOC_ARENAS),
}
"""The whole environment of a sandbox. The server adopts it at start (its own is already
scrubbed by the host), so that a sandbox inherits it instead of rewriting `os.environ`
after the fork (page faults: each page it writes is copied from the server's)."""

READ_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class Isolation:
    """What every sandbox of one server gets, decided and prepared in the server at start."""

    def __init__(self, opts: dict) -> None:
        self.is_root = os.geteuid() == 0
        # The sandboxes' uid: one per server (`L.SANDBOX_UID_BASE`); without root, ours.
        self.uid = L.sandbox_uid(os.getpid()) if self.is_root else os.getuid()
        self.abi = L.landlock_abi() if opts.get("landlock", True) else 0
        self.namespaces = opts.get("namespaces", True)
        self.direct = self._direct_pid_ns(opts)
        self.holder_pid, self.holder_w = start_mount_ns_holder() if self.direct else (None, None)
        # No socket but Unix ones, which cannot send a packet (`seccomp_filter.sandbox_filter`):
        # then a network namespace can serve all of this server's runs, taking turns, since
        # none can leave a mark in it (its counters cannot move), and it is made once here
        # instead of once per run (with its teardown, the largest cost of a run that
        # isolation adds).
        L.limit_malloc_arenas()  # (inherited by every sandbox; SANDBOX_ENV for what they exec)
        self.filter_works = SF.seccomp_works()
        self.seccomp = bool(opts.get("seccomp", True)) and self.filter_works
        self.shared_netns = False
        if self.direct and self.seccomp:
            with contextlib.suppress(OSError):
                L.unshare(L.CLONE_NEWNET)
                self.shared_netns = True
        self._open_reachable()
        try:
            L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
            self.subreaper = True
        except OSError:
            self.subreaper = False

    def _direct_pid_ns(self, opts: dict) -> bool:
        """As root, each sandbox is forked straight into a new PID namespace (`unshare
        (CLONE_NEWPID)` here, undone by `setns` after the fork), makes its own mount, IPC, UTS
        and network namespaces as root, drops to the sandbox uid and then enters a user
        namespace of its own (per-user kernel state: keyrings, RLIMIT_NPROC's count). One
        process fewer per run than the unprivileged path through C. Not a network namespace
        shared by a server's runs, unless the seccomp filter keeps every run from writing to it
        (`__init__`)."""
        if not (self.is_root and self.namespaces and not opts.get("via_userns", False)):
            return False
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            L.unshare(L.CLONE_NEWPID)
        except OSError:  # no CAP_SYS_ADMIN (a container): the user-namespace path
            os.close(self.own_pid_ns)
            return False
        L.setns(self.own_pid_ns, L.CLONE_NEWPID)
        return True

    def _open_reachable(self) -> None:
        """Opens what the sandboxes' Landlock rules and import finder name."""
        self.read_fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in READ_PATHS if os.path.exists(p)]
        self.dev_fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in DEVICES if os.path.exists(p)]
        # The interpreter, reachable inside so that a program may start it (multiprocessing's
        # spawn and forkserver, subprocess): read and execute for Landlock; bind-mounted into
        # the run's minimal root at its own place (`rootfs`), below folders anyone may search
        # (a root server's direct path; the others cannot reach one below a mode-700 /root).
        self.python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        self.prefix = os.path.realpath(sys.base_prefix)
        self.prefix_fd = os.open(self.prefix, os.O_PATH | os.O_CLOEXEC)
        # The stdlib, opened now: after the uid drop its path may no longer be searchable.
        self.stdlib = {p: os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for p in sys.path if os.path.isdir(p)}
        self.import_by_fd = True  # (a sandbox with the minimal root may not need it)
        self.root_plan = rootfs.plan([*READ_PATHS, self.prefix, *self.stdlib], list(DEVICES))

    # --- in the zygote -----------------------------------------------------------------------
    def fork_sandbox(self, fds: list[int], host_dir: str | None, tmp_mb: int, cgroups, run_cgroups) -> int:
        """In the zygote: forks one sandbox (C, or P2 straight into a new PID namespace) into
        the cgroups `cgroups` (folders of `run_cgroups`)."""
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
            active = _join_cgroups(cgroups, run_cgroups, ctl_w)
            sandbox = self._direct if self.direct else self._child
            sandbox(ctl_w, res_w, req_r, host_dir, tmp_mb, active)
        if self.direct:  # and the one after it is not
            L.setns(self.own_pid_ns, L.CLONE_NEWPID)
        return pid

    # --- inside the sandbox ------------------------------------------------------------------
    def _direct(self, ctl_w, res_w, req_r, host_dir: str | None, tmp_mb: int, active: list[str]):
        """P2 forked by a root server into a new PID namespace: never returns."""
        try:
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            new_session()
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
            P.write_error(ctl_w, f"P2 {type(err).__name__}: {err}")
            os._exit(72)
        self._p2(ctl_w, res_w, req_r, host_dir, tmp_mb, active)

    def _child(self, ctl_w, res_w, req_r, host_dir: str | None, tmp_mb: int, active: list[str]):
        """Process C: never returns. Exits right after forking P2 when we are a subreaper
        (P2 is then re-parented to the server), else waits for it."""
        try:
            new_session()
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
            P.write_error(ctl_w, f"C {type(err).__name__}: {err}")
            os._exit(70)

    def _p2(self, ctl_w, res_w, req_r, host_dir, tmp_mb, active) -> None:
        """Process P2, pid 1 of the new PID namespace when there is one: never returns.

        Sets up everything that does not depend on the request, then blocks reading it."""
        try:
            if not self.subreaper:
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            workdir = self._mounts_and_uid(host_dir, tmp_mb, active)
            caps_dropped = self._clean_process(workdir, active)
            ruleset = self._landlock_ruleset(workdir, ctl_w, active)
            self._seal({ctl_w, res_w, req_r}, ruleset, ctl_w, active)
            # --- ready: wait for the request (EOF: the server is gone or discards us) ---
            req = json.loads(P.read_frame(req_r))
            os.close(req_r)
            if self.subreaper:  # our parent is the server now (C has exited)
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            self._run(req, ctl_w, res_w, ruleset, caps_dropped, active)
            os._exit(0)
        except BaseException as err:
            with contextlib.suppress(OSError):
                P.write_error(ctl_w, f"P2 {type(err).__name__}: {err}")
            os._exit(72)

    def _mounts_and_uid(self, host_dir: str | None, tmp_mb: int, active: list[str]) -> str:
        """P2's minimal root with a private /tmp (`rootfs`), then a root server's uid drop
        and user namespace. Returns the run's working directory."""
        workdir = host_dir
        if "mountns" in active:
            try:
                left_out = rootfs.build(self.root_plan, int(tmp_mb) << 20, os.geteuid() == 0)
                active.append("minimal_root")
                # Imports by path then, and no folder of the host's tree held open: from one,
                # a path through /proc/self/fd/<n>/.. would lead back to the host's sockets.
                # (A folder left out is one this uid cannot search up from either.)
                self.import_by_fd = bool(left_out)
            except rootfs.NoPivot:
                rootfs.private_folders(int(tmp_mb) << 20)
            active.append("private_tmp")
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
        return workdir

    def _clean_process(self, workdir: str, active: list[str]) -> bool:
        """Working directory and environment, no capabilities, no new privileges. Returns
        whether the capabilities could be dropped."""
        os.chdir(workdir)
        if workdir != SANDBOX_ENV["HOME"]:  # the server's environment is SANDBOX_ENV
            os.environ["HOME"] = os.environ["TMPDIR"] = workdir
        active.append("clean_env")
        caps_dropped = False
        with contextlib.suppress(OSError, KeyError):  # (KeyError: no capset number here)
            L.drop_capabilities()
            caps_dropped = True
        L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)  # no privilege from setuid or file-cap binaries
        return caps_dropped

    def _landlock_ruleset(self, workdir: str, ctl_w: int, active: list[str]) -> int | None:
        """The run's Landlock ruleset (enforced once the request is read), or None."""
        if not self.abi:
            return None
        work_fd = os.open(workdir, os.O_PATH)
        everything = L.landlock_fs_all(self.abi)
        rules = [(fd, L.LL_READ) for fd in (*self.read_fds, self.prefix_fd)]
        rules += [(fd, L.LL_READ) for fd in self.stdlib.values()]
        rules += [(fd, L.LL_FILE_RIGHTS & ~L.LL_FS_EXECUTE) for fd in self.dev_fds]
        rules += [(work_fd, everything)]
        if "private_tmp" in active:  # fresh tmpfs of this run only: all of it is ours
            rules.append((os.open("/proc", os.O_PATH), L.LL_READ))
            rules += [(os.open(p, os.O_PATH), everything) for p in ("/tmp", "/dev/shm") if os.path.isdir(p)]
        try:
            return L.landlock_ruleset(rules, self.abi)
        except OSError as err:  # reported; the host decides whether it may run
            P.write_error(ctl_w, f"P2 Landlock: {err}")
            return None

    def _seal(self, keep: set[int], ruleset: int | None, ctl_w: int, active: list[str]) -> None:
        """Closes every file descriptor but `keep`, the stdlib's when imports go through
        them, and the ruleset; not dumpable; the seccomp filter."""
        if self.import_by_fd:
            keep |= set(self.stdlib.values())
        if ruleset is not None:
            keep.add(ruleset)
        close_fds_except(keep)
        # Not dumpable (set last: namespaces and maps are written): the program cannot
        # ptrace or take file descriptors from this process (the runner, in stdin mode),
        # and a crash starts no core_pattern helper. The filter keeps it so.
        L.prctl(L.PR_SET_DUMPABLE, 0)
        if self.filter_works:
            try:
                active += SF.seccomp_sandbox(no_sockets=self.seccomp)
            except OSError as err:
                if self.shared_netns:  # without the filter, the namespace would carry data
                    raise
                P.write_error(ctl_w, f"P2 seccomp: {err}")
        if self.import_by_fd:
            sys.meta_path.append(fd_import.DirFdFinder(self.stdlib))

    def _run(self, req: dict, ctl_w, res_w, ruleset: int | None, caps_dropped: bool, active):
        """The request's limits and Landlock, the ``L`` line, then the program."""
        lim = req["limits"]
        address_space = int(lim["memory_mb"]) << 20
        if "memory_cgroup" in active and "pids_cgroup" in active:
            # The cgroup bounds the run's memory; the address space also holds a stack
            # (reserved, mostly untouched) for each of the `pids` threads the run may start.
            address_space += int(lim["pids"]) * L.thread_stack_bytes()
        L.set_limits(
            cpu_s=int(req["timeout_s"]) + 1,
            address_space=address_space,
            file_size=int(lim["file_mb"]) << 20,
            open_files=int(lim["open_files"]),
            # Threads count toward RLIMIT_NPROC too: with a pids cgroup bounding the run's tasks,
            # the rlimit is that bound, so that `processes` does not cap a program's threads.
            nproc=int(lim["pids"] if "pids_cgroup" in active else lim["processes"]),
        )
        active.append("rlimits")
        if caps_dropped:
            active.append("no_caps")
        sys.executable = sys._base_executable = self.python
        mode = P.request_mode(req)
        own_pidns = "pidns" in active
        # Stdin and execute mode run the program as our child, confined the same way.
        per_child = mode != "function" and not own_pidns
        confine = self._enforce_landlock(ruleset, per_child, ctl_w, active)
        # Also our check that the server is alive (else EPIPE): see PDEATHSIG above. `T`: the
        # moment the program starts (CLOCK_MONOTONIC, one clock for every process of the host),
        # so that the server splits setup from run however late it reads this line.
        os.write(ctl_w, f"L {json.dumps(active)}\nT {time.monotonic()!r}\n".encode())
        os.close(ctl_w)
        if mode == "stdin":
            runner.run_stdin_mode(req["code"], req["inputs"], res_w, int(lim["stdout_bytes"]), own_pidns, confine)
        elif mode == "execute":
            runner.run_execute_mode(req["code"], res_w, req["max_output_bytes"], own_pidns, confine)
        else:
            runner.run_function_mode(req["code"], req["inputs"], req["fn_name"], res_w)

    def _enforce_landlock(self, ruleset: int | None, per_test: bool, ctl_w, active: list[str]):
        """Enforces the ruleset here, or, with `per_test` (stdin or execute mode without a PID
        namespace), returns the function each program's child calls to enforce it there."""
        confine = None
        if ruleset is not None:
            if per_test:
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
                    P.write_error(ctl_w, f"P2 Landlock: {err}")
                os.close(ruleset)
        elif per_test:
            L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        return confine


def _join_cgroups(cgroups: list[str], run_cgroups, ctl_w: int) -> list[str]:
    """First thing in a new sandbox (P2 or C), while it still may: into its run's cgroups,
    so that every process it starts and every page it charges is counted there."""
    try:
        CG.join(cgroups)
    except OSError as err:
        P.write_error(ctl_w, f"cgroup: {err}")
        return []
    return run_cgroups.layers(cgroups)
