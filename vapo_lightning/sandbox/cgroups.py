"""Per-run cgroups: every sandbox in a memory, a pids and a cpu cgroup of its own.

RLIMIT_AS bounds one process; a memory cgroup bounds the whole run: all of its processes,
and the pages it puts in memfds, /dev/shm and its /tmp, which count toward no process's
address space. Swap is off for the run (``memory.memsw.limit_in_bytes`` too, where swap is
accounted), so the kernel's OOM killer acts inside the run at its limit instead of on the
host (where it may pick the trainer). The pids cgroup bounds the run's tasks (processes and
threads together) whatever their uid. The cpu cgroup gives each run one equal share of the
CPU, however many processes it starts: 30 busy processes of one run no longer take 30/31 of
the CPU from a concurrent run of one (which then timed out and scored 0).

cgroup v1 (each controller a hierarchy of its own under /sys/fs/cgroup, as on hybrid hosts)
or v2 (one hierarchy, /sys/fs/cgroup itself a cgroup2 mount: ``cgroup.controllers`` there).
A controller the host does not give leaves its layer out of the runs' reports.

The server (root, or owner of a delegated cgroup) makes a folder ``vapo-sandbox-<pid>``
below its own cgroup in each hierarchy (v2: one), one cgroup per spare in it when the spare is forked
(off the request path), and removes it after the run. The sandbox joins its cgroups itself,
first thing after its fork, while it still may (``join``). Stdlib only: this runs in the
server (``python -I -S``).
"""

from __future__ import annotations

import contextlib
import errno
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


V1_CPU_SHARES = 1024
"""cpu.shares of every server's cpu cgroup (v1): each run (a server runs one at a time),
however many processes it starts, weighs as much as one busy process of the host, and the
same as every other run."""
V2_CPU_WEIGHT = 100
"""cpu.weight of every server's cgroup (v2): the same, in v2's units (its default)."""
V2_CONTROLLERS = ("memory", "pids")
"""The controllers of a run's own cgroup (v2); cpu is the server folder's (`cpu`)."""


