"""The math reward: extract a response's final answer and check it against the ground truth.

VAPO scores a math response +1 if its final answer is correct and -1 otherwise (arXiv
2504.05118, Sec. 5.1; 1 / 0 by config). The answer is the last ``\\boxed{}`` / ``\\fbox{}``,
else the last ``Answer:`` line (DAPO's prompt format), else the last ``#### N`` line (GSM8K's),
else ``The answer is N`` (`math_answers`). It is compared with math-verify's semantics (equivalent expressions, fractions vs decimals,
intervals, sets, tuples, matrices, "033" vs 33).

Model text is never run as code: it only reaches math-verify's LaTeX / expression parser, and
only inside worker processes. math-verify's own timeout is built on ``signal.alarm`` (main
thread only) and cannot stop a computation stuck in C, such as ``9^{9^{9^{9}}}``; so each check
runs in a separate interpreter and the host kills a worker that passes its deadline and starts
a new one (the pool is `workers`; this file says what its workers run and what a reply means).
A check that runs out of time, crashes its worker or exhausts its memory is judged wrong, and
so is a sample whose ground truth math-verify cannot parse; each such check is also an error
(counted in ``reward/errors`` and shown once per kind, `base`), so that a busy machine or a bad
answer key cannot pass for a policy that answers wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vapo_lightning.rewards.base import RewardCallback, Sample, SampleError
from vapo_lightning.rewards.math_answers import extract_answer, fast_verdict, gold_answer
from vapo_lightning.rewards.workers import READY, Lost, WorkerPool, start_process

__all__ = ["MathReward", "MathVerifier", "extract_answer", "is_equivalent"]

# The worker: a fresh interpreter that imports math-verify once, then answers one JSON line
# ``[task, pred, gold]`` with ``[task, ok, why]`` (`why`: None, or why it could not check).
# Kept as source text so the worker imports neither this package nor torch / lightning, which
# would multiply its start-up time and memory.
_WORKER_SOURCE = r"""
import json, logging, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # a stray print() from a library must not corrupt the protocol
logging.disable(logging.CRITICAL)
from math_verify import parse, verify
limit = int(sys.argv[1])
if limit > 0:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
proto.write('"ready"\n')
for line in sys.stdin:
    task, pred, gold = json.loads(line)
    ok, why = False, None
    try:
        # math-verify's signal timeouts are off: the host's deadline is the real limit.
        g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        if not g:
            why = "math-verify cannot parse the ground truth"
        else:
            p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
            ok = bool(verify(g, p, timeout_seconds=None))
    except BaseException as err:  # RecursionError, MemoryError, parser internals: "wrong"
        why = "math-verify raised " + type(err).__name__
    proto.write(json.dumps([task, ok, why]) + "\n")
"""

# ------------------------------------------------------------------------------- pool


@dataclass
class VerifierStats:
    """Counters since the verifier was created."""

    fast: int = 0
    """Checks decided without a worker (equal spelling, integers, no answer, answer too long)."""
    pooled: int = 0
    """Checks answered by a worker."""
    timeouts: int = 0
    """Checks whose worker passed the deadline and was killed (judged wrong)."""
    crashes: int = 0
    """Checks whose worker died (judged wrong)."""


class MathVerifier(WorkerPool):
    """A pool of math-verify worker processes with a hard wall-clock limit per check.

    Args:
        num_workers: worker processes (each an interpreter with math-verify imported; started
            on first use).
        timeout_s: wall-clock limit of one check, enforced by killing the worker.
        max_answer_chars: longer extracted answers are judged wrong without parsing.
        memory_limit_mb: address-space limit of each worker (0: none); a check that exceeds
            it fails inside the worker and is judged wrong.
        startup_timeout_s: how long a starting worker may take to import math-verify.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 3.0,
        max_answer_chars: int = 1000,
        memory_limit_mb: int = 4096,
        startup_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(
            num_workers,
            timeout_s,
            startup_timeout_s,
            start_attempts=3,
            label="math-verify worker",
            start_hint=f" (is math-verify installed for {sys.executable}?)",
        )
        self.max_answer_chars = max_answer_chars
        self.memory_limit_mb = memory_limit_mb
        self._fast = 0

    @property
    def stats(self) -> VerifierStats:
        """The counters as they stand now."""
        return VerifierStats(self._fast, self.answered, self.timeouts, self.crashes)

    def check_batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        failures: dict[int, str] | None = None,
    ) -> list[bool | None]:
        """One verdict per (response, ground truth): True / False, None if the ground truth
        is missing. Checks run concurrently across the workers. A check that could not be
        completed (out of time, its worker died, math-verify raised or cannot parse the
        ground truth) is False, and `failures` (if given) gets its index and why."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        verdicts: list[bool | None] = [None] * len(responses)
        pending: list[tuple[int, str, str]] = []
        for k, (response, ground_truth) in enumerate(zip(responses, ground_truths)):
            try:
                gold = gold_answer(ground_truth)
            except ValueError:
                verdicts[k] = False
                if failures is not None:  # (one kind per type: the value is named by the caller)
                    failures[k] = (
                        f"the ground truth is a {type(ground_truth).__name__}, not an answer "
                        "(point data.answer_field at the answer itself)"
                    )
                continue
            if gold is None:
                continue
            pred = extract_answer(response)
            if pred is None or len(pred) > self.max_answer_chars:
                verdicts[k] = False
            else:
                verdicts[k] = fast_verdict(pred, gold)
            if verdicts[k] is None:
                pending.append((k, pred, gold))
            else:
                self._fast += 1
        replies = self.run([(pred, gold) for _, pred, gold in pending]) if pending else []
        for (k, _, _), reply in zip(pending, replies):
            verdicts[k], why = self._verdict(reply)
            if why is not None and failures is not None:
                failures[k] = why
        return verdicts

    def _verdict(self, reply: tuple[bool, str | None] | Lost) -> tuple[bool, str | None]:
        """A worker's ``(verdict, why it could not check or None)``; a lost check is wrong."""
        if not isinstance(reply, Lost):
            return reply
        if reply.timed_out:
            return False, f"math-verify took over {self.timeout_s:g} s"
        return False, "its math-verify worker died"

    # -- the worker's side (`WorkerPool`)

    def _start(self) -> subprocess.Popen[bytes]:
        limit = self.memory_limit_mb * 2**20
        return start_process([sys.executable, "-c", _WORKER_SOURCE, str(limit)])

    def _encode(self, task: int, request: tuple[str, str]) -> bytes:
        return json.dumps([task, *request]).encode() + b"\n"

    def _decode(self, buffer: bytes) -> tuple[list[tuple[int | str, Any]], bytes]:
        *lines, rest = buffer.split(b"\n")
        messages = []
        for raw in lines:
            m = json.loads(raw)  # "ready", or [task, ok, why]
            messages.append((READY, None) if m == READY else (m[0], (bool(m[1]), m[2])))
        return messages, rest


