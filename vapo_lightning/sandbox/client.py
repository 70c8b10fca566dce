"""Host side: the warm server processes, a pool of them, `evaluate` and `execute`.

The host sends the program and the test *inputs* to a warm server, receives the raw frames the
sandbox wrote, decodes them as plain JSON and judges them with `compare` — the expected outputs
never leave this process. `execute` (a code-interpreter tool call) runs one program the same
way and returns what it printed instead of a verdict.
"""

from __future__ import annotations

import atexit
import binascii
import json
import os
import queue
import re
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from vapo_lightning.sandbox.cgroups import DEFAULT_ROOT as DEFAULT_CGROUP_ROOT
from vapo_lightning.sandbox.compare import judge
from vapo_lightning.sandbox.protocol import encode_args, frame

_EXIT_CODE = re.compile(rb"-?[0-9]{1,9}")

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
    "minimal_root",
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
    "dies_with_server",
    "subreaper",
    "memory_cgroup",
    "pids_cgroup",
    "cpu_cgroup",
)
"""Every layer the sandbox knows; `Result.layers` lists those that took effect."""


@dataclass
class Limits:
    """Resource limits of one sandboxed run (the wall-clock limit is `timeout_s`)."""

    memory_mb: int = 2048
    """Address space per process (RLIMIT_AS; keep >= 1024 for Python's allocator), and with
    the `memory_cgroup` layer the memory of the whole run (all of its processes, memfd, shm
    and /tmp pages; no swap): reaching it, the kernel kills a process of the run, and the
    run fails (every test) with status ``memory_limit``. With the memory and pids cgroups,
    RLIMIT_AS is this plus a thread stack for each of `pids` tasks (the cgroup bounds the
    memory; the address space must hold the threads' reserved stacks)."""
    file_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE)."""
    open_files: int = 128
    processes: int = 32
    """RLIMIT_NPROC, counted inside the run's own user namespace when there is one; it counts
    threads too. Only without the `pids_cgroup` layer: with it, RLIMIT_NPROC is `pids`."""
    pids: int = 256
    """Tasks (processes and threads) of the whole run, with the `pids_cgroup` layer."""
    tmp_mb: int = 64
    """Size of the private tmpfs mounted on /tmp, and of the one on /dev/shm
    (`multiprocessing.shared_memory`), with a mount namespace."""
    stdout_bytes: int = 1 << 20
    """Stdin mode: a test whose stdout exceeds this fails."""
    output_bytes: int = 8 << 20
    """Cap on everything the run sends back; beyond it the run is killed."""


@dataclass
class Result:
    passed: int
    total: int
    status: str
    """ok | timeout | output_limit | memory_limit | crashed (the program's process died) |
    setup_error (the sandbox failed before the program ran) | server_error."""
    layers: list[str] = field(default_factory=list)
    per_test: list[bool] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    """Per test: None, or why it failed (exception type, 'wrong', 'missing', ...)."""
    setup_errors: list[str] = field(default_factory=list)
    """What the sandbox reported while it set up (why, for a setup_error)."""
    setup_ms: float = 0.0
    run_ms: float = 0.0
    total_ms: float = 0.0

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass
class Execution:
    """What one executed program did (`Pool.execute`)."""

    status: str
    """ok | error (nonzero exit, uncaught exception, killed by a signal) | timeout |
    memory_limit | output_limit (the whole run's `Limits.output_bytes` was reached) |
    setup_error (the sandbox failed before the program ran) | server_error."""
    exit_code: int | None
    """The program's exit status (minus the signal that killed it); None if it did not end."""
    stdout: str
    stderr: str
    """Decoded as UTF-8, invalid bytes replaced; an uncaught exception's traceback is here."""
    truncated: bool
    """stdout or stderr was cut at `max_output_bytes` (the first bytes are kept)."""
    layers: list[str] = field(default_factory=list)
    total_ms: float = 0.0


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
                f"sandbox server died (run it by hand to see why: {sys.executable} -I -S {SERVER_SCRIPT})"
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
        self.servers = [WarmServer(namespaces, landlock, spares, via_userns, seccomp, cgroup_root) for _ in range(size)]
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
            inputs = [encode_args(t["input"]) for t in tests]
        request = {
            "code": code,
            "inputs": inputs,
            "fn_name": fn_name,
            "timeout_s": float(timeout_s),
            "limits": limits.__dict__,
        }
        header, raw = self._run(request)
        per_test, errors = judge(raw, tests, fn_name)
        return Result(
            passed=sum(per_test),
            total=total,
            status=header.get("status", "server_error"),
            layers=header.get("layers", []),
            per_test=per_test,
            errors=errors,
            setup_errors=header.get("setup_errors", []),
            setup_ms=header.get("setup_ms", 0.0),
            run_ms=header.get("run_ms", 0.0),
            total_ms=(time.perf_counter() - t0) * 1e3,
        )

    def execute(
        self,
        code: str,
        timeout_s: float = 5.0,
        limits: Limits | None = None,
        max_output_bytes: int = 16384,
    ) -> Execution:
        """Runs `code` once as ``__main__`` with empty stdin and returns its exit status,
        stdout and stderr, each cut at `max_output_bytes` (a flood ends truncated, not failed).

        The program is the same confined child as a stdin-mode test (same layers, `limits` and
        wall-clock `timeout_s`); each call is a fresh program in a fresh sandbox: no
        interpreter state and no file of an earlier call is left. On a timeout the output is
        what the program wrote before it. Output is sent back base64-encoded, at most twice
        `max_output_bytes` * 4/3: keep that below `Limits.output_bytes`."""
        t0 = time.perf_counter()
        if type(max_output_bytes) is not int or max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be an int >= 0, not {max_output_bytes!r}")
        request = {
            "mode": "execute",
            "code": code,
            "max_output_bytes": max_output_bytes,
            "timeout_s": float(timeout_s),
            "limits": (limits or self.limits).__dict__,
        }
        header, raw = self._run(request)
        exit_code, stdout, stderr, truncated = _read_execution(raw, max_output_bytes)
        status = header.get("status", "server_error")
        if status not in ("timeout", "memory_limit", "output_limit", "setup_error", "server_error"):
            if exit_code is not None:  # the program ended: its own status decides
                status = "ok" if exit_code == 0 else "error"
            else:  # the runner never saw it end: it did not start, or it took the runner down
                status = "setup_error" if header.get("setup_errors") else "error"
        return Execution(
            status=status,
            exit_code=exit_code if status in ("ok", "error") else None,
            stdout=stdout,
            stderr=stderr,
            truncated=truncated,
            layers=header.get("layers", []),
            total_ms=(time.perf_counter() - t0) * 1e3,
        )

    def _run(self, request: dict) -> tuple[dict, bytes]:
        """One request on an idle server (waits for one)."""
        server = self.idle.get()
        try:
            return server.run(request)
        finally:
            self.idle.put(server)

    def spare_sessions(self) -> set[int]:
        """Session ids of the idle sandboxes forked ahead (not leftovers of any run)."""
        return {sid for s in self.servers for sid in s.query_spares()}

    def close(self) -> None:
        for s in self.servers:
            s.close()


def _read_execution(raw: bytes, max_output_bytes: int) -> tuple[int | None, str, str, bool]:
    """(exit code or None, stdout, stderr, truncated) from execute mode's frames (`runner`).
    Only whole lines count (the server may have cut the last); a malformed one is skipped."""
    streams = {b"1": bytearray(), b"2": bytearray()}
    exit_code, truncated = None, False
    for line in raw.split(b"\n")[:-1]:
        parts = line.split(b" ", 2)
        if len(parts) != 3 or parts[0] != b"0":
            continue
        kind, rest = parts[1], parts[2]
        if kind in streams:
            try:
                streams[kind] += binascii.a2b_base64(rest)
            except (binascii.Error, ValueError):
                continue
        elif kind == b"C":
            truncated = True
        elif kind == b"X" and exit_code is None and _EXIT_CODE.fullmatch(rest):
            exit_code = int(rest)
    for data in streams.values():
        if len(data) > max_output_bytes:  # (the runner cuts already; never trust a length)
            del data[max_output_bytes:]
            truncated = True
    out, err = (bytes(streams[k]).decode("utf-8", "replace") for k in (b"1", b"2"))
    return exit_code, out, err, truncated


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


def evaluate(code: str, tests: list[dict], fn_name: str | None = None, timeout_s: float = 10.0) -> Result:
    """Runs `code` on `tests` in the sandbox and judges the outputs here, on the host.

    Function mode (`fn_name` given): each test is ``{"input": [args], "output": value}``.
    Stdin mode: ``{"input": stdin text, "output": expected stdout text}``.
    `timeout_s` bounds the whole call (plus a fixed overhead of a few milliseconds).
    """
    return default_pool().evaluate(code, tests, fn_name, timeout_s)


def execute(code: str, timeout_s: float = 5.0, max_output_bytes: int = 16384) -> Execution:
    """Runs `code` once in the sandbox and returns what it printed (`Pool.execute`), through
    the process-wide pool. Each call is a fresh program: no state is kept between calls."""
    return default_pool().execute(code, timeout_s, max_output_bytes=max_output_bytes)
