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
             └─ P3 ...  stdin mode: one child per test; execute mode: the one program

As root (the default there) there is no C: the server forks P2 straight into a new PID
namespace; P2 makes its mount/IPC/UTS namespaces and mounts as root, then drops to the
server's own sandbox uid and enters a user namespace of its own before anything else. Its
network namespace is the server's own (nothing up), made once, when the seccomp filter
(`seccomp_filter.sandbox_filter`) keeps every run from writing to it; otherwise P2 makes one
of its own too. A holder process (`zygote.start_mount_ns_holder`) takes each run's mount
namespace off the run's exit path.

Each sandbox (P2, or C on the unprivileged path) first joins a memory and a pids cgroup of
its run's own (`cgroups`), made with its spare and removed after the run, so that everything
the run starts or fills counts against one limit. A run's reply goes out before the next
spares are forked: their cgroups are made before it (the finished run's removed), the zygote
is asked for them after it and forks them while the host judges the run; its answers (their
pids) are read when the next run needs a spare or has ended.

When P2 exits, the kernel kills everything left in its PID namespace (double-fork daemons
included); without a PID namespace the server, as subreaper, kills its leftover descendants.
(As pid 1 the candidate ignores signals it sends itself; that only ever hurts it.)

This file handles requests (`Server.handle`: one run from spare to reply) and is the script
the host starts. `protocol` holds the wire formats, `isolation` what each sandbox sets up
before the program runs, `zygote` the process that forks them, the spares it forks ahead
and the mount namespace holder.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time

if __package__:
    from . import cgroups as CG
    from . import protocol as P
    from . import runner
    from .isolation import SANDBOX_ENV, Isolation
    from .zygote import RELEASE, Spare, Spares, cgroup_limits, pidfd_kill, remove_tree
else:  # run as a script (`-I` leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cgroups as CG
    import protocol as P
    import runner
    from isolation import SANDBOX_ENV, Isolation
    from zygote import RELEASE, Spare, Spares, cgroup_limits, pidfd_kill, remove_tree

    del sys.path[0]

# Imported once here so that the candidate's imports of them are free. Not `random`, `queue`
# (-> threading), `statistics` or `tempfile` (-> random): they register after-fork hooks that
# run in every forked sandbox and cost page faults (copy-on-write) on every fork; the
# candidate that needs them imports them itself.
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


class Server:
    def __init__(self, opts: dict) -> None:
        self.opts = opts
        host_tmp = os.environ.get("TMPDIR") or "/tmp"
        os.environ.clear()
        os.environ.update(SANDBOX_ENV)
        self.iso = Isolation(opts)
        # A memory and a pids cgroup per run (`cgroups`), made with each spare.
        self.cgroups = CG.RunCgroups(opts.get("cgroup_root", CG.DEFAULT_ROOT))
        self.spares = Spares(self.iso, self.cgroups, max(1, int(opts.get("spares", 2))), host_tmp)
        self.ended = False  # a run has ended whose mount namespace the holder still holds

    def handle(self, req: dict, blob: bytes | None = None) -> tuple[dict, bytes]:
        """Runs one request (`blob`: its JSON as received, passed on to the sandbox as is)."""
        t0 = time.monotonic()
        P.request_mode(req)  # an unknown mode fails here, before a spare is used
        deadline = t0 + float(req["timeout_s"])
        cap = int(req["limits"]["output_bytes"])
        sp = self._spare_for(req, deadline)
        if sp.p2_fd is None and self.iso.subreaper:  # C failed (its error is in sp.ctl)
            self.spares.discard(sp)
            header = P.parse_ctl(sp.ctl)
            del header["started"]
            header.update(status="setup_error", exit_code=70, raw_len=0)
            header["spare_sids"] = self.spares.refill(sp.tmp_mb)
            return header, b""
        if blob is None:
            blob = json.dumps(req).encode()
        os.set_blocking(sp.req_w, False)
        # With a subreaper, P2 is our child and its exit ends the run; otherwise C's does.
        watch_pid = sp.p2_pid if self.iso.subreaper and sp.p2_pid is not None else sp.c_pid
        watch_fd = sp.p2_fd if watch_pid == sp.p2_pid else os.pidfd_open(sp.c_pid)
        ctl, raw, status, t_ready = self._exchange(sp, P.frame(blob), watch_fd, deadline, cap)
        wait_status = self._end(sp, watch_pid, watch_fd)
        self.ended = True
        self.spares.collect()  # (answered by now) all spares known before any leftover is killed
        header = P.parse_ctl(ctl)
        # The program's start: the sandbox's own stamp (`t_ready`, when this loop read its
        # ready line, comes later when the server was busy), None if it never started.
        layers, started = header["layers"], header.pop("started")
        status, raw = self._clean_up(sp, layers, status, raw)
        t_end = time.monotonic()
        code = os.waitstatus_to_exitcode(wait_status)
        if status is None:  # P2 ended before its `L` line only if the sandbox failed to set up
            status = "ok" if code == 0 else "crashed" if t_ready is not None else "setup_error"
        self._before_reply(sp, layers)
        header.update(
            status=status,
            exit_code=code,
            raw_len=min(len(raw), cap),
            setup_ms=((started or t_end) - t0) * 1e3,
            run_ms=(t_end - (started or t_end)) * 1e3,
            spare_sids=self.spares.sids(),
        )
        return header, bytes(raw[:cap])

    def _spare_for(self, req: dict, deadline: float) -> Spare:
        """A spare for `req`, its cgroups set to the request's limits, its mount namespace
        handed to the holder."""
        sp = self.spares.take(int(req["limits"]["tmp_mb"]), deadline)
        self.spares.cg_limits = cgroup_limits(req["limits"])  # and the next spares'
        if sp.cgroups and sp.cg_limits != self.spares.cg_limits:
            try:
                self.cgroups.set_limits(sp.cgroups, *self.spares.cg_limits)
            except OSError:  # not this run's limit: the host may not rely on it
                self.spares.discard(sp)
                sp = self.spares.fork(sp.tmp_mb)
                self.spares.settle(sp, deadline)
        if self.iso.holder_w is not None and sp.p2_pid is not None:
            with contextlib.suppress(OSError):
                os.write(self.iso.holder_w, P.pack_pid(sp.p2_pid))
        return sp

    def _exchange(self, sp: Spare, request: bytes, watch_fd: int, deadline: float, cap: int):
        """Writes the request frame to the sandbox and reads its control and result pipes
        until the watched process exits, the deadline passes (status ``timeout``) or the
        output exceeds `cap` (``output_limit``). Returns (control bytes, result bytes,
        status or None, when the sandbox reported its layers or None)."""
        pending = memoryview(request)
        ctl, raw, status, t_ready = sp.ctl, bytearray(), None, None
        poller = select.poll()
        for fd in (sp.ctl_r, sp.res_r, watch_fd):
            poller.register(fd, select.POLLIN)
        if pending:
            poller.register(sp.req_w, select.POLLOUT)
        done = False
        while not done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                _drain(sp.res_r, raw, cap)  # what the run wrote until now (execute mode's)
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
                        self.spares.premake_cgroups()
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        poller.unregister(fd)
                    elif fd == sp.ctl_r:
                        ctl += chunk[:4096]
                        if t_ready is None and (ctl.startswith(b"L ") or b"\nL " in ctl):
                            t_ready = time.monotonic()
                    else:
                        raw += chunk
            if len(raw) > cap:
                status = "output_limit"
                break
            if done:
                _drain(sp.res_r, raw, cap)
                rest = bytearray()  # and the control line written just before the exit
                _drain(sp.ctl_r, rest, 4096)
                ctl += bytes(rest[:4096])
                if t_ready is None and (ctl.startswith(b"L ") or b"\nL " in ctl):
                    t_ready = time.monotonic()
        return ctl, raw, status, t_ready

    def _end(self, sp: Spare, watch_pid: int, watch_fd: int) -> int:
        """Kills what is left of the run's sandbox and reaps it; returns the wait status."""
        for fd in (sp.p2_fd, watch_fd):
            if fd is not None:
                pidfd_kill(fd)
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
        return wait_status

    def _clean_up(self, sp: Spare, layers: list[str], status: str | None, raw: bytearray):
        """Leftovers killed, the memory limit checked, the run's cgroups, pipes and host
        folder removed. Returns the run's status and output (none past the memory limit)."""
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
            remove_tree(sp.host_dir)
        return status, raw

    def _before_reply(self, sp: Spare, layers: list[str]) -> None:
        if not {"pidns", "landlock_scope"} & set(layers):
            # Nothing kept this run from signalling or ptracing the idle spares (same uid, no
            # PID namespace, no Landlock scoping): they may be tampered with; start afresh.
            self.spares.discard_all()
        # The next runs' sandboxes are forked after the reply, while the host judges this
        # run (`Spares.deferred`); the ones already forked are listed in the reply.
        self.spares.refill_tmp_mb = sp.tmp_mb
        self.spares.premake_cgroups()  # (made during the run unless it was killed first)

    def after_reply(self) -> None:
        """The work a run leaves for after its reply, done while the host judges it: the
        holder releases the run's mount namespace (its /tmp and /dev/shm pages, the kernel
        memory of its files), the zygote is asked for the next spares."""
        if self.ended and self.iso.holder_w is not None:
            with contextlib.suppress(OSError):
                os.write(self.iso.holder_w, P.pack_pid(RELEASE))
        self.ended = False
        self.spares.deferred()

    def _reap_leftovers(self) -> None:
        """Subreaper duty: SIGKILL and reap every remaining descendant (escaped daemons),
        sparing the spares."""
        runner.kill_tree(os.getpid(), self.spares.keep())

    def probe(self) -> dict:
        """One empty run, to learn which layers this machine grants."""
        self.spares.probe_layers = ["mountns"]  # optimistic for the probe itself
        req = {
            "code": "",
            "inputs": [],
            "fn_name": "f",
            "timeout_s": 10.0,
            "limits": P.DEFAULT_LIMITS,
        }
        header, _ = self.handle(req)
        self.spares.probe_layers = header["layers"]
        self.spares.deferred()
        self.spares.collect()
        header["spare_sids"] = self.spares.sids()
        if "mountns" not in self.spares.probe_layers:
            # They expected namespaces: set up again with a host dir.
            self.spares.discard_all()
            header["spare_sids"] = self.spares.refill(P.DEFAULT_LIMITS["tmp_mb"])
        return header

    def close(self) -> None:
        """The host closed us: the spares go too, then the helpers and the cgroup folders."""
        self.spares.close()
        if self.iso.holder_w is not None:
            os.close(self.iso.holder_w)
            os.waitpid(self.iso.holder_pid, 0)
        self.cgroups.close()


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


def main() -> None:
    opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    for name in PRELOAD + list(opts.get("preload", ())):
        __import__(name)
    server = Server(opts)
    probe = server.probe()
    out = sys.stdout.buffer

    def send(header: dict, raw: bytes = b"") -> None:
        out.write(P.frame(json.dumps(header).encode()) + raw)
        out.flush()

    send(
        {
            "ready": True,
            "probe": probe,
            "subreaper": server.iso.subreaper,
            "pid": os.getpid(),
            "uid": server.iso.uid,
        }
    )
    while True:
        server.after_reply()
        try:
            blob = P.read_frame(0)
            req = json.loads(blob)
        except EOFError:  # the host closed us: the spares go too
            server.close()
            return
        if req.get("op") == "spares":  # which processes are idle spares (none forking now)
            server.spares.collect()
            send({"spare_sids": server.spares.sids()})
            continue
        try:
            header, raw = server.handle(req, blob)
        except Exception as err:  # a server bug must not hang the host
            header, raw = {"status": "server_error", "error": repr(err), "raw_len": 0}, b""
        send(header, raw)


if __name__ == "__main__":
    main()
