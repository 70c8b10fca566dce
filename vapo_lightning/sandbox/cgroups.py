"""Per-run cgroups: every sandbox in a memory and a pids cgroup of its own.

RLIMIT_AS bounds one process; a memory cgroup bounds the whole run: all of its processes,
and the pages it puts in memfds, /dev/shm and its /tmp, which count toward no process's
address space. Swap is off for the run (``memory.memsw.limit_in_bytes`` too, where swap is
accounted), so the kernel's OOM killer acts inside the run at its limit instead of on the
host (where it may pick the trainer). The pids cgroup bounds the run's tasks (processes and
threads together) whatever their uid.

cgroup v1 (each controller a hierarchy of its own under /sys/fs/cgroup, as on hybrid hosts).
On a v2-only host no cgroup is made yet: the runs then lack the layers, and say so.

The server (root, or owner of a delegated cgroup) makes a folder ``vapo-sandbox-<pid>``
below its own cgroup in each hierarchy, one cgroup per spare in it when the spare is forked
(off the request path), and removes it after the run. The sandbox joins its cgroups itself,
first thing after its fork, while it still may (``join``). Stdlib only: this runs in the
server (``python -I -S``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

DEFAULT_ROOT = "/sys/fs/cgroup"


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller (``""``: the v2 hierarchy)."""
    paths = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


class RunCgroups:
    """The server's side: makes, sets and removes the cgroups of its runs (cgroup v1).

    `available` is False when no cgroup could be made (no ``memory_cgroup`` / ``pids_cgroup``
    layer in the runs' reports)."""

    def __init__(self, root: str | None = DEFAULT_ROOT, tag: str | None = None) -> None:
        self.available = False
        self.memory = self.pids = None  # the folders the runs' cgroups go in
        self.swap = False
        self.count = 0
        if root is None:
            return
        tag = tag or f"vapo-sandbox-{os.getpid()}"
        try:
            own = _own_paths()
        except (OSError, ValueError):
            return
        try:
            if "memory" in own:  # v1 (or hybrid): one hierarchy per controller; else none yet
                self.memory = self._make(os.path.join(root, "memory"), own["memory"], tag)
                self.swap = os.path.exists(f"{self.memory}/memory.memsw.limit_in_bytes")
                if "pids" in own:
                    with contextlib.suppress(OSError):
                        self.pids = self._make(os.path.join(root, "pids"), own["pids"], tag)
                self.available = True
        except OSError:
            self.memory = self.pids = None

    @staticmethod
    def _make(hierarchy: str, own: str, tag: str) -> str:
        """Makes the server's folder, after removing what dead servers left beside it
        (`remove_dead_servers`). One already there under this tag (our own pid) is a dead
        server's too, found where the cgroup is shared beyond this process tree: its empty
        run folders are removed and the folder taken over; where one still holds a task,
        the server takes the next free name instead."""
        parent = os.path.join(hierarchy, own.lstrip("/"))
        remove_dead_servers(parent)
        for attempt in range(8):
            path = os.path.join(parent, tag if attempt == 0 else f"{tag}.{attempt}")
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                if _reclaim(path):
                    return path
        raise FileExistsError(f"no free cgroup folder for {tag} in {parent}")

    def create(self, memory_bytes: int, pids: int) -> list[str]:
        """A new run's cgroups (one per hierarchy), limits set; [] when none."""
        if not self.available:
            return []
        self.count += 1
        name = f"run-{self.count}"
        dirs = [os.path.join(self.memory, name)]
        if self.pids is not None and self.pids != self.memory:
            dirs.append(os.path.join(self.pids, name))
        made = []
        try:
            for d in dirs:
                os.mkdir(d, 0o700)
                made.append(d)
            self.set_limits(made, memory_bytes, pids)
        except OSError:
            self.remove(made)
            return []
        return made

    def set_limits(self, dirs: list[str], memory_bytes: int, pids: int) -> None:
        mem = dirs[0]
        # memsw (memory + swap) may never be below the memory limit: order the writes
        try:
            _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
            if self.swap:
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
        except OSError:  # raising both: memsw first
            if self.swap:
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
            _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
        if self.pids is not None:
            _write(f"{dirs[-1]}/pids.max", str(pids))

    def layers(self, dirs: list[str]) -> list[str]:
        """The layers that joining `dirs` (from `create`) gives."""
        if not dirs:
            return []
        return ["memory_cgroup"] + (["pids_cgroup"] if self.pids is not None else [])

    def oom_kills(self, dirs: list[str]) -> int:
        """How many of the run's processes the OOM killer took at the run's memory limit."""
        if not dirs:
            return 0
        try:
            for line in _read(f"{dirs[0]}/memory.oom_control").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, dirs: list[str]) -> None:
        """Removes a finished run's cgroups (its processes are reaped by then)."""
        for d in reversed(dirs):
            with contextlib.suppress(OSError):
                os.rmdir(d)

    def close(self) -> None:
        for base in {self.memory, self.pids} - {None}:
            with contextlib.suppress(OSError):
                for name in os.listdir(base):
                    if name.startswith("run-"):
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(base, name))
                os.rmdir(base)


def _reclaim(path: str, kill: bool = False) -> bool:
    """Removes a dead server's run folders, with `kill` after killing what is left in them;
    True when none is left."""
    for name in os.listdir(path):
        if name.startswith("run-"):
            run = os.path.join(path, name)
            if kill:
                kill_members(run)
            with contextlib.suppress(OSError):  # a task still in it: it stays
                os.rmdir(run)
    return not any(name.startswith("run-") for name in os.listdir(path))


def kill_members(cgroup: str, rounds: int = 100) -> None:
    """SIGKILLs every process in `cgroup` until it is empty (or `rounds` passed): a run's
    sandbox is pid 1 of its PID namespace, so its death takes the rest of the run along."""
    for _ in range(rounds):
        try:
            pids = [int(p) for p in _read(f"{cgroup}/cgroup.procs").split()]
        except (OSError, ValueError):
            return
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _server_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"sandbox/server.py" in f.read()
    except OSError:
        return False


def remove_dead_servers(parent: str) -> None:
    """Removes the folders of servers that died without `close` (SIGKILLed, or their host
    crashed): what still runs in them is killed first. A folder is a dead server's when no
    sandbox server runs under the pid in its name (servers that share a cgroup must share a
    PID namespace)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix("vapo-sandbox-").split(".")[0]
        if name.startswith("vapo-sandbox-") and pid.isdigit() and not _server_alive(int(pid)):
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):
                if _reclaim(path, kill=True):
                    os.rmdir(path)


def join(dirs: list[str]) -> None:
    """In the sandbox, first thing after its fork: moves this process (and so everything it
    will start) into its run's cgroups. Raises OSError when refused."""
    for d in dirs:
        _write(f"{d}/cgroup.procs", "0")