class RunCgroups:
    """The server's side: makes, sets and removes the cgroups of its runs (`version` 1 or 2).

    `available` is False when no cgroup could be made (no ``memory_cgroup`` / ``pids_cgroup``
    / ``cpu_cgroup`` layer in the runs' reports). `bases`: the server's folders, one per
    hierarchy, each with the controllers it holds; a run gets one folder in each.

    `cpu`: the server's own cpu cgroup (or None), which the server and every sandbox it
    forks are in: a server runs one run at a time, so this is the run's CPU share, and it
    costs a run nothing (a cpu cgroup made and removed per run costs CPU every run, mostly
    the kernel's). With only the sandboxes in it (the server outside), a run takes longer on
    a loaded machine: their wake-ups of each other cross groups."""

    def __init__(self, root: str | None = DEFAULT_ROOT, tag: str | None = None) -> None:
        self.available = False
        self.version = 0
        self.bases: list[tuple[str, tuple[str, ...]]] = []
        self.swap = False
        self.count = 0
        self.cpu: str | None = None
        self._cpu_parent: str | None = None  # v1: where the server goes back to at `close`
        if root is None:
            return
        tag = tag or f"vapo-sandbox-{os.getpid()}"
        try:
            own = _own_paths()
        except (OSError, ValueError):
            return
        with contextlib.suppress(OSError):
            if os.path.exists(f"{root}/cgroup.controllers"):  # `root` is a cgroup v2 mount
                self._init_v2(root, own.get("", "/"), tag)
            elif "memory" in own:  # v1 (or hybrid): one hierarchy per controller
                self._init_v1(root, own, tag)

    def _init_v1(self, root: str, own: dict[str, str], tag: str) -> None:
        memory = self._make(os.path.join(root, "memory"), own["memory"], tag)
        self.bases = [(memory, ("memory",))]
        self.swap = os.path.exists(f"{memory}/memory.memsw.limit_in_bytes")
        if "pids" in own:
            with contextlib.suppress(OSError):
                pids = self._make(os.path.join(root, "pids"), own["pids"], tag)
                self.bases.append((pids, ("pids",)))
        if "cpu" in own:
            with contextlib.suppress(OSError):
                cpu = self._make(os.path.join(root, "cpu"), own["cpu"], tag)
                _write(f"{cpu}/cpu.shares", str(V1_CPU_SHARES))
                _write(f"{cpu}/cgroup.procs", "0")  # the server: the zygote and all it forks
                self.cpu, self._cpu_parent = cpu, os.path.dirname(cpu)
        self.version, self.available = 1, True

    def _init_v2(self, root: str, own: str, tag: str) -> None:
        """cgroup v2: one folder holds every controller. A controller reaches the server's
        folder only when enabled in its parent's ``cgroup.subtree_control``, which the server
        asks for; the kernel refuses (EBUSY) where the parent holds processes itself and is
        not the root: then the parent must be delegated with them enabled (systemd's
        ``Delegate=yes``, the trainer in a leaf). The runs get the controllers that came;
        cpu stays the server folder's own (its weight among its siblings)."""
        parent = os.path.join(root, own.lstrip("/"))
        _enable(parent, (*V2_CONTROLLERS, "cpu"))
        base = self._make(root, own, tag)
        held = _enable(base, _words(f"{base}/cgroup.controllers"))
        self.bases = [(base, held)]
        if os.path.exists(f"{base}/cpu.weight"):  # cpu enabled in the parent
            with contextlib.suppress(OSError):
                _write(f"{base}/cpu.weight", str(V2_CPU_WEIGHT))
                self.cpu = base
        self.version, self.available = 2, True

    def folder(self, controller: str) -> str | None:
        """The server's folder that holds `controller` for its runs, or None."""
        if controller == "cpu":
            return self.cpu
        return next((base for base, held in self.bases if controller in held), None)

    @property
    def memory(self) -> str | None:
        return self.folder("memory")

    @property
    def pids(self) -> str | None:
        return self.folder("pids")

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
        """A new run's cgroups (one per hierarchy, in the order of `bases`), limits set; []
        when none."""
        if not self.available:
            return []
        self.count += 1
        made = []
        try:
            for base, _ in self.bases:
                os.mkdir(os.path.join(base, f"run-{self.count}"), 0o700)
                made.append(os.path.join(base, f"run-{self.count}"))
            self.set_limits(made, memory_bytes, pids)
        except OSError:
            self.remove(made)
            return []
        return made

    def set_limits(self, dirs: list[str], memory_bytes: int, pids: int) -> None:
        """The run's limits. v2 (the kernel's cgroup-v2.rst): ``memory.max`` and
        ``memory.swap.max`` 0 (no swap), ``pids.max``, ``cpu.weight`` (the default, 100: one
        equal share per server, which runs one run at a time: set at start); v1: their older
        names."""
        for d, (_, held) in zip(dirs, self.bases):
            if "memory" in held and self.version == 2:
                _write(f"{d}/memory.max", str(memory_bytes))
                if os.path.exists(f"{d}/memory.swap.max"):  # (absent without swap accounting)
                    _write(f"{d}/memory.swap.max", "0")
            elif "memory" in held:
                self._set_memory(d, memory_bytes)
            if "pids" in held:
                _write(f"{d}/pids.max", str(pids))

    def _set_memory(self, mem: str, memory_bytes: int) -> None:
        # memsw (memory + swap) may never be below the memory limit: order the writes
        try:
            _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
            if self.swap:
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
        except OSError:  # raising both: memsw first
            if self.swap:
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
            _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))

    def layers(self, dirs: list[str]) -> list[str]:
        """The layers that joining `dirs` (from `create`) gives."""
        if not dirs:
            return []
        return [f"{c}_cgroup" for c in ("memory", "pids", "cpu") if self.folder(c)]

    def oom_kills(self, dirs: list[str]) -> int:
        """How many of the run's processes the OOM killer took at the run's memory limit."""
        if not dirs or not self.folder("memory"):
            return 0
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(f"{dirs[0]}/{events}").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, dirs: list[str], wait_s: float = 1.0) -> None:
        """Removes a finished run's cgroups. Its processes are gone by then (the kernel reaps
        a PID namespace's last process before its pid 1); one still in a folder (the kernel
        refuses to remove it, EBUSY) is killed and waited for, up to `wait_s`, so that the
        server replies only once the run's last process has left."""
        for d in reversed(dirs):
            deadline = time.monotonic() + wait_s
            while not _removed(d) and time.monotonic() < deadline:
                kill_members(d, rounds=1)

    def close(self) -> None:
        if self._cpu_parent is not None:  # (v1) out of the cpu folder, so that it can go
            with contextlib.suppress(OSError):
                _write(f"{self._cpu_parent}/cgroup.procs", "0")
                os.rmdir(self.cpu)
        for base, _ in self.bases:
            with contextlib.suppress(OSError):
                for name in os.listdir(base):
                    if name.startswith("run-"):
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(base, name))
                os.rmdir(base)


def _reclaim(path: str, kill: bool = False) -> bool:
    """Removes a dead server's run folders, with `kill` after killing what is left in them
    and in the folder itself (v1's cpu folder holds its sandboxes); True when none is left."""
    if kill:
        kill_members(path)
    for name in os.listdir(path):
        if name.startswith("run-"):
            run = os.path.join(path, name)
            if kill:
                kill_members(run)
            with contextlib.suppress(OSError):  # a task still in it: it stays
                os.rmdir(run)
    return not any(name.startswith("run-") for name in os.listdir(path))


def _words(path: str) -> tuple[str, ...]:
    return tuple(_read(path).split())


def _enable(folder: str, controllers: tuple[str, ...]) -> tuple[str, ...]:
    """Enables `controllers` for the children of the v2 cgroup `folder`, one at a time (one
    the kernel refuses leaves the others); returns those of V2_CONTROLLERS now enabled."""
    for c in controllers:
        if c in V2_CONTROLLERS and c not in _words(f"{folder}/cgroup.subtree_control"):
            with contextlib.suppress(OSError):
                _write(f"{folder}/cgroup.subtree_control", f"+{c}")
    enabled = _words(f"{folder}/cgroup.subtree_control")
    return tuple(c for c in V2_CONTROLLERS if c in enabled)


def _removed(cgroup: str) -> bool:
    """Removes the folder `cgroup`; False only while a task is still in it."""
    try:
        os.rmdir(cgroup)
    except OSError as err:
        return err.errno != errno.EBUSY
    return True


def kill_members(cgroup: str, rounds: int = 100) -> None:
    """Kills every process in `cgroup` (v2: ``cgroup.kill``, which no fork outruns; v1:
    SIGKILL to each) until it is empty (or `rounds` passed): a run's sandbox is pid 1 of its
    PID namespace, so its death takes the rest of the run along."""
    with contextlib.suppress(OSError):
        _write(f"{cgroup}/cgroup.kill", "1")
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
