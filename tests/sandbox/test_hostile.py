"""Hostile programs: each must score 0 and leave the host intact.

Every program is paired with expected outputs that only cheating could produce (a secret, a
value the program never computes), so a pass would mean the sandbox or the verdict leaked.
After every run we check the host: no process left running as the sandbox uid, the canary
paths outside the sandbox not created, the secret file untouched, the pool still healthy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from vapo_lightning.sandbox import Pool
from vapo_lightning.sandbox.layers import SANDBOX_UID_BASE

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


def _status(pid: int | str) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)


def _foreign_server(pid: int, ours: set[int] | None = None) -> bool:
    """Whether `pid` descends from a sandbox server that is not one of `ours` (the pool under
    test's servers), or, without `ours`, that this test process did not start (another pool
    on the same machine, e.g. a training run with CodeReward)."""
    seen = 0
    while pid > 1 and seen < 64:
        seen += 1
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                is_server = b"sandbox/server.py" in f.read()
            ppid = int(_status(pid)["PPid"])
        except (OSError, KeyError, ValueError):
            return False
        if is_server:
            return pid not in ours if ours is not None else ppid != os.getpid()
        pid = ppid
    return False


def _sandbox_processes(spare_sessions: set[int] = frozenset(), servers: set[int] | None = None) -> list[int]:
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
            fields = _status(entry)
        except OSError:
            continue
        uid = int(fields["Uid"].split()[0])
        sandbox_uid = uid == 65534 or SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + (1 << 22)
        if sandbox_uid and not fields["State"].strip().startswith("Z"):
            try:
                sid = os.getsid(int(entry))
            except OSError:
                continue  # gone meanwhile
            if sid not in spare_sessions and not _foreign_server(int(entry), servers):
                found.append(int(entry))
    return found


def pool_leftovers(pool: Pool, grace_s: float = 3.0) -> list[int]:
    """The pool's sandbox processes other than its idle spares, once none is left or after
    `grace_s` (a process SIGKILLed by another pool's server, or at a run's end, may take a
    moment to leave /proc; a leak stays)."""
    servers = {s.proc.pid for s in pool.servers}
    deadline = time.monotonic() + grace_s
    while (left := _sandbox_processes(pool.spare_sessions(), servers)) and (time.monotonic() < deadline):
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


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    secret_file = home / ".secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o644)
    os.environ["VAPO_TEST_SECRET"] = SECRET
    # A process whose environment holds the secret, for /proc/<pid>/environ attacks.
    holder = subprocess.Popen(["sleep", "600"], env={"VAPO_TEST_SECRET": SECRET})
    listener = Listener()
    pool = Pool(size=2)
    yield {
        "pool": pool,
        "home": str(home),
        "secret_file": secret_file,
        "listener": listener,
        "holder": holder.pid,
    }
    pool.close()
    listener.stop = True
    holder.kill()
    holder.wait()
    os.environ.pop("VAPO_TEST_SECRET", None)


def _assert_host_intact(host) -> None:
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


def _writes_everywhere(text: str, indent: str = "") -> str:
    body = f"""for p in {CANARIES!r} + [HOME + '/pwned', '/root/.bashrc']:
    try:
        with open(p, 'a') as fh:
            fh.write({text!r})
    except Exception:
        pass
