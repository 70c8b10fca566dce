"""The warm fork server: a clean, single-threaded process that forks one sandbox per request.

Started by the host as ``python -I -S -B server.py`` with an empty environment (so that the
candidate's inherited memory and /proc/self/environ hold no secrets), before the trainer starts
CUDA or threads; fork() from here is cheap and safe. Process tree of one request:

    server (real uid, child subreaper)          deadline, byte caps, SIGKILL, reaping
     └─ C   uid 65534, new user/net/mnt/pid/ipc/uts namespaces; reports P2's pid, waits
         └─ P2  pid 1 of the new PID namespace: private /tmp, /dev/shm, /proc; rlimits,
             │  no capabilities, Landlock, scrubbed env, then `runner`
             └─ P3 ...  stdin mode: one child per test

When P2 exits, the kernel kills everything left in its PID namespace (double-fork daemons
included); without a PID namespace the server, as subreaper, kills its leftover descendants.
(As pid 1 the candidate ignores signals it sends itself; that only ever hurts it.)
Protocol on stdin/stdout: 4-byte big-endian length + JSON request; reply is length + JSON
header, then ``header["raw_len"]`` raw bytes of the result pipe (the host decodes them).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import struct
import sys
import tempfile
import time

if __package__:
    from . import layers as L
    from . import runner
else:  # run as a script (`-I` leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import layers as L
    import runner

    del sys.path[0]

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
    "queue",
    "random",
    "re",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "typing",
    "unicodedata",
]

READ_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class Server:
    def __init__(self, opts: dict) -> None:
        self.opts = opts
        self.is_root = os.geteuid() == 0
        self.abi = L.landlock_abi() if opts.get("landlock", True) else 0
        self.namespaces = opts.get("namespaces", True)
        self.read_fds = [
            os.open(p, os.O_PATH | os.O_CLOEXEC) for p in READ_PATHS if os.path.exists(p)
        ]
        self.dev_fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in DEVICES if os.path.exists(p)]
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

    # --- inside the sandbox ------------------------------------------------------------------
    def _child(self, req: dict, ctl_w: int, res_w: int, host_dir: str | None) -> None:
        """Process C: never returns."""
        active: list[str] = []
        try:
            os.setsid()
            fd = os.open("/dev/null", os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(fd, target)
            os.close(fd)
            active.append("session")
            uid = gid = L.NOBODY
            if self.is_root:
                L.drop_privileges(uid, gid)
                active.append("uid_drop")
            else:
                uid, gid = os.getuid(), os.getgid()
            if self.namespaces:
                try:
                    L.enter_namespaces(uid, gid, net=True)
                    active += ["userns", "netns", "pidns", "mountns"]
                except OSError:
                    pass
            p2 = os.fork()
            if p2 == 0:
                self._p2(req, ctl_w, res_w, host_dir, active)
            os.close(res_w)
            os.write(ctl_w, f"P {p2}\n".encode())
            _, status = os.waitpid(p2, 0)
            os._exit(0 if status == 0 else 1)
        except BaseException as err:
            os.write(ctl_w, f"X C {type(err).__name__}: {err}\n".encode()[:500])
            os._exit(70)

    def _p2(self, req, ctl_w, res_w, host_dir, active) -> None:
        """Process P2, pid 1 of the new PID namespace when there is one: never returns."""
        try:
            lim = req["limits"]
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            workdir = host_dir
            if "mountns" in active:
                L.private_mounts(int(lim["tmp_mb"]) << 20)
                active.append("private_tmp")
                os.mkdir("/tmp/work", 0o700)
                workdir = "/tmp/work"
            os.chdir(workdir)
            os.environ.clear()
            os.environ.update(
                PATH="/usr/bin:/bin",
                HOME=workdir,
                TMPDIR=workdir,
                LANG="C.UTF-8",
                OMP_NUM_THREADS="1",
                PYTHONIOENCODING="utf-8",
            )
            active.append("clean_env")
            L.set_limits(
                cpu_s=int(req["timeout_s"]) + 1,
                address_space=int(lim["memory_mb"]) << 20,
                file_size=int(lim["file_mb"]) << 20,
                open_files=int(lim["open_files"]),
                nproc=int(lim["processes"]),
            )
            active.append("rlimits")
            if "userns" in active:
                L.drop_capabilities()
                active.append("no_caps")
            if self.abi:
                work_fd = os.open(workdir, os.O_PATH)
                everything = L.landlock_fs_all(self.abi)
                rules = [(fd, L.LL_READ) for fd in self.read_fds]
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
                    active += L.landlock_restrict(rules, self.abi)
                except OSError as err:  # reported; the host decides whether it may run
                    os.write(ctl_w, f"X P2 Landlock: {err}\n".encode()[:500])
            keep = {ctl_w, res_w, *self.stdlib.values()}
            _close_fds_except(keep)
            sys.meta_path.append(runner.DirFdFinder(self.stdlib))
            os.write(ctl_w, ("L " + json.dumps(active) + "\n").encode())
            os.close(ctl_w)
            if req["fn_name"] is None:
                runner.run_stdin_mode(
                    req["code"], req["inputs"], res_w, int(lim["stdout_bytes"]), "pidns" in active
                )
            else:
                runner.run_function_mode(req["code"], req["inputs"], req["fn_name"], res_w)
            os._exit(0)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.write(ctl_w, f"X P2 {type(err).__name__}: {err}\n".encode()[:500])
            os._exit(72)

    # --- outside: one request ----------------------------------------------------------------
    def handle(self, req: dict) -> tuple[dict, bytes]:
        t0 = time.perf_counter()
        deadline = t0 + float(req["timeout_s"])
        cap = int(req["limits"]["output_bytes"])
        host_dir = None
        if not self.namespaces or "userns" not in self.probe_layers:
            host_dir = tempfile.mkdtemp(prefix="vapo-sandbox-")
            if self.is_root:
                os.chown(host_dir, L.NOBODY, L.NOBODY)
        ctl_r, ctl_w = os.pipe()
        res_r, res_w = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.close(ctl_r)
            os.close(res_r)
            self._child(req, ctl_w, res_w, host_dir)
        os.close(ctl_w)
        os.close(res_w)
        child_fd = os.pidfd_open(pid)
        p2_fd = None
        ctl, raw, status, t_ready = b"", bytearray(), None, None
        open_fds = {ctl_r, res_r}
        poller = select.poll()
        for fd in (ctl_r, res_r, child_fd):
            poller.register(fd, select.POLLIN)
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                status = "timeout"
                break
            events = poller.poll(remaining * 1000)
            for fd, _ in events:
                if fd == child_fd:
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif fd == ctl_r:
                    ctl += chunk[:4096]
                    if p2_fd is None and ctl.startswith(b"P "):
                        p2_fd = _pidfd(ctl)
                    if t_ready is None and b"\nL " in ctl:
                        t_ready = time.perf_counter()
                else:
                    raw += chunk
            if len(raw) > cap:
                status = "output_limit"
                break
            if any(fd == child_fd for fd, _ in events):
                _drain(res_r, raw, cap)
                break
        for fd in (p2_fd, child_fd):
            if fd is not None:
                _pidfd_kill(fd)
        _, wait_status = os.waitpid(pid, 0)
        if p2_fd is not None:
            os.close(p2_fd)
        os.close(child_fd)
        if status is not None or "pidns" not in _parse_ctl(ctl)["layers"]:
            self._reap_leftovers()  # orphans exist only without a PID namespace, or after kills
        for fd in (ctl_r, res_r):
            os.close(fd)
        if host_dir is not None:
            _remove_tree(host_dir)
        t_end = time.perf_counter()
        code = os.waitstatus_to_exitcode(wait_status)
        if status is None:
            status = "ok" if code == 0 else "crashed"
        header = _parse_ctl(ctl)
        header.update(
            status=status,
            exit_code=code,
            raw_len=min(len(raw), cap),
            setup_ms=((t_ready or t_end) - t0) * 1e3,
            run_ms=(t_end - (t_ready or t_end)) * 1e3,
        )
        return header, bytes(raw[:cap])

    def _reap_leftovers(self) -> None:
        """Subreaper duty: SIGKILL and reap every remaining descendant (escaped daemons)."""
        for _ in range(1000):
            kids = _children(os.getpid())
            while True:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    pid = 0
                if pid == 0:
                    break
            if not kids:
                return
            for kid in kids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(kid, signal.SIGKILL)
            time.sleep(0.001)

    def probe(self) -> dict:
        """One empty run, to learn which layers this machine grants."""
        self.probe_layers = ["userns"]  # optimistic for the probe itself
        req = {
            "code": "",
            "inputs": [],
            "fn_name": "f",
            "timeout_s": 10.0,
            "limits": DEFAULT_LIMITS,
        }
        header, _ = self.handle(req)
        self.probe_layers = header["layers"]
        return header


DEFAULT_LIMITS = {
    "memory_mb": 2048,
    "file_mb": 16,
    "open_files": 128,
    "processes": 32,
    "tmp_mb": 64,
    "stdout_bytes": 1 << 20,
    "output_bytes": 8 << 20,
}


def _parse_ctl(ctl: bytes) -> dict:
    layers, errors = [], []
    for line in ctl.decode("utf-8", "replace").splitlines():
        if line.startswith("L "):
            layers = json.loads(line[2:])
        elif line.startswith("X "):
            errors.append(line[2:])
    return {"layers": layers, "setup_errors": errors}


def _pidfd(ctl: bytes) -> int | None:
    try:
        return os.pidfd_open(int(ctl.split(b"\n", 1)[0][2:]))
    except (ValueError, OSError):
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


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _read_exact(n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
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

    send({"ready": True, "probe": probe, "subreaper": server.subreaper, "pid": os.getpid()})
    while True:
        try:
            (n,) = struct.unpack(">I", _read_exact(4))
            req = json.loads(_read_exact(n))
        except EOFError:
            return
        try:
            header, raw = server.handle(req)
        except Exception as err:  # a server bug must not hang the host
            header, raw = {"status": "server_error", "error": repr(err), "raw_len": 0}, b""
        send(header, raw)


if __name__ == "__main__":
    main()
