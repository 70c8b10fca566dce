"""The processes a server forks at start besides sandboxes: the zygote, the only process
that forks sandboxes, with the spares it forks ahead of requests; and the mount namespace
holder (started by `Isolation`). Their first steps, `new_session` and `close_fds_except`,
are the sandboxes' too.

`start_zygote` forks the zygote once, at the server's start, after `Isolation` is set up.
`Spares` is the server's side of it: it sends the zygote each new sandbox's pipes and cgroups
(`protocol.spare_message`), reads the pids it answers, learns P2's pid from C, and hands a
live spare to the next request. A run's next spares are asked for after its reply
(`deferred`) and the answers read when a run needs a spare or has ended (`collect`), so that
the zygote forks them while the host judges the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

if __package__:
    from . import layers as L
    from . import protocol as P
else:  # imported by server.py run as a script
    import layers as L
    import protocol as P

if TYPE_CHECKING:
    from .cgroups import RunCgroups
    from .isolation import Isolation


def start_zygote(iso: Isolation, run_cgroups: RunCgroups) -> tuple[int, socket.socket]:
    """Forks the process that forks every sandbox, now, before any request exists.

    A sandbox forked by the server after requests were handled would inherit them: objects
    that frames still reference and freed memory never overwritten, where a program could read
    another run's code and inputs. The zygote is a copy of the server as it is now and only
    ever receives the pipes of a sandbox to fork; it forks with CLONE_PARENT, so each sandbox
    is still the server's child (waited for, reaped and signalled by it)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        return pid, ours
    try:
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        new_session()  # stdio on /dev/null: the host's pipes stay the server's alone
        ours.close()
        if iso.holder_w is not None:
            os.close(iso.holder_w)
        while True:
            msg, fds, _, _ = socket.recv_fds(theirs, 4096, 3, socket.MSG_CMSG_CLOEXEC)
            if len(msg) < 4 or len(fds) != 3:  # the server is gone or shutting down
                os._exit(0)
            tmp_mb, host_dir, cgroups = P.parse_spare_message(msg)
            try:
                pid = iso.fork_sandbox(fds, host_dir, tmp_mb, cgroups, run_cgroups)
            except OSError as err:
                pid = -max(1, err.errno or 1)
            for fd in fds:
                os.close(fd)
            theirs.send(P.pack_pid(pid))
    finally:
        os._exit(0)


def cgroup_limits(limits: dict) -> tuple[int, int]:
    """(memory bytes, tasks) of a run's cgroups: `memory_mb` for all of the run together."""
    return int(limits["memory_mb"]) << 20, int(limits.get("pids", P.DEFAULT_LIMITS["pids"]))


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


