"""What the hostile-program tests share: the host's secret and canary paths, the sandbox's
processes as /proc shows them, a listener for anything a run sends out, the check that the
host is intact after a run, and the hostile programs themselves (files in `programs/`, their
`@NAME@` placeholders filled in by `program`)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sysconfig
import threading
import time
from pathlib import Path

from vapo_lightning.sandbox import Pool
from vapo_lightning.sandbox.layers import SANDBOX_UID_BASE

PROGRAMS_DIR = Path(__file__).resolve().parent / "programs"
TOKEN = secrets.token_hex(8)
SECRET = f"s3cret-{secrets.token_hex(8)}"
SITE = sysconfig.get_paths()["purelib"]
CANARIES = [
    f"/tmp/vapo-pwned-{TOKEN}",
    f"/dev/shm/vapo-pwned-{TOKEN}",
    f"{SITE}/vapo_pwned_{TOKEN}.pth",
    f"/root/vapo-pwned-{TOKEN}",
    f"/work/vapo-pwned-{TOKEN}",
]
REPO_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyproject.toml")
# add_key / keyctl syscall numbers (the stdlib has no keyring API)
KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)


def program(name: str, **values: object) -> str:
    """The program in `programs/<name>.py`, each `@KEY@` in it replaced by `str(values[KEY])`;
    a placeholder not given stays, for the caller to fill."""
    code = (PROGRAMS_DIR / f"{name}.py").read_text()
    for key, value in values.items():
        code = code.replace(f"@{key}@", str(value))
    return code


def proc_status(pid: int | str) -> dict[str, str]:
    """/proc/<pid>/status as a dict: field -> value."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)


def foreign_server(pid: int, ours: set[int] | None = None) -> bool:
    """Whether `pid` descends from a sandbox server that is not one of `ours` (the pool under
    test's servers), or, without `ours`, that this test process did not start (another pool
    on the same machine, e.g. a training run with CodeReward)."""
    seen = 0
    while pid > 1 and seen < 64:
        seen += 1
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                is_server = b"sandbox/server.py" in f.read()
            ppid = int(proc_status(pid)["PPid"])
        except (OSError, KeyError, ValueError):
            return False
        if is_server:
            return pid not in ours if ours is not None else ppid != os.getpid()
        pid = ppid
    return False


def sandbox_processes(spare_sessions: set[int] = frozenset(), servers: set[int] | None = None) -> list[int]:
    """Live (non-zombie) processes whose real uid is a sandbox uid (65534 or one of a root
    server's, `SANDBOX_UID_BASE` + its pid), other than those of sandbox servers started by
    other processes, or, given `servers` (a pool's server pids), of any other server.

    Processes in `spare_sessions` are the pool's idle sandboxes, forked ahead for the next
    runs (each in its own session, started by the server after the previous run ended)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = proc_status(entry)
        except OSError:
            continue
        uid = int(fields["Uid"].split()[0])
        sandbox_uid = uid == 65534 or SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + (1 << 22)
        if sandbox_uid and not fields["State"].strip().startswith("Z"):
            try:
                sid = os.getsid(int(entry))
            except OSError:
                continue  # gone meanwhile
            if sid not in spare_sessions and not foreign_server(int(entry), servers):
                found.append(int(entry))
    return found


def pool_leftovers(pool: Pool, grace_s: float = 3.0) -> list[int]:
    """The pool's sandbox processes other than its idle spares, once none is left or after
    `grace_s` (a process SIGKILLed by another pool's server, or at a run's end, may take a
    moment to leave /proc; a leak stays)."""
    servers = {s.proc.pid for s in pool.servers}
    deadline = time.monotonic() + grace_s
    while (left := sandbox_processes(pool.spare_sessions(), servers)) and (time.monotonic() < deadline):
        time.sleep(0.1)
    return left


class Listener:
    """A TCP, a UDP and an abstract Unix socket on the host, recording anything received."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(f"\0vapo-test-{TOKEN}")
        self.unix.listen()
        for sock in (self.tcp, self.udp, self.unix):
            sock.settimeout(0.05)
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            for sock in (self.tcp, self.unix):
                try:
                    conn, _ = sock.accept()
                    self.received.append(b"connect")
                    conn.close()
                except OSError:
                    pass
            with contextlib.suppress(OSError):
                self.received.append(self.udp.recv(100))

    def close(self) -> None:
        """Stops listening and frees the sockets (the abstract name too, for the next host)."""
        self.stop = True
        self.thread.join()
        for sock in (self.tcp, self.udp, self.unix):
            sock.close()


def assert_host_intact(host) -> None:
    """No process of the run left, no canary created, the secret untouched, nothing received,
    the holder alive, and the pool still judging honest code."""
    assert pool_leftovers(host["pool"]) == []
    for path in CANARIES:
        assert not os.path.exists(path), path
    assert host["secret_file"].read_text() == SECRET
    assert sorted(os.listdir(host["home"])) == [".secret"]
    assert host["listener"].received == []
    assert os.path.exists(f"/proc/{host['holder']}")
    assert os.environ["VAPO_TEST_SECRET"] == SECRET
    # The servers survived and still judge honest code correctly.
    for _ in range(2):
        ok = host["pool"].evaluate("def f(x):\n    return x + 1\n", [{"input": [1], "output": 2}], "f")
        assert (ok.passed, ok.total) == (1, 1), ok


