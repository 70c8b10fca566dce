"""What one run could learn of, or do to, another run or the host beyond its own end: file
watches and locks on the files all runs share, a sandbox outliving its server, a run's CPU
share under a concurrent one's load."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vapo_lightning.sandbox import Pool
from vapo_lightning.sandbox.cgroups import V1_CPU_SHARES

STDLIB = os.path.dirname(os.__file__)

# What a program's call returned: "ok", or the errno's name.
ATTEMPT = """
import errno
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
"""

# dnotify on a directory every run imports from, flock on a file every run reads; a POSIX
# record lock on the run's own file (sqlite3 takes those) still works.
WATCH_AND_LOCK = f"""{ATTEMPT}
import fcntl, os
def f():
    d = os.open({STDLIB!r}, os.O_RDONLY)
    shared = os.open({os.__file__!r}, os.O_RDONLY)
    own = os.open("lockfile", os.O_RDWR | os.O_CREAT)
    return {{
        "dnotify": attempt(lambda: fcntl.fcntl(d, fcntl.F_NOTIFY, fcntl.DN_ACCESS)),
        "flock": attempt(lambda: fcntl.flock(shared, fcntl.LOCK_SH | fcntl.LOCK_NB)),
        "lockf": attempt(lambda: fcntl.lockf(own, fcntl.LOCK_EX | fcntl.LOCK_NB)),
        "getfl": attempt(lambda: fcntl.fcntl(own, fcntl.F_GETFL)),
    }}
"""


@pytest.fixture(scope="module")
def pool():
    pool = Pool(size=2)
    yield pool
    pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux's")
def test_no_directory_watch_or_flock_on_shared_files(pool):
    if "no_fs_watch" not in pool.layers:
        pytest.skip("no seccomp filter on this machine")
    want = {"dnotify": "EPERM", "flock": "EPERM", "lockf": "ok", "getfl": "ok"}
    r = pool.evaluate(WATCH_AND_LOCK, [{"input": [], "output": want}], "f")
    assert r.passed == 1, r


# Clears its parent-death signal (which the filter refuses), names itself for the test to
# find, then outlives the request's timeout unless killed.
ORPHAN = """
import ctypes, time
def f(name):
    libc = ctypes.CDLL(None, use_errno=True)
    cleared = libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG, 0
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
    time.sleep(120)
    return cleared
"""


def _named(name: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == name:
                found.append(int(pid))
    return found


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_sandbox_dies_with_its_server_and_a_new_server_clears_its_cgroups():
    name = f"vapo{secrets.token_hex(5)}"  # 14 bytes: comm holds 15
    pool = Pool(size=1)
    server = pool.servers[0].proc
    if "dies_with_server" not in pool.layers:
        pool.close()
        pytest.skip("no seccomp filter on this machine")
    runner = threading.Thread(
        target=_quiet,
        args=(pool.evaluate, ORPHAN, [{"input": [name], "output": 0}], "f", 300.0),
        daemon=True,
    )
    runner.start()
    try:
        assert _wait_for(lambda: bool(_named(name))), "the program never started"
        folders = _server_folders(server.pid)
        server.kill()
        server.wait()
        assert _wait_for(lambda: not _named(name)), "the sandbox outlived its server"
    finally:
        for pid in _named(name):
            os.kill(pid, 9)
        pool.servers[0].proc.stdout.close()
    if folders:  # cgroups: the dead server's folders stay until a new server starts
        assert all(os.path.isdir(d) for d in folders)
        Pool(size=1, spares=1).close()
        assert not any(os.path.exists(d) for d in folders), folders


def _quiet(fn, *args):
    with contextlib.suppress(RuntimeError, OSError, ValueError):  # the server was killed
        fn(*args)


def _server_folders(pid: int) -> list[str]:
    """The cgroup folders of the server `pid` (none without per-run cgroups)."""
    root = "/sys/fs/cgroup"
    with open(f"/proc/{pid}/cgroup") as f:
        own = dict(line.split(":", 2)[1:] for line in f.read().splitlines())
    tag, found = f"vapo-sandbox-{pid}", []
    for c in ("memory", "pids", "cpu"):
        if c in own:
            path = f"{root}/{c}{own[c].rstrip('/')}"  # (the server is in its cpu folder)
            path = path if path.endswith("/" + tag) else f"{path}/{tag}"
            found += [path] if os.path.isdir(path) else []
    return found


# 30 busy processes, each in a session of its own; prints the CPU ticks they got together
# over the window (from /proc: the run's own PID namespace).
HOG = """
import os, time
kids = []
for _ in range(30):
    pid = os.fork()
    if pid == 0:
        os.setsid()
        while True:
            pass
    kids.append(pid)