class Spares:
    """The sandboxes forked ahead, oldest first: with a `depth` of two, one is always ready
    even when requests come back to back (setting one up takes longer than a short run)."""

    def __init__(self, iso: Isolation, run_cgroups: RunCgroups, depth: int, host_tmp: str):
        self.iso, self.cgroups, self.depth, self.host_tmp = iso, run_cgroups, depth, host_tmp
        self.probe_layers: list[str] = ["mountns"]  # optimistic until the probe ran
        # Each spare's cgroups get the limits of the last request until one asks for others.
        self.cg_limits = cgroup_limits(P.DEFAULT_LIMITS)
        self.ready: list[Spare] = []  # forked, their pids known
        self.refill_tmp_mb = int(P.DEFAULT_LIMITS["tmp_mb"])  # the spares' tmpfs: the last run's
        # Cgroups made for the spares a run leaves to fork after its reply, with their limits
        self.cg_ready: list[tuple[list[str], tuple[int, int]]] = []
        self.asked: list[tuple] = []  # spares the zygote was asked for, its answer not read
        self.zygote_pid, self.zygote = start_zygote(iso, run_cgroups)

    def _ask(self, tmp_mb: int) -> tuple:
        """Sends the zygote a new spare's pipes and cgroups; `_forked` takes its pid."""
        host_dir = None
        if not self.iso.namespaces or "mountns" not in self.probe_layers:
            import tempfile  # only without namespaces (see server.PRELOAD)

            host_dir = tempfile.mkdtemp(prefix="vapo-sandbox-", dir=self.host_tmp)
            if self.iso.is_root:
                os.chown(host_dir, self.iso.uid, self.iso.uid)
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
            msg = P.spare_message(tmp_mb, host_dir, cgroups)
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

    def _forked(self, asked: tuple) -> Spare:
        """The zygote's answer (a pid) to the oldest request still unanswered, `asked`."""
        ctl_r, res_r, req_w, host_dir, tmp_mb, cgroups, cg_limits = asked
        reply = self.zygote.recv(4)
        if len(reply) != 4:
            raise RuntimeError("the zygote is gone")
        pid = P.unpack_pid(reply)
        if pid < 0:
            for fd in (ctl_r, res_r, req_w):
                os.close(fd)
            self.cgroups.remove(cgroups)
            if host_dir is not None:
                remove_tree(host_dir)
            raise OSError(-pid, f"fork in the zygote: {os.strerror(-pid)}")
        sp = Spare(pid, ctl_r, res_r, req_w, host_dir, tmp_mb, cgroups, cg_limits)
        if self.iso.direct:  # no C in between: P2 is our child, its session id its pid
            sp.p2_pid, sp.p2_fd, sp.c_reaped = pid, os.pidfd_open(pid), True
        return sp

    def fork(self, tmp_mb: int) -> Spare:
        self.collect()  # the zygote answers in order
        return self._forked(self._ask(tmp_mb))

    def collect(self) -> None:
        """Takes the zygote's answers to the spares `deferred` asked for: into `ready`."""
        while self.asked:
            with contextlib.suppress(OSError):  # that fork failed: `take` forks anew
                self.ready.append(self._forked(self.asked.pop(0)))

    def settle(self, sp: Spare, deadline: float) -> None:
        """Learns P2's pid from C and, when we are a subreaper, reaps C (P2 is then ours)."""
        while sp.p2_pid is None and P.pid_line(sp.ctl) is None and time.perf_counter() < deadline:
            r, _, _ = select.select([sp.ctl_r], [], [], max(0.0, deadline - time.perf_counter()))
            if not r:
                break
            chunk = os.read(sp.ctl_r, 4096)
            if not chunk:
                break
            sp.ctl += chunk
        line = P.pid_line(sp.ctl)
        if sp.p2_pid is None and line is not None and line.startswith(b"P "):
            try:
                sp.p2_pid = int(line[2:])
                sp.p2_fd = os.pidfd_open(sp.p2_pid)
            except (ValueError, OSError):
                sp.p2_pid = sp.p2_fd = None
        if self.iso.subreaper and not sp.c_reaped:
            # C exits right after forking P2 (or after an error). One that a run of the same
            # uid stopped (no PID namespace) is killed: a wait for its exit would never end.
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(sp.c_pid, os.WUNTRACED)
                if os.WIFSTOPPED(status):
                    os.kill(sp.c_pid, signal.SIGKILL)
                    os.waitpid(sp.c_pid, 0)
            sp.c_reaped = True

    def discard(self, sp: Spare) -> None:
        self.settle(sp, time.perf_counter() + 5.0)
        if sp.p2_fd is not None:
            pidfd_kill(sp.p2_fd)
        for fd in (sp.req_w, sp.ctl_r, sp.res_r):
            os.close(fd)
        if not sp.c_reaped:  # (a reaped pid may belong to someone else by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(sp.c_pid, signal.SIGKILL)
            os.waitpid(sp.c_pid, 0)
        if sp.p2_fd is not None:
            if self.iso.subreaper or self.iso.direct:  # P2 is our child
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(sp.p2_pid, 0)
            os.close(sp.p2_fd)
        self.cgroups.remove(sp.cgroups)
        if sp.host_dir is not None:
            remove_tree(sp.host_dir)

    def discard_all(self) -> None:
        for sp in self.ready:
            self.discard(sp)
        self.ready = []

    def take(self, tmp_mb: int, deadline: float) -> Spare:
        """The oldest live spare with a tmpfs of `tmp_mb` (the others are discarded), or a
        new one."""
        while self.ready or self.asked:
            if not self.ready:  # (the zygote may still be forking the ones asked for)
                self.collect()
                continue
            sp = self.ready.pop(0)
            self.settle(sp, deadline)
            alive = sp.p2_fd is not None and not select.select([sp.p2_fd], [], [], 0)[0]
            alive = alive and _state(sp.p2_pid) not in "TtZX"  # not stopped by someone
            if sp.tmp_mb == tmp_mb and alive:
                return sp
            self.discard(sp)  # killed by someone (reduced isolation) or other tmpfs size
        sp = self.fork(tmp_mb)
        self.settle(sp, deadline)
        return sp

    def refill(self, tmp_mb: int) -> list[int]:
        """Forks spares up to the depth; returns their session ids (C's pids)."""
        while len(self.ready) < self.depth:
            self.ready.append(self.fork(tmp_mb))
        return self.sids()

    def sids(self) -> list[int]:
        """The session ids (C's pids) of the spares forked and known."""
        return [sp.c_pid for sp in self.ready]

    def premake_cgroups(self) -> None:
        """During a run: the cgroups of the spares `deferred` will fork after its reply."""
        while len(self.ready) + len(self.asked) + len(self.cg_ready) < self.depth:
            self.cg_ready.append((self.cgroups.create(*self.cg_limits), self.cg_limits))

    def deferred(self) -> None:
        """The work a run leaves for after its reply: asking the zygote for the next spares
        (up to the depth), without waiting for its answers (`collect`, at the next request),
        so that the zygote forks them while the host judges the run. An error leaves the rest
        to `take`."""
        with contextlib.suppress(OSError):
            while len(self.ready) + len(self.asked) < self.depth:
                self.asked.append(self._ask(self.refill_tmp_mb))

    def keep(self) -> set[int]:
        """The pids a leftover hunt must spare: the zygote, the holder, every spare's C and P2."""
        keep = {self.zygote_pid} | ({self.iso.holder_pid} if self.iso.holder_pid else set())
        for sp in self.ready:
            self.settle(sp, time.perf_counter() + 5.0)
            keep.update((sp.c_pid, sp.p2_pid))
        return keep

    def close(self) -> None:
        """Discards every spare, even those still being forked, and stops the zygote."""
        with contextlib.suppress(RuntimeError):
            self.collect()
        self.discard_all()
        for dirs, _ in self.cg_ready:
            self.cgroups.remove(dirs)
        self.zygote.close()
        os.waitpid(self.zygote_pid, 0)


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