"""
    return "".join(indent + line + "\n" for line in body.splitlines())


# (name, code, fn_name, tests, timeout_s). `WANT` is a secret the program must never obtain.
WANT = [{"input": [], "output": SECRET}]
STDIN_WANT = [{"input": "", "output": SECRET}]
PROGRAMS = [
    # liveness
    ("busy_loop", "def f():\n    while True: pass", "f", WANT, 1.0),
    ("sleep", "import time\ndef f():\n    time.sleep(100)", "f", WANT, 1.0),
    (
        "regex_c_loop",
        "import re\ndef f():\n    return re.match(r'(a+)+$', 'a'*64 + 'b')",
        "f",
        WANT,
        1.0,
    ),
    ("bigint_c_loop", "def f():\n    return 7 ** (10 ** 9) % 10", "f", WANT, 1.0),
    (
        "ignored_signals",
        "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM,"
        " signal.SIGXCPU, signal.SIGHUP):\n    signal.signal(s, signal.SIG_IGN)\n"
        "def f():\n    while True: pass",
        "f",
        WANT,
        1.0,
    ),
    (
        "swallowed_timeouts",
        "import time\ndef f():\n    while True:\n        try:\n"
        "            time.sleep(10)\n        except BaseException:\n            pass",
        "f",
        WANT,
        1.0,
    ),
    (
        "sigstop_self",
        "import os, signal\ndef f():\n    os.kill(os.getpid(), signal.SIGSTOP)\n    return 0",
        "f",
        WANT,
        1.0,
    ),
    ("stdin_mode_loop", "while True:\n    pass", None, STDIN_WANT, 1.0),
    # memory
    ("huge_alloc", "def f():\n    x = bytearray(10 ** 11)\n    return len(x)", "f", WANT, 5.0),
    (
        "growing_list",
        "def f():\n    l = []\n    while True:\n        l.append(' ' * 10 ** 7)",
        "f",
        WANT,
        5.0,
    ),
    (
        "mmap_bomb",
        "import mmap\ndef f():\n    m = mmap.mmap(-1, 1 << 36)\n    return len(m)",
        "f",
        WANT,
        5.0,
    ),
    # processes
    (
        "fork_bomb",
        "import os\ndef f():\n    while True:\n        try: os.fork()\n        except OSError: pass",
        "f",
        WANT,
        1.0,
    ),
    (
        "many_children",
        "import subprocess\ndef f():\n    ps = [subprocess.Popen(['sleep', '60'])"
        " for _ in range(100)]\n    return len(ps)",
        "f",
        WANT,
        2.0,
    ),
    (
        "double_fork_daemon",
        "import os, time\nHOME = @HOME@\ndef f():\n    if os.fork() == 0:\n"
        "        os.setsid()\n        if os.fork() == 0:\n            time.sleep(0.5)\n"
        + _writes_everywhere("daemon", " " * 12)
        + "            time.sleep(600)\n"
        "        os._exit(0)\n    return 0",
        "f",
        WANT,
        2.0,
    ),
    (
        "escaped_session",
        "import subprocess\ndef f():\n    subprocess.Popen(['sleep', '600'], start_new_session=True)\n    return 0",
        "f",
        WANT,
        2.0,
    ),
    # output floods and garbage
    ("stdout_flood", "def f():\n    while True: print('x' * 10 ** 6)", "f", WANT, 1.0),
    (
        "stderr_flood",
        "import sys\ndef f():\n    while True: sys.stderr.write('x' * 10 ** 6)",
        "f",
        WANT,
        1.0,
    ),
    (
        "result_pipe_flood",
        "import os\ndef f():\n    while True:\n        for fd in range(3, 30):\n"
        "            try: os.write(fd, b'0 R 1\\n' * 10 ** 5)\n            except OSError: pass",
        "f",
        WANT,
        2.0,
    ),
    (
        "stdin_mode_flood",
        "import sys\nwhile True: sys.stdout.write('y' * 10 ** 6)",
        None,
        STDIN_WANT,
        2.0,
    ),
    (
        "binary_garbage",
        "import os, sys\nsys.stdout.buffer.write(os.urandom(1 << 16))",
        None,
        STDIN_WANT,
        2.0,
    ),
    ("returns_bytes", "def f():\n    return b'\\xff\\x00' * 100", "f", WANT, 2.0),
    # disk and file descriptors
    (
        "disk_fill",
        "def f():\n    i = 0\n    while True:\n        with open(f'fill{i}', 'wb') as fh:\n"
        "            fh.write(b'0' * (15 << 20))\n        i += 1",
        "f",
        WANT,
        3.0,
    ),
    (
        "big_file",
        "def f():\n    with open('big', 'wb') as fh:\n        while True:\n            fh.write(b'0' * (1 << 20))",
        "f",
        WANT,
        3.0,
    ),
    (
        "fd_exhaustion",
        "def f():\n    fs = []\n    while True: fs.append(open('/dev/null'))",
        "f",
        WANT,
        2.0,
    ),
    (
        "inode_exhaustion",
        "def f():\n    i = 0\n    while True:\n        open(f'n{i}', 'w').close()\n        i += 1",
        "f",
        WANT,
        2.0,
    ),
    # crashes
    ("segfault", "import ctypes\ndef f():\n    return ctypes.string_at(0)", "f", WANT, 2.0),
    ("abort", "import os\ndef f():\n    os.abort()", "f", WANT, 2.0),
    (
        "infinite_recursion",
        "import sys\nsys.setrecursionlimit(10 ** 9)\ndef f(n=0):\n    return f(n + 1)",
        "f",
        WANT,
        3.0,
    ),
    ("deep_parser", "def f():\n    return eval('(' * 10 ** 6 + ')' * 10 ** 6)", "f", WANT, 2.0),
    # files outside the temp dir
    (
        "write_everywhere",
        "HOME = @HOME@\n" + _writes_everywhere("pwned") + "def f():\n    return 0",
        "f",
        WANT,
        2.0,
    ),
    (
        "read_repo_file",
        f"def f():\n    return open({REPO_FILE!r}).read()",
        "f",
        [{"input": [], "output": Path(REPO_FILE).read_text()}],
        2.0,
    ),
    (
        "read_shadow",
        "def f():\n    return open('/etc/shadow').read()",
        "f",
        [
            {
                "input": [],
                "output": Path("/etc/shadow").read_text() if os.access("/etc/shadow", os.R_OK) else SECRET,
            }
        ],
        2.0,
    ),
    # secrets
    (
        "env_secret",
        "import os\ndef f():\n    return os.environ.get('VAPO_TEST_SECRET', 'none')",
        "f",
        WANT,
        2.0,
    ),
    (
        "proc_environ",
        "import os\ndef f():\n    for p in os.listdir('/proc'):\n        try:\n"
        "            for kv in open(f'/proc/{p}/environ', 'rb').read().split(b'\\0'):\n"
        "                if kv.startswith(b'VAPO_TEST_SECRET='): return kv[17:].decode()\n"
        "        except Exception: pass\n    return 'none'",
        "f",
        WANT,
        2.0,
    ),
    (
        "ppid_environ",
        "import os\ndef f():\n    d = open(f'/proc/{os.getppid()}/environ', 'rb').read()\n    return d.decode()",
        "f",
        WANT,
        2.0,
    ),
    ("home_secret_file", "def f():\n    return open(@HOME@ + '/.secret').read()", "f", WANT, 2.0),
    (
        "self_memory_scan",
        "def f():\n    import gc\n    for o in gc.get_objects():\n"
        "        if isinstance(o, str) and o.startswith('s3cret-'): return o\n"
        "    return open('/proc/self/environ', 'rb').read().decode()",
        "f",
        WANT,
        2.0,
    ),
    # network
    (
        "tcp_loopback",
        "import socket\ndef f():\n    s = socket.create_connection(('127.0.0.1', @TCP@),"
        " timeout=1)\n    s.sendall(b'x')\n    return 'connected'",
        "f",
        WANT,
        3.0,
    ),
    (
        "udp_loopback",
        "import socket\ndef f():\n    s = socket.socket(socket.AF_INET, "
        "socket.SOCK_DGRAM)\n    s.sendto(b'x', ('127.0.0.1', @UDP@))\n    return 'sent'",
        "f",
        WANT,
        3.0,
    ),
    (
        "abstract_unix_socket",
        "import socket\ndef f():\n    s = socket.socket(socket.AF_UNIX)\n"
        "    s.connect('\\0vapo-test-@TOKEN@')\n    return 'connected'",
        "f",
        WANT,
        3.0,
    ),
    # attacks on the parent
    (
        "kill_parent",
        "import os\ndef f():\n    os.kill(os.getppid(), 9)\n    return 0",
        "f",
        WANT,
        2.0,
    ),
    (
        "stop_parent",
        "import os\ndef f():\n    os.kill(os.getppid(), 19)\n    return 0",
        "f",
        WANT,
        2.0,
    ),
    (
        "killpg_and_kill_all",
        "import os\ndef f():\n    try: os.kill(-1, 9)\n    except OSError: pass\n    os.killpg(0, 9)",
        "f",
        WANT,
        2.0,
    ),
    (
        "stop_every_process",
        "import os\ndef f():\n    for p in os.listdir('/proc'):\n"
        "        if p.isdigit() and int(p) != os.getpid():\n"
        "            try: os.kill(int(p), 19)\n            except OSError: pass\n    return 0",
        "f",
        WANT,
        2.0,
    ),
    # verdict tampering (the expected output is a secret the program cannot know)
    ("exit_zero_early", "import sys\nsys.exit(0)\ndef f():\n    return 0", "f", WANT, 2.0),
    ("os_exit_zero", "import os\ndef f():\n    os._exit(0)", "f", WANT, 2.0),
    (
        "atexit_exit",
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef f():\n    raise SystemExit(0)",
        "f",
        WANT,
        2.0,
    ),
    (
        "excepthook_exit",
        "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\ndef f():\n    raise ValueError",
        "f",
        WANT,
        2.0,
    ),
    (
        "fake_markers",
        "def f():\n    print('0 R \"ok\"')\n    print('PASSED all tests')\n    return 'ok'",
        "f",
        WANT,
        2.0,
    ),
    (
        "always_equal",
        "class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o):"
        " return False\ndef f():\n    return A()",
        "f",
        WANT,
        2.0,
    ),
    (
        "str_subclass",
        "class S(str):\n    def __eq__(self, o): return True\ndef f():\n    return S('x')",
        "f",
        WANT,
        2.0,
    ),
    (
        "patched_builtins",
        "import builtins, json\nbuiltins.type = lambda *a: str\n"
        "json.dumps = lambda *a, **k: '\"yes\"'\ndef f():\n    return 'no'",
        "f",
        WANT,
        2.0,
    ),
    (
        "frame_walk",
        "import sys\ndef f():\n    fr = sys._getframe()\n    while fr:\n"
        "        for v in list(fr.f_locals.values()) + list(fr.f_globals.values()):\n"
        "            if isinstance(v, str) and 's3cret' in v: return v\n        fr = fr.f_back\n"
        "    return 'x'",
        "f",
        WANT,
        2.0,
    ),
    ("stdin_fake_exit", "import os\nos.write(1, b'PASS\\n')\nos._exit(0)", None, STDIN_WANT, 2.0),
    ("true_for_one", "def f():\n    return True", "f", [{"input": [], "output": 1}], 2.0),
    (
        "nan_for_anything",
        "def f():\n    return float('nan')",
        "f",
        [{"input": [], "output": 1.5}],
        2.0,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,code,fn_name,tests,timeout_s", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_hostile_program_scores_zero(host, name, code, fn_name, tests, timeout_s):
    lst = host["listener"]
    for key, value in (
        ("@HOME@", repr(host["home"])),
        ("@TCP@", str(lst.tcp.getsockname()[1])),
        ("@UDP@", str(lst.udp.getsockname()[1])),
        ("@TOKEN@", TOKEN),
    ):
        code = code.replace(key, value)
    result = host["pool"].evaluate(code, tests, fn_name, timeout_s=timeout_s)
    assert result.total == len(tests)
    assert result.passed == 0, result
    assert "uid_drop" in result.layers or os.geteuid() != 0
    _assert_host_intact(host)


def test_there_are_at_least_40_hostile_programs():
    assert len(PROGRAMS) >= 40
    assert len({p[0] for p in PROGRAMS}) == len(PROGRAMS)


def test_escaped_pipe_holder_does_not_hold_up_the_run(host):
    code = (
        "import os, time\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n"
        "        time.sleep(600)\n    return 1\n"
    )
    result = host["pool"].evaluate(code, [{"input": [], "output": 1}], "f", timeout_s=20)
    assert (result.passed, result.status) == (1, "ok"), result
    _assert_host_intact(host)


# add_key / keyctl syscall numbers (the stdlib has no keyring API)
KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)


@pytest.mark.skipif(KEY_SYSCALLS is None, reason="add_key/keyctl numbers unknown here")
@pytest.mark.parametrize("seccomp", [True, False], ids=["no_sockets", "sockets_allowed"])
def test_no_kernel_state_crosses_runs(host, seccomp):
    """State kept by the kernel per namespace or per user, not per process: network counters
    (/proc/net/snmp counts datagrams with no route) and the uid's user keyring. Each run has a
    user namespace of its own, and a network namespace that either is its own (sockets allowed)
    or that no run can write to (`no_sockets`: a server's runs share it, and the filter refuses
    the keyring syscalls too), so the next run (and a fresh pool) sees neither."""
    add_key, keyctl = KEY_SYSCALLS
    writer = (
        "import ctypes, socket\ndef f():\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    except PermissionError:\n"
        "        s = None\n"
        "    for _ in range(37 if s else 0):\n"
        "        try: s.sendto(b'x', ('127.0.0.1', 9))\n"
        "        except OSError: pass\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        f"    key = libc.syscall({add_key}, b'user', b'vapo-leak', b'run-1', 5, -4)\n"
        "    return ['sent' if s else 'refused', 'written' if key > 0 else 'no key']\n"
    )
    probe = (
        "def probe():\n"
        "    ip = [line.split() for line in open('/proc/net/snmp') if line.startswith('Ip:')]\n"
        "    no_route = dict(zip(*ip))['OutNoRoutes']\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        f"    found = libc.syscall({keyctl}, 10, ctypes.c_long(-4), b'user', b'vapo-leak', 0)\n"
        "    return [no_route, found > 0]\n"
    )
    reader = "import ctypes\n" + probe + "def f():\n    return probe()\n"
    pool = host["pool"] if seccomp else Pool(size=1, seccomp=False)
    fresh = Pool(size=1, seccomp=seccomp)
    try:
        no_sockets = "no_sockets" in pool.layers
        assert no_sockets == (seccomp and "no_sockets" in fresh.layers)
        wrote = ["refused", "no key"] if no_sockets else ["sent", "written"]
        result = pool.evaluate(writer, [{"input": [], "output": wrote}], "f")
        assert result.passed == 1, result
        # The check can fail: within the writer's own run, both are seen (with `no_sockets`
        # neither can be written: the sockets_allowed case is the one that shows it).
        both = writer + probe + "def h():\n    f()\n    return probe()\n"
        counted = ["0", False] if no_sockets else ["37", True]
        seen = pool.evaluate(both, [{"input": [], "output": counted}], "h")
        assert seen.passed == 1, seen
        for p in (pool, pool, pool, fresh):  # whichever server of the pool runs it, or another
            result = p.evaluate(reader, [{"input": [], "output": ["0", False]}], "f")
            assert result.passed == 1, result
    finally:
        fresh.close()
        if not seccomp:
            pool.close()
    _assert_host_intact(host)


def test_no_sockets_refuses_what_could_mark_a_shared_network_namespace(host):
    """The seccomp filter (`seccomp_filter.sandbox_filter`): no socket but AF_UNIX ones, no
    io_uring, no keyrings; a Unix socket works but reaches nothing of the host (the host's
    abstract name is in another network namespace), and so do a socketpair and descriptor
    passing on it. A syscall of another ABI (x32 here) kills the process."""
    pool = host["pool"]
    if "no_sockets" not in pool.layers or KEY_SYSCALLS is None:
        pytest.skip("no seccomp filter on this machine")
    code = (
        "import ctypes, errno, socket\n"
        "def attempt(fn):\n"
        "    try:\n"
        "        fn()\n"
        "        return 'ok'\n"
        "    except OSError as e:\n"
        "        return errno.errorcode.get(e.errno, str(e.errno))\n"
        "def f():\n"
        "    a, b = socket.socketpair()\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    def io_uring():\n"
        "        if libc.syscall(425, 8, None) < 0:\n"
        "            raise OSError(ctypes.get_errno(), 'io_uring_setup')\n"
        "    def add_key():\n"
        f"        if libc.syscall({KEY_SYSCALLS[0]}, b'user', b'k', b'v', 1, -4) < 0:\n"
        "            raise OSError(ctypes.get_errno(), 'add_key')\n"
        "    return {\n"
        "        'inet': attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),\n"
        "        'netlink': attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)),\n"
        "        'pair_inet': attempt(lambda: socket.socketpair(socket.AF_INET)),\n"
        "        'host_unix': attempt(lambda: socket.socket(socket.AF_UNIX).connect(\n"
        "            '\\0vapo-test-@TOKEN@')),\n"
        "        'send_fds': attempt(lambda: socket.send_fds(a, [b'x'], [0])),\n"
        "        'io_uring': attempt(io_uring),\n"
        "        'add_key': attempt(add_key),\n"
        "        'pair': attempt(lambda: a.send(b'x') == 1 and b.recv(1) == b'x' or 1 / 0),\n"
        "    }\n"
    )
    refused = ("inet", "netlink", "pair_inet", "io_uring", "add_key")
    want = dict.fromkeys(refused, "EPERM") | {
        "host_unix": "ECONNREFUSED",
        "send_fds": "ok",
        "pair": "ok",
    }
    code = code.replace("@TOKEN@", TOKEN)
    result = pool.evaluate(code, [{"input": [], "output": want}], "f")
    assert result.passed == 1, result
    if os.uname().machine == "x86_64":  # x32 socket(): the filter's numbers would not match
        x32 = "import ctypes\ndef f():\n    ctypes.CDLL(None).syscall(0x40000000 | 41, 2, 2, 0)\n    return 1\n"
        result = pool.evaluate(x32, [{"input": [], "output": 1}], "f")
        assert (result.passed, result.status) == (0, "crashed"), result
    _assert_host_intact(host)


def test_closing_a_pool_leaves_none_of_its_processes():
    """The server's children (spares, and the mount-namespace holder of a root server) all end
    with it, and none of them keeps the host's pipes open."""
    pool = Pool(size=1)
    server = pool.servers[0].proc
    pool.evaluate("def f():\n    return 1\n", [{"input": [], "output": 1}], "f")
    children = [
        int(pid)
        for tid in os.listdir(f"/proc/{server.pid}/task")
        for pid in Path(f"/proc/{server.pid}/task/{tid}/children").read_text().split()
    ]
    assert children  # the spares at least

    def host_pipes() -> list[tuple[int, str, str]]:
        held = [(p, fd, os.readlink(f"/proc/{p}/fd/{fd}")) for p in children for fd in "01"]
        return [h for h in held if h[2].startswith("pipe:")]

    # Only the server may hold the pipes to the host (a spare forked after the run lets go
    # of them within its first steps: waited for, up to 5 s).
    deadline = time.monotonic() + 5
    while host_pipes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host_pipes() == []
    pool.close()
    assert server.returncode is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in children):
        time.sleep(0.01)
    assert not [p for p in children if os.path.exists(f"/proc/{p}")]