# Each hostile program in `programs/<name>.py`: (name, fn_name, tests, timeout_s). `WANT` is a
# secret the program must never obtain; `SHADOW` is /etc/shadow where this process may read it.
WANT = [{"input": [], "output": SECRET}]
STDIN_WANT = [{"input": "", "output": SECRET}]
SHADOW = Path("/etc/shadow").read_text() if os.access("/etc/shadow", os.R_OK) else SECRET
HOSTILE = [
    # liveness
    ("busy_loop", "f", WANT, 1.0),
    ("sleep", "f", WANT, 1.0),
    ("regex_c_loop", "f", WANT, 1.0),
    ("bigint_c_loop", "f", WANT, 1.0),
    ("ignored_signals", "f", WANT, 1.0),
    ("swallowed_timeouts", "f", WANT, 1.0),
    ("sigstop_self", "f", WANT, 1.0),
    ("stdin_mode_loop", None, STDIN_WANT, 1.0),
    # memory
    ("huge_alloc", "f", WANT, 5.0),
    ("growing_list", "f", WANT, 5.0),
    ("mmap_bomb", "f", WANT, 5.0),
    # processes
    ("fork_bomb", "f", WANT, 1.0),
    ("many_children", "f", WANT, 2.0),
    ("double_fork_daemon", "f", WANT, 2.0),
    ("escaped_session", "f", WANT, 2.0),
    # output floods and garbage
    ("stdout_flood", "f", WANT, 1.0),
    ("stderr_flood", "f", WANT, 1.0),
    ("result_pipe_flood", "f", WANT, 2.0),
    ("stdin_mode_flood", None, STDIN_WANT, 2.0),
    ("binary_garbage", None, STDIN_WANT, 2.0),
    ("returns_bytes", "f", WANT, 2.0),
    # disk and file descriptors
    ("disk_fill", "f", WANT, 3.0),
    ("big_file", "f", WANT, 3.0),
    ("fd_exhaustion", "f", WANT, 2.0),
    ("inode_exhaustion", "f", WANT, 2.0),
    # crashes
    ("segfault", "f", WANT, 2.0),
    ("abort", "f", WANT, 2.0),
    ("infinite_recursion", "f", WANT, 3.0),
    ("deep_parser", "f", WANT, 2.0),
    # files outside the temp dir
    ("write_everywhere", "f", WANT, 2.0),
    ("read_repo_file", "f", [{"input": [], "output": Path(REPO_FILE).read_text()}], 2.0),
    ("read_shadow", "f", [{"input": [], "output": SHADOW}], 2.0),
    # secrets
    ("env_secret", "f", WANT, 2.0),
    ("proc_environ", "f", WANT, 2.0),
    ("ppid_environ", "f", WANT, 2.0),
    ("home_secret_file", "f", WANT, 2.0),
    ("self_memory_scan", "f", WANT, 2.0),
    # network
    ("tcp_loopback", "f", WANT, 3.0),
    ("udp_loopback", "f", WANT, 3.0),
    ("abstract_unix_socket", "f", WANT, 3.0),
    # attacks on the parent
    ("kill_parent", "f", WANT, 2.0),
    ("stop_parent", "f", WANT, 2.0),
    ("killpg_and_kill_all", "f", WANT, 2.0),
    ("stop_every_process", "f", WANT, 2.0),
    # verdict tampering (the expected output is a secret the program cannot know)
    ("exit_zero_early", "f", WANT, 2.0),
    ("os_exit_zero", "f", WANT, 2.0),
    ("atexit_exit", "f", WANT, 2.0),
    ("excepthook_exit", "f", WANT, 2.0),
    ("fake_markers", "f", WANT, 2.0),
    ("always_equal", "f", WANT, 2.0),
    ("str_subclass", "f", WANT, 2.0),
    ("patched_builtins", "f", WANT, 2.0),
    ("frame_walk", "f", WANT, 2.0),
    ("stdin_fake_exit", None, STDIN_WANT, 2.0),
    ("true_for_one", "f", [{"input": [], "output": 1}], 2.0),
    ("nan_for_anything", "f", [{"input": [], "output": 1.5}], 2.0),
]
# (name, code, fn_name, tests, timeout_s), the host's canaries and files written into the code;
# `@HOME@`, `@TCP@`, `@UDP@` and `@TOKEN@` are left for the test that runs it.
PROGRAMS = [
    (name, program(name, CANARIES=repr(CANARIES), REPO_FILE=repr(REPO_FILE)), fn_name, tests, timeout_s)
    for name, fn_name, tests, timeout_s in HOSTILE
]
