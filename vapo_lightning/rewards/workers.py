"""A pool of worker processes with a hard wall-clock limit per request: the machinery that the
math reward's `MathVerifier` and the verl reward's `FunctionPool` share.

Each worker is a fresh interpreter (started with exec, never a bare fork of the trainer, which
may hold threads or CUDA) that says it is ready, then answers one request at a time over its
stdin / stdout pipes. The host hands a batch's requests to the idle workers and waits on their
pipes with a selector, never past the nearest deadline. A worker that passes its deadline is
killed (code stuck in C cannot be stopped any other way) and replaced, and so is one that dies;
its request is `Lost`, and the rest of the batch goes on. A subclass says what a worker runs
(`_start`) and how requests and replies are written (`_encode`, `_decode`); what a reply or a
`Lost` request means is left to it.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["READY", "Lost", "WorkerPool", "start_process"]

READY = "ready"
"""What `_decode` gives as the task of a worker's first message, which says it is ready."""


@dataclass(frozen=True)
class Lost:
    """A request left without an answer: its worker passed the deadline and was killed
    (`timed_out`), or died (`exit_code`)."""

    timed_out: bool
    exit_code: int | None = None


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    deadline: float
    buffer: bytes = b""
    ready: bool = False
    task: int | None = None


def start_process(argv: list[str], env: dict[str, str] | None = None, greeting: bytes = b"") -> subprocess.Popen[bytes]:
    """Starts a worker with piped stdin / stdout (its stderr is the host's) and sends it
    `greeting`, what it must read before it can say it is ready."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env, close_fds=True)
    with contextlib.suppress(OSError):  # it died at once: its stdout's EOF will say so
        _write(proc, greeting)
    return proc


def _write(proc: subprocess.Popen[bytes], data: bytes) -> None:
    view = memoryview(data)
    while view:  # an unbuffered pipe may take part of it at a time
        view = view[proc.stdin.write(view) :]  # type: ignore[union-attr]


def _stop(worker: _Worker) -> None:
    if worker.proc.poll() is None:
        worker.proc.kill()
    worker.proc.wait()
    for stream in (worker.proc.stdin, worker.proc.stdout):
        if stream is not None:
            stream.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        _stop(worker)
    workers.clear()


class WorkerPool:
    """Worker processes answering one request each at a time, each within `timeout_s`.

    Args:
        num_workers: processes, started on first use.
        timeout_s: wall-clock limit of one request; past it the worker is killed and replaced.
        startup_timeout_s: how long a starting worker may take to say it is ready.
        start_attempts: how many workers may die before they are ready, in one batch, before
            the batch fails.
        label: the workers' name in errors (``"math-verify worker"``).
        start_hint: added to the error of a worker that dies while starting.
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        startup_timeout_s: float,
        start_attempts: int = 1,
        label: str = "worker",
        start_hint: str = "",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self.start_attempts = start_attempts
        self.label, self.start_hint = label, start_hint
        self.answered = 0
        """Requests answered by a worker."""
        self.timeouts = 0
        """Requests whose worker passed the deadline and was killed."""
        self.crashes = 0
        """Requests whose worker died."""
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        # Kill the workers when the pool is collected or the interpreter exits.
        weakref.finalize(self, _stop_all, self._workers)

    # -- what a subclass says

    def _start(self) -> subprocess.Popen[bytes]:
        """A new worker process (`start_process`)."""
        raise NotImplementedError

    def _encode(self, task: int, request: Any) -> bytes:
        """Request `request`, numbered `task`, as the worker reads it."""
        raise NotImplementedError

    def _decode(self, buffer: bytes) -> tuple[list[tuple[int | str, Any]], bytes]:
        """The complete messages at the start of `buffer`, each ``(task or READY, reply)``,
        and the rest (kept for the next read). It may raise to fail the batch."""
        raise NotImplementedError

    # -- public

    def run(self, requests: Sequence[Any]) -> list[Any]:
        """Each request's reply (as `_decode` gives it), in order, or `Lost`. Requests run
        concurrently across the workers; one batch at a time."""
        with self._lock:
            while len(self._workers) < self.num_workers:
                self._workers.append(self._spawn())
            queue, results = deque(range(len(requests))), {}
            failed_starts = 0
            try:
                with selectors.DefaultSelector() as selector:
                    while len(results) < len(requests):
                        self._hand_out(queue, requests)
                        for worker in self._wait(selector):
                            failed_starts = self._read(worker, results, failed_starts)
                        self._enforce_deadlines(results)
            except BaseException:  # no worker may carry this batch's requests into the next
                _stop_all(self._workers)
                raise
        return [results[k] for k in range(len(requests))]

    def close(self, wait: bool = True) -> None:
        """Kills the workers; a later `run` starts new ones. `wait`: first let a batch running
        in another thread finish (else the workers are killed under it)."""
        if not wait:
            _stop_all(self._workers)
            return
        with self._lock:
            _stop_all(self._workers)

    # -- internals

    def _spawn(self) -> _Worker:
        return _Worker(self._start(), deadline=time.monotonic() + self.startup_timeout_s)

    def _replace(self, worker: _Worker) -> None:
        _stop(worker)
        self._workers[self._workers.index(worker)] = self._spawn()

    def _hand_out(self, queue: deque[int], requests: Sequence[Any]) -> None:
        """Sends the next queued requests to the idle workers."""
        for worker in self._workers:
            if worker.ready and worker.task is None and queue:
                k = queue.popleft()
                try:
                    _write(worker.proc, self._encode(k, requests[k]))
                except OSError:  # died since its last reply: the request goes elsewhere
                    queue.appendleft(k)
                    self._replace(worker)
                    continue
                worker.task, worker.deadline = k, time.monotonic() + self.timeout_s

    def _wait(self, selector: selectors.BaseSelector) -> list[_Worker]:
        """The workers with output (or EOF), waited for until the nearest deadline at most."""
        registered = []
        for worker in self._workers:
            fd = worker.proc.stdout.fileno()  # type: ignore[union-attr]
            selector.register(fd, selectors.EVENT_READ, worker)
            registered.append(fd)
        waiting = [w.deadline for w in self._workers if w.task is not None or not w.ready]
        wait = max(0.0, min(waiting) - time.monotonic()) if waiting else None
        events = selector.select(wait)
        for fd in registered:
            selector.unregister(fd)
        return [key.data for key, _ in events]

    def _read(self, worker: _Worker, results: dict[int, Any], failed_starts: int) -> int:
        """Takes a worker's replies into `results`; a dead worker is replaced, its request
        `Lost`. Returns `failed_starts`, counting workers that died before they were ready."""
        chunk = os.read(worker.proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
        if not chunk:  # the worker died
            if not worker.ready:
                failed_starts += 1
                if failed_starts >= self.start_attempts:
                    times = f" {failed_starts} times" if failed_starts > 1 else ""
                    raise RuntimeError(f"{self.label} exited while starting{times}; see its stderr" + self.start_hint)
            elif worker.task is not None:
                results[worker.task] = Lost(timed_out=False, exit_code=worker.proc.wait())
                self.crashes += 1
            self._replace(worker)
            return failed_starts
        messages, worker.buffer = self._decode(worker.buffer + chunk)
        for task, reply in messages:
            if task == READY:
                worker.ready = True
            elif task == worker.task:  # (never another request's answer)
                results[task], worker.task = reply, None
                self.answered += 1
        return failed_starts

    def _enforce_deadlines(self, results: dict[int, Any]) -> None:
        """Kills and replaces each worker past its deadline (its request is `Lost`)."""
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.deadline > now or (worker.ready and worker.task is None):
                continue
            if not worker.ready:
                raise RuntimeError(f"{self.label} did not start within {self.startup_timeout_s} s")
            results[worker.task] = Lost(timed_out=True)  # type: ignore[index]
            self.timeouts += 1
            self._replace(worker)