def test_many_idle_sandboxes_do_not_starve_a_run():
    """RLIMIT_NPROC (32 processes) counts per user namespace: 40 idle sandboxes forked ahead,
    all of one uid, leave a run its whole allowance (stdin mode forks one child per test)."""
    pool = Pool(size=1, spares=40)
    try:
        result = pool.evaluate("print(input())", [{"input": "x", "output": "x"}] * 3)
        assert (result.passed, result.status) == (3, "ok"), result
        assert "userns" in result.layers or os.geteuid() != 0 or "pidns" not in result.layers
    finally:
        pool.close()


@pytest.mark.parametrize("seccomp", [True, False], ids=["no_sockets", "sockets_allowed"])
def test_no_cross_run_leakage(host, seccomp):
    """Files, SysV shared memory, and sockets held by a daemon (a UDP port and an abstract
    Unix name, where sockets are allowed: they live in the run's network namespace) are all
    gone for the next run."""
    pool = host["pool"] if seccomp else Pool(size=2, seccomp=False)
    try:
        _no_cross_run_leakage(pool)
    finally:
        if not seccomp:
            pool.close()
    _assert_host_intact(host)


def _no_cross_run_leakage(pool) -> None:
    writer = (
        "import ctypes, os, socket, time\n"
        "def f():\n    open('/tmp/leak', 'w').write('L')\n"
        "    if ctypes.CDLL(None).shmget(4567, 4096, 0o1666) < 0: return 'no shm'\n"
        "    open('/dev/shm/leak', 'w').write('L')\n    open('leak', 'w').write('L')\n"
        "    r, w = os.pipe()\n"
        "    if os.fork() == 0:\n        os.setsid()\n"
        "        try:\n"
        "            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "            u.bind(('0.0.0.0', 45678))\n"
        "            a = socket.socket(socket.AF_UNIX)\n            a.bind('\\0vapo-leak')\n"
        "            a.listen()\n"
        "        except PermissionError:  # no_sockets: nothing to hold\n"
        "            pass\n"
        "        os.write(w, b'k')\n        time.sleep(600)\n"
        "    os.read(r, 1)\n"
        "    return 'written'\n"
    )
    assert pool.evaluate(writer, [{"input": [], "output": "written"}], "f").passed == 1
    reader = (
        "import ctypes, os, socket\n"
        "def f():\n    for p in ('/tmp/leak', '/dev/shm/leak', 'leak'):\n"
        "        if os.path.exists(p): return 'L'\n"
        "    if ctypes.CDLL(None).shmget(4567, 0, 0) >= 0: return 'L'\n"
        "    try:\n"
        "        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "        a = socket.socket(socket.AF_UNIX)\n"
        "    except PermissionError:  # no_sockets: nothing could have been held either\n"
        "        return 'clean'\n"
        "    u.bind(('0.0.0.0', 45678))\n"
        "    try:\n        a.connect('\\0vapo-leak')\n        return 'L'\n"
        "    except OSError:\n        pass\n"
        "    a.bind('\\0vapo-leak')\n"
        "    return 'clean'\n"
    )
    for _ in range(3):  # whichever server of the pool runs it
        result = pool.evaluate(reader, [{"input": [], "output": "clean"}], "f")
        assert result.passed == 1, result


