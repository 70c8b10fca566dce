"""The worker pool under the math and verl rewards, with a stdlib echo worker: a request stuck
past its deadline is killed and its worker replaced while the rest of the batch is answered, a
worker that dies loses only its own request, and workers that cannot start fail the batch."""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from vapo_lightning.rewards.workers import READY, Lost, WorkerPool, start_process

TIMEOUT_S = 1.0
SLACK_S = 2.0  # process kill + respawn on a loaded 2-core machine

# Says it is ready, then answers [task, text] with [task, text * 2]; "hang" sleeps past any
# deadline, "die" exits with 7. Mode "die" exits before it is ready, "silent" never says it.
ECHO = r"""
import json, os, sys, time
if sys.argv[1] == "die":
    sys.exit(3)
if sys.argv[1] == "silent":
    time.sleep(60)
out = os.fdopen(1, "w", buffering=1)
out.write('"ready"\n')
for line in sys.stdin:
    task, text = json.loads(line)
    if text == "hang":
        time.sleep(60)
    if text == "die":
        os._exit(7)
    out.write(json.dumps([task, text * 2]) + "\n")
"""


class Echo(WorkerPool):
    def __init__(self, mode: str = "serve", **kwargs) -> None:
        super().__init__(**{"num_workers": 2, "timeout_s": TIMEOUT_S, "startup_timeout_s": 30.0, **kwargs})
        self.mode = mode

    def _start(self):
        return start_process([sys.executable, "-c", ECHO, self.mode])

    def _encode(self, task, request):
        return json.dumps([task, request]).encode() + b"\n"

    def _decode(self, buffer):
        *lines, rest = buffer.split(b"\n")
        return [(READY, None) if m == READY else tuple(m) for m in map(json.loads, lines)], rest


@pytest.fixture
def pools(request):
    def make(*args, **kwargs):
        pool = Echo(*args, **kwargs)
        request.addfinalizer(pool.close)
        return pool

    return make


def test_a_stuck_request_is_killed_at_its_deadline_and_its_worker_replaced(pools):
    pool = pools()
    assert pool.run(["a"]) == ["aa"]  # start the workers outside the timing
    before = [w.proc for w in pool._workers]
    start = time.perf_counter()
    out = pool.run(["hang", "b", "c", "d", "e"])
    elapsed = time.perf_counter() - start
    assert out == [Lost(timed_out=True), "bb", "cc", "dd", "ee"]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S  # at the deadline, not before or long after
    assert pool.timeouts == 1 and pool.crashes == 0 and pool.answered == 5
    killed = [proc for proc in before if proc.poll() is not None]
    assert [proc.returncode for proc in killed] == [-signal.SIGKILL]
    after = [w.proc for w in pool._workers]
    assert len(after) == 2 and killed[0] not in after  # replaced, one kept
    assert pool.run(["f", "g", "h"]) == ["ff", "gg", "hh"]  # the new worker answers


def test_a_worker_that_dies_loses_only_its_request(pools):
    pool = pools()
    assert pool.run(["die", "x", "y"]) == [Lost(timed_out=False, exit_code=7), "xx", "yy"]
    assert pool.crashes == 1 and pool.timeouts == 0
    assert pool.run(["z"] * 4) == ["zz"] * 4


def test_a_request_larger_than_a_pipe_buffer_round_trips(pools):
    text = "x" * 1_000_000
    assert pools(num_workers=1).run([text, "y"]) == [text * 2, "yy"]


def test_workers_that_cannot_start_fail_the_batch_and_are_stopped(pools):
    dying = pools("die", start_attempts=3, start_hint=" (a hint)")
    with pytest.raises(RuntimeError, match=r"exited while starting 3 times; see its stderr \(a hint\)"):
        dying.run(["a"])
    assert dying._workers == []
    silent = pools("silent", startup_timeout_s=0.5)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"did not start within 0\.5 s"):
        silent.run(["a"])
    assert time.perf_counter() - start < 0.5 + SLACK_S and silent._workers == []


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        Echo(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Echo(timeout_s=0)