# ------------------------------------------------------------------------- public API

_DEFAULT: MathVerifier | None = None
_DEFAULT_LOCK = threading.Lock()


def is_equivalent(response: str, ground_truth: str) -> bool:
    """Whether the final answer of `response` (full model text) equals `ground_truth` (bare,
    LaTeX, or a GSM8K solution ending ``#### N``) under math-verify's semantics. Uses a shared
    one-worker pool with a 3 s limit per check; a check that runs out of time is False."""
    global _DEFAULT
    if gold_answer(ground_truth) is None:
        raise ValueError(f"ground truth has no answer: {ground_truth!r}")
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MathVerifier(num_workers=1)
    return bool(_DEFAULT.check_batch([response], [ground_truth])[0])


class MathReward(RewardCallback):
    """VAPO's rule-based math reward: `correct_reward` if the final answer is equivalent to the
    sample's ground truth, `wrong_reward` otherwise (no answer, or wrong). A check that could
    not be completed (out of time, a crashed worker, a ground truth math-verify cannot parse)
    is an error: counted in ``reward/errors``, shown, and given `error_value`, by default
    `wrong_reward` (never more than a wrong answer: a policy must not gain by stalling the
    checker).

    Args:
        correct_reward: reward of a correct answer (paper: +1).
        wrong_reward: reward of a wrong or missing answer (paper: -1; 0 for 1 / 0 rewards).
        check_timeout_s: hard wall-clock limit of one check (the worker is killed after it).
        num_workers: math-verify worker processes, started on the first batch.
        max_answer_chars: longer extracted answers are judged wrong without parsing.
        **kwargs: `RewardCallback`'s ``weight``, ``on_error``, ``error_value`` (default:
            `wrong_reward`), ``timeout_s`` (the latter bounds a whole batch; a sample without
            ground truth is an error).
    """

    def __init__(
        self,
        correct_reward: float = 1.0,
        wrong_reward: float = -1.0,
        check_timeout_s: float = 3.0,
        num_workers: int = 2,
        max_answer_chars: int = 1000,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("timeout_s", None)  # each check has its own hard limit
        kwargs.setdefault("error_value", wrong_reward)
        super().__init__(**kwargs)
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        if not self.correct_reward > self.wrong_reward:
            raise ValueError("MathReward: correct_reward must be greater than wrong_reward")
        self.correct_threshold = (self.correct_reward + self.wrong_reward) / 2
        self.verifier = MathVerifier(num_workers, check_timeout_s, max_answer_chars)

    def score(self, samples: Sequence[Sample]) -> list[float | SampleError | None]:
        failures: dict[int, str] = {}
        verdicts = self.verifier.check_batch([s.response for s in samples], [s.ground_truth for s in samples], failures)
        scores: list[float | SampleError | None] = [
            None if ok is None else self.correct_reward if ok else self.wrong_reward for ok in verdicts
        ]
        for k, why in failures.items():
            scores[k] = SampleError(f"{why} (ground truth {samples[k].ground_truth!r})", why)
        return scores

    def close(self) -> None:
        self.verifier.close()