# pidfd_getfd and ptrace syscall numbers
TRACE_SYSCALLS = {"x86_64": (438, 101), "aarch64": (438, 117)}.get(os.uname().machine)

FORGE_THROUGH_THE_RUNNER = """
import ctypes, os, stat
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(os.getppid())  # the runner, which holds the result pipe
for fd in range(3, 64):
    got = libc.syscall(@GETFD@, pidfd, fd, 0)
    if got >= 0 and stat.S_ISFIFO(os.fstat(got).st_mode):
        try:
            os.write(got, b'0 O 0 "forged"\\n')
        except OSError:
            pass
raise SystemExit(1)
"""


@pytest.mark.skipif(TRACE_SYSCALLS is None, reason="syscall numbers unknown here")
def test_the_program_cannot_reach_into_the_runner(host):
    """Stdin mode: the program is a child of the runner, which holds the result pipe. Taking
    that pipe (pidfd_getfd) would let it write a frame of its own choosing (here: exit status 0
    and the expected output, although it exits 1); ptrace-attaching would do the same."""
    getfd, ptrace = TRACE_SYSCALLS
    code = FORGE_THROUGH_THE_RUNNER.replace("@GETFD@", str(getfd))
    result = host["pool"].evaluate(code, [{"input": "", "output": "forged"}])
    assert (result.passed, result.errors) == (0, ["exit 1"]), result
    attach = (
        "import ctypes, os\n"
        f"r = ctypes.CDLL(None, use_errno=True).syscall({ptrace}, 16, os.getppid(), 0, 0)\n"
        "print('attached' if r == 0 else 'refused')\n"
    )
    result = host["pool"].evaluate(attach, [{"input": "", "output": "refused"}])
    assert result.passed == 1, result
    _assert_host_intact(host)