def ticks():
    total = 0
    for pid in kids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total
time.sleep(0.5)
start = ticks()
time.sleep(@WINDOW@)
print(ticks() - start)
"""

# One busy process; prints the CPU ticks it got over the same window.
HONEST = """
import os, time
time.sleep(0.5)
start, end = os.times(), time.monotonic() + @WINDOW@
while time.monotonic() < end:
    pass
now = os.times()
print(round((now.user + now.system - start.user - start.system) * os.sysconf("SC_CLK_TCK")))
"""


def test_a_run_keeps_its_cpu_share_beside_a_run_of_30_busy_processes():
    """Each run has a cpu cgroup of its own, of equal weight: the honest run's CPU time over
    the window is a fair share of what both runs got (about half; without per-run cgroups,
    about 1/31). Relative CPU time only: no wall-clock threshold."""
    if os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpu"):
        pytest.skip("per-run cpu cgroups need root and the cgroup v1 cpu hierarchy")
    pool = Pool(size=2)
    try:
        assert "cpu_cgroup" in pool.layers, pool.layers
        _assert_cpu_cgroups_configured(pool)
        window = "2.0"
        with ThreadPoolExecutor(2) as ex:
            hog = ex.submit(pool.execute, HOG.replace("@WINDOW@", window), 30.0)
            honest = ex.submit(pool.execute, HONEST.replace("@WINDOW@", window), 30.0)
            hog, honest = hog.result(), honest.result()
    finally:
        pool.close()
    assert hog.status == honest.status == "ok", (hog, honest)
    hog_ticks, honest_ticks = int(hog.stdout), int(honest.stdout)
    share = honest_ticks / (honest_ticks + hog_ticks)
    print(f"honest {honest_ticks} ticks, hog {hog_ticks} ticks: share {share:.2f}")
    assert share > 0.25, (honest_ticks, hog_ticks)


def _assert_cpu_cgroups_configured(pool: Pool) -> None:
    """Each server and everything it forks (the idle spares) are in a cpu cgroup of the
    server's own, at the set weight: a server runs one run at a time."""
    spares = pool.spare_sessions()
    for server in pool.servers:
        folder = next(f for f in _server_folders(server.proc.pid) if "/cpu/" in f)
        with open(f"{folder}/cpu.shares") as f:
            assert int(f.read()) == V1_CPU_SHARES
        with open(f"{folder}/cgroup.procs") as f:
            members = {int(p) for p in f.read().split()}
        assert server.proc.pid in members
        assert spares & members, "a spare is in its server's cpu cgroup"


# Connects to a host stream socket and sends to a host datagram socket, both by path.
HOST_SOCKETS = f"""{ATTEMPT}
import socket
def f(stream, dgram):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    found = [attempt(lambda: s.connect(stream)), attempt(lambda: d.sendto(b"x", dgram))]
    # and up from any folder held open, back into the host's tree
    import os
    for fd in os.listdir("/proc/self/fd"):
        up = f"/proc/self/fd/{{fd}}/" + "../" * 16 + stream.lstrip("/")
        if attempt(lambda: socket.socket(socket.AF_UNIX).connect(up)) == "ok":
            found.append("reached through fd " + fd)
    return found
"""


@pytest.mark.parametrize("via_userns", [False, True])
def test_no_host_unix_socket_is_reachable_by_path(tmp_path_factory, via_userns):
    """World-writable Unix sockets of the host (here below /var/tmp; on a training node
    D-Bus, /dev/log, a database's) are not in the run's file system view."""
    if os.geteuid() != 0 and via_userns:
        pytest.skip("the user-namespace path of a root server")
    folder = tmp_path_factory.mktemp("sockets", numbered=True)
    if os.path.isdir("/var/tmp"):
        folder = Path(tempfile.mkdtemp(prefix="vapo-sockets-", dir="/var/tmp"))
    os.chmod(folder, 0o777)
    stream_path, dgram_path = str(folder / "stream.sock"), str(folder / "dgram.sock")
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.bind(stream_path)
    stream.listen(4)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(dgram_path)
    for p in (stream_path, dgram_path):
        os.chmod(p, 0o777)
    stream.setblocking(False)
    dgram.setblocking(False)
    pool = Pool(size=1, via_userns=via_userns)
    try:
        assert "minimal_root" in pool.layers, pool.layers
        test = {"input": [stream_path, dgram_path], "output": ["ENOENT", "ENOENT"]}
        r = pool.evaluate(HOST_SOCKETS, [test], "f")
        assert r.passed == 1, r
        with pytest.raises(BlockingIOError):
            stream.accept()
        with pytest.raises(BlockingIOError):
            dgram.recv(10)
    finally:
        pool.close()
        stream.close()
        dgram.close()
        shutil.rmtree(folder, ignore_errors=True)


