"""Host side: the warm server processes, a pool of them, and `evaluate`.

The host sends the program and the test *inputs* to a warm server, receives the raw frames the
sandbox wrote, decodes them as plain JSON and judges them with `compare` — the expected outputs
never leave this process.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from vapo_lightning.sandbox.cgroups import DEFAULT_ROOT as DEFAULT_CGROUP_ROOT
from vapo_lightning.sandbox.compare import judge
from vapo_lightning.sandbox.protocol import frame

SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")

ALL_LAYERS = (
    "session",
    "uid_drop",
    "own_uid",
    "userns",
    "netns",
    "pidns",
    "mountns",
    "private_tmp",
    "clean_env",
    "rlimits",
    "no_caps",
    "landlock_fs",
    "landlock_tcp",
    "landlock_scope",
    "no_sockets",
    "no_ptrace",
    "no_fs_watch",
    "not_dumpable",
    "subreaper",
    "memory_cgroup",
    "pids_cgroup",
)
"""Every layer the sandbox knows; `Result.layers` lists those that took effect."""


@dataclass
class Limits:
    """Resource limits of one sandboxed run (the wall-clock limit is `timeout_s`)."""

    memory_mb: int = 2048
    """Address space per process (RLIMIT_AS; keep >= 1024 for Python's allocator), and with
    the `memory_cgroup` layer the memory of the whole run (all of its processes, memfd, shm
    and /tmp pages; no swap): reaching it, the kernel kills a process of the run, and the
    run fails (every test) with status ``memory_limit``."""
    file_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE)."""
    open_files: int = 128
    processes: int = 32
    """RLIMIT_NPROC, counted inside the run's own user namespace when there is one."""
    pids: int = 256
    """Tasks (processes and threads) of the whole run, with the `pids_cgroup` layer."""
    tmp_mb: int = 64
    """Size of the private tmpfs mounted on /tmp (with a mount namespace)."""
    stdout_bytes: int = 1 << 20
    """Stdin mode: a test whose stdout exceeds this fails."""
    output_bytes: int = 8 << 20
    """Cap on everything the run sends back; beyond it the run is killed."""


@dataclass
class Result:
    passed: int
    total: int
    status: str
    """ok | timeout | output_limit | memory_limit | crashed | setup_error | server_error."""
    layers: list[str] = field(default_factory=list)
    per_test: list[bool] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    """Per test: None, or why it failed (exception type, 'wrong', 'missing', ...)."""
    setup_ms: float = 0.0
    run_ms: float = 0.0
    total_ms: float = 0.0

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class WarmServer:
    """One fork-server process. Start it before CUDA or threads exist in the host."""

    def __init__(
        self,
        namespaces: bool = True,
        landlock: bool = True,
        spares: int = 2,
        via_userns: bool = False,
        seccomp: bool = True,
        cgroup_root: str | None = DEFAULT_CGROUP_ROOT,
    ) -> None:
        opts = json.dumps(
            {
                "namespaces": namespaces,
                "landlock": landlock,
                "spares": spares,
                "via_userns": via_userns,
                "seccomp": seccomp,
                "cgroup_root": cgroup_root,
            }
        )
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # nothing secret to inherit
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", SERVER_SCRIPT, opts],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd="/",
            close_fds=True,
            start_new_session=True,
        )
        self.lock = threading.Lock()
        hello, _ = self._recv()
        self.probe = hello["probe"]
        self.extra_layers = ["subreaper"] if hello.get("subreaper") else []
        self.layers: list[str] = list(self.probe.get("layers", [])) + self.extra_layers
        self.spare_sids: list[int] = list(self.probe.get("spare_sids", []))
        """Session ids of the sandboxes forked ahead for the next runs (idle)."""
        self.uid: int = hello["uid"]
        """The uid the sandboxes run as: one per server when root (`layers.sandbox_uid`)."""

    def _recv(self) -> tuple[dict, bytes]:
        out = self.proc.stdout
        head = out.read(4)
        if len(head) != 4:
            raise RuntimeError(
                "sandbox server died (run it by hand to see why: "
                f"{sys.executable} -I -S {SERVER_SCRIPT})"
            )
        (n,) = struct.unpack(">I", head)
        header = json.loads(out.read(n))
        raw = out.read(header.get("raw_len", 0)) if "raw_len" in header else b""
        return header, raw

    def run(self, request: dict) -> tuple[dict, bytes]:
        blob = json.dumps(request).encode()
        with self.lock:
            self.proc.stdin.write(frame(blob))
            self.proc.stdin.flush()
            header, raw = self._recv()
            self.spare_sids = list(header.get("spare_sids", []))
        header["layers"] = list(header.get("layers", [])) + self.extra_layers
        return header, raw

    def query_spares(self) -> list[int]:
        """Asks the server for its idle spares' session ids (it forks a run's next spares
        after the reply, so a reply's own list may lack them)."""
        blob = json.dumps({"op": "spares"}).encode()
        with self.lock:
            self.proc.stdin.write(frame(blob))
            self.proc.stdin.flush()
            header, _ = self._recv()
            self.spare_sids = list(header.get("spare_sids", []))
        return self.spare_sids

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Pool:
    """`size` warm servers; `evaluate` may be called from that many threads at once.

    Each server keeps `spares` sandboxes forked ahead with every layer set up, waiting for
    their request, so that the namespace and Landlock set-up is off the request path.
    `namespaces=False` / `landlock=False` switch those layers off (for machines or tests that
    need the reduced paths); the result's `layers` always says what was active.
    `via_userns=True` makes a root server take the unprivileged path (namespaces created from
    a user namespace, one more process per run) instead of forking each sandbox straight into
    a new PID namespace and making the others there. `seccomp=False` lets the candidate create
    sockets again (`seccomp_filter.sandbox_filter`; they still reach nothing without a network
    namespace's way out), and then each run gets a network namespace of its own instead of the
    server's. `cgroup_root` is where the cgroup hierarchies are mounted (None: no per-run
    cgroup; `sandbox.cgroups`).
    """

    def __init__(
        self,
        size: int | None = None,
        namespaces: bool = True,
        landlock: bool = True,
        limits: Limits | None = None,
        spares: int = 2,
        via_userns: bool = False,
        seccomp: bool = True,
        cgroup_root: str | None = DEFAULT_CGROUP_ROOT,
    ) -> None:
        size = size or max(1, os.cpu_count() or 1)
        self.servers = [
            WarmServer(namespaces, landlock, spares, via_userns, seccomp, cgroup_root)
            for _ in range(size)
        ]
        self.idle: queue.Queue[WarmServer] = queue.Queue()
        for s in self.servers:
            self.idle.put(s)
        self.limits = limits or Limits()
        self.layers = self.servers[0].layers

    def evaluate(
        self,
        code: str,
        tests: list[dict],
        fn_name: str | None = None,
        timeout_s: float = 10.0,
        limits: Limits | None = None,
    ) -> Result:
        t0 = time.perf_counter()
        total = len(tests)
        if total == 0:
            return Result(0, 0, "ok", list(self.layers))
        limits = limits or self.limits
        if fn_name is None:
            inputs = [t["input"] if isinstance(t["input"], str) else "" for t in tests]
        else:
            inputs = [json.dumps(t["input"]) for t in tests]
        request = {
            "code": code,
            "inputs": inputs,
            "fn_name": fn_name,
            "timeout_s": float(timeout_s),
            "limits": limits.__dict__,
        }
        server = self.idle.get()
        try:
            header, raw = server.run(request)
        finally:
            self.idle.put(server)
        per_test, errors = judge(raw, tests, fn_name)
        return Result(
            passed=sum(per_test),
            total=total,
            status=header.get("status", "server_error"),
            layers=header.get("layers", []),
            per_test=per_test,
            errors=errors,
            setup_ms=header.get("setup_ms", 0.0),
            run_ms=header.get("run_ms", 0.0),
            total_ms=(time.perf_counter() - t0) * 1e3,
        )

    def spare_sessions(self) -> set[int]:
        """Session ids of the idle sandboxes forked ahead (not leftovers of any run)."""
        return {sid for s in self.servers for sid in s.query_spares()}

    def close(self) -> None:
        for s in self.servers:
            s.close()


_default: Pool | None = None
_default_lock = threading.Lock()


def default_pool() -> Pool:
    """The process-wide pool behind `evaluate`, started on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Pool()
            atexit.register(_default.close)
        return _default


def evaluate(
    code: str, tests: list[dict], fn_name: str | None = None, timeout_s: float = 10.0
) -> Result:
    """Runs `code` on `tests` in the sandbox and judges the outputs here, on the host.

    Function mode (`fn_name` given): each test is ``{"input": [args], "output": value}``.
    Stdin mode: ``{"input": stdin text, "output": expected stdout text}``.
    `timeout_s` bounds the whole call (plus a fixed overhead of a few milliseconds).
    """
    return default_pool().evaluate(code, tests, fn_name, timeout_s)