def test_no_process_of_a_run_is_dumpable(host):
    """A crashing candidate must not start a piped core_pattern helper (apport,
    systemd-coredump), which runs in the host's namespaces: the program's process is not
    dumpable and cannot make itself so; a child that execs (dumpable again) has RLIMIT_CORE 1,
    at which the kernel skips core dumps, piped ones included."""
    code = (
        "import ctypes, resource, subprocess, sys\n"
        "def f():\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    before = libc.prctl(3, 0, 0, 0, 0)\n"  # PR_GET_DUMPABLE
        "    libc.prctl(4, 1, 0, 0, 0)\n"  # PR_SET_DUMPABLE, 1
        "    after = libc.prctl(3, 0, 0, 0, 0)\n"
        "    child = subprocess.run([sys.executable, '-c', 'import resource; print("
        "resource.getrlimit(resource.RLIMIT_CORE))'], capture_output=True, text=True)\n"
        "    return [before, after, child.stdout.strip()]\n"
    )
    result = host["pool"].evaluate(code, [{"input": [], "output": [0, 0, "(1, 1)"]}], "f")
    assert result.passed == 1, result
    _assert_host_intact(host)


def _scanner(halves: list[tuple[str, str]]) -> str:
    """A program that looks for each `a + b` in all of its readable memory without ever
    building that string itself (it finds `a`, then compares what follows with `b`)."""
    return (
        "import ctypes\n"
        f"HALVES = {[(a.encode(), b.encode()) for a, b in halves]!r}\n"
        "def f():\n"
        "    found = set()\n"
        "    with open('/proc/self/maps') as fh:\n"
        "        maps = fh.read().splitlines()\n"
        "    for line in maps:\n"
        "        fields = line.split()\n"
        "        name = fields[5] if len(fields) > 5 else ''\n"
        "        if fields[1][0] != 'r' or name in ('[vvar]', '[vvar_vclock]', '[vsyscall]'):\n"
        "            continue\n"
        "        if name and not name.startswith('['):\n"
        "            continue  # files: the interpreter and libraries, never a request\n"
        "        lo, hi = (int(x, 16) for x in fields[0].split('-'))\n"
        "        mem = ctypes.string_at(lo, hi - lo)\n"
        "        for a, b in HALVES:\n"
        "            i = mem.find(a)\n"
        "            while i >= 0:\n"
        "                if mem[i + len(a) : i + len(a) + len(b)] == b:\n"
        "                    found.add(a.decode())\n"
        "                i = mem.find(a, i + 1)\n"
        "    return sorted(found)\n"
    )