# A colluding pair on two servers: the sender marks what every run could see (an OFD lock on
# its own file at a secret offset, the times of /dev/null, the host's task, file and memory
# counters); the receiver, running meanwhile, reports which of the marks it saw.
SENDER = """
import fcntl, os, struct, threading, time
def send(secret, seconds):
    own = os.open("own", os.O_RDWR | os.O_CREAT)
    lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, secret, 1, 0)
    fcntl.fcntl(own, fcntl.F_OFD_SETLK, lock)
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(40)]
    for t in threads:
        t.start()
    files = [os.open("own", os.O_RDONLY) for _ in range(60)]
    memory = bytearray(64 << 20)
    touched = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.utime("/dev/null")
            touched.add("ok")
        except OSError as e:
            touched.add(e.strerror)
        time.sleep(0.05)
    stop.set()
    return sorted(touched)
"""
RECEIVER = """
import os, time
COUNTERS = ("/proc/loadavg", "/proc/sys/fs/file-nr", "/proc/meminfo")
def read(path):
    with open(path) as f:
        return f.read()
def receive(secret, seconds):
    seen = set()
    first = {p: read(p) for p in COUNTERS}
    mtime = os.stat("/dev/null").st_mtime_ns
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if f" {secret} {secret}" in read("/proc/locks"):
            seen.add("lock")
        if os.stat("/dev/null").st_mtime_ns != mtime:
            seen.add("/dev/null")
        seen.update(p for p in COUNTERS if read(p) != first[p])
        time.sleep(0.02)
    return sorted(seen) + [p for p in COUNTERS if first[p]]
"""


@pytest.mark.parametrize("via_userns", [False, True])
def test_concurrent_runs_see_no_lock_device_time_or_host_counter_of_each_other(via_userns):
    if os.geteuid() != 0 and via_userns:
        pytest.skip("the user-namespace path of a root server")
    pool = Pool(size=2, via_userns=via_userns)
    try:
        if "minimal_root" not in pool.layers:
            pytest.skip("no minimal root on this machine")
        secret = secrets.randbits(40)
        with ThreadPoolExecutor(2) as ex:
            sent = ex.submit(
                pool.evaluate,
                SENDER,
                [{"input": [secret, 2.5], "output": ["Read-only file system"]}],
                "send",
                30.0,
            )
            time.sleep(0.5)
            received = pool.evaluate(RECEIVER, [{"input": [secret, 1.5], "output": []}], "receive", 30.0)
            sent = sent.result()
    finally:
        pool.close()
    assert sent.passed == 1, sent  # it ran, and /dev/null's times could not be set
    assert received.passed == 1, received  # it saw none of the marks; the counters read empty


# Leaves 20,000 hard links (kernel memory) in its /tmp and reports its mount namespace.
TMP_FILLER = """
import os
os.mkdir("/tmp/links")
open("/tmp/links/0", "w").close()
for i in range(1, 20000):
    os.link("/tmp/links/0", f"/tmp/links/{i}")
print(os.stat("/proc/self/ns/mnt").st_ino)
"""


def _holders_of_mount_ns(ino: int) -> list[str]:
    """The processes in, or holding a descriptor of, the mount namespace `ino`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}/ns/mnt").st_ino == ino:
                found.append(pid)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"mnt:[{ino}]":
                    found.append(f"{pid} (fd {fd})")
    return found


def test_a_runs_tmp_and_its_kernel_memory_go_when_the_run_ends():
    """A run's mount namespace (and with it the pages and kernel memory its /tmp holds) is
    torn down once the run has ended, not kept until the server's next run."""
    pool = Pool(size=1)
    try:
        if "minimal_root" not in pool.layers:
            pytest.skip("no mount namespace of its own on this machine")
        r = pool.execute(TMP_FILLER, timeout_s=30.0)
        assert r.status == "ok", r
        ino = int(r.stdout)
        assert _wait_for(lambda: not _holders_of_mount_ns(ino), 3.0), _holders_of_mount_ns(ino)
    finally:
        pool.close()