def pidfd_kill(fd: int) -> None:
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(fd, signal.SIGKILL)


def remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


RELEASE = 0
"""Sent to the mount namespace holder instead of a pid: the run it holds has ended."""


def start_mount_ns_holder() -> tuple[int, int]:
    """Forks the process that takes each run's mount namespace off the run's exit path.

    The last process to leave a mount namespace unmounts everything in it and then waits for an
    RCU grace period (`synchronize_rcu_expedited` in `namespace_unlock`), on every run's
    critical path, the CPU idle meanwhile. Sent a sandbox's pid when its run starts, the holder
    opens that process's mount namespace and keeps it until it is sent 0 (`RELEASE`: the run has
    ended) or the next run's pid, so that P2's exit no longer tears it down: the holder's close
    does, after the server replied. What a run left in its /tmp and /dev/shm (files, or a
    million hard links: kernel memory) is freed then. The holder never enters a namespace and
    never runs candidate code. Returns its pid and the pipe to it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(r)
        os.set_blocking(w, False)  # a stopped holder must not stop the server: runs go on
        return pid, w
    try:
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        new_session()  # stdio on /dev/null: the host's pipes stay the server's alone
        close_fds_except({r})
        own = os.stat("/proc/self/ns/mnt").st_ino
        held = None
        while True:
            msg = os.read(r, 4)
            if len(msg) < 4:  # the server is gone or shutting down
                os._exit(0)
            if P.unpack_pid(msg) == RELEASE:
                if held is not None:
                    os.close(held)  # the ended run's namespace: torn down here
                held = None
                continue
            try:
                fd = os.open(f"/proc/{P.unpack_pid(msg)}/ns/mnt", os.O_RDONLY)
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


def new_session() -> None:
    """A session of our own (no controlling terminal), stdio on /dev/null."""
    os.setsid()
    fd = os.open("/dev/null", os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(fd, target)
    os.close(fd)


def close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)