def test_no_byte_of_an_earlier_request_is_in_a_later_run():
    """A sandbox forked after earlier requests were handled would inherit them (objects still
    referenced, freed memory never overwritten) and could copy a sibling sample's code and
    inputs. Every later run's whole address space is searched for the earlier request's code
    and inputs, over more runs than there are spares forked ahead."""
    code_mark = ("vapo-code-" + secrets.token_hex(6), secrets.token_hex(6))
    input_mark = ("vapo-input-" + secrets.token_hex(6), secrets.token_hex(6))
    pool = Pool(size=1, spares=2)
    try:
        earlier = f"MARK = {''.join(code_mark)!r}\ndef f(x):\n    return len(x)\n"
        given = "".join(input_mark)
        tests = [{"input": [given], "output": len(given)}] * 3
        assert pool.evaluate(earlier, tests, "f").passed == 3
        scanner = _scanner([code_mark, input_mark])
        # The check can fail: within the run that holds them, both are found.
        both = scanner + f"HELD = {''.join(code_mark)!r}\ndef g(x):\n    return f()\n"
        want = sorted([code_mark[0], input_mark[0]])
        held = pool.evaluate(both, [{"input": [given], "output": want}], "g")
        assert held.passed == 1, held
        for _ in range(4):
            later = pool.evaluate(scanner, [{"input": [], "output": []}], "f")
            assert later.passed == 1, later
    finally:
        pool.close()


def test_concurrent_runs_share_no_per_user_limit():
    """Two runs at once, on two servers: one fills its user's pipe-buffer allowance
    (fs.pipe-user-pages-soft, 64 MiB by default), which with a shared uid would leave the
    other unable to size a pipe (F_SETPIPE_SZ: EPERM). Each server's sandboxes have a uid of
    their own."""
    hog = (
        "import fcntl, os, time\n"
        "def f():\n"
        "    held = []\n"
        "    while True:\n"
        "        r, w = os.pipe()\n"
        "        os.close(r)\n"
        "        try:\n"
        "            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)\n"
        "        except OSError:\n"
        "            break\n"
        "        held.append(w)\n"
        "    time.sleep(4)\n"
        "    return len(held) > 10\n"
    )
    sized = (
        "import fcntl, os\n"
        "def f():\n"
        "    r, w = os.pipe()\n"
        "    try:\n"
        "        return fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)\n"
        "    except OSError as err:\n"
        "        return str(err)\n"
    )
    pool = Pool(size=2)
    try:
        assert pool.servers[0].uid != pool.servers[1].uid or os.geteuid() != 0
        results = {}
        first = threading.Thread(
            target=lambda: results.update(hog=pool.evaluate(hog, [{"input": [], "output": True}], "f"))
        )
        first.start()
        time.sleep(1.0)  # the hog holds its pipes for 4 s
        results["sized"] = pool.evaluate(sized, [{"input": [], "output": 1 << 20}], "f")
        first.join()
        assert results["hog"].passed == 1, results["hog"]
        assert results["sized"].passed == 1 or os.geteuid() != 0, results["sized"]
    finally:
        pool.close()
