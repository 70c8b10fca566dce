"""The reward plug-in API: what a reward callback receives and how its scores are combined.

VAPO's reward is sparse (docs/algorithm.md, "Notation"): one scalar per response, placed on the last
generated token. Users write a `RewardCallback` subclass whose `score` maps a batch of
`Sample`s to one float per sample; the trainer finds every `RewardCallback` among
`trainer.callbacks` and adds their scores with their weights (`combine_rewards`).

A reward that raises, hangs past `timeout_s`, returns NaN / None / the wrong number of
values is never silently turned into a zero: by `on_error` it either aborts the run with a
message naming the callback, or gives `error_value` to the affected samples and counts them
(`reward/errors`, also in the progress bar), warning once per kind of failure with the first
message; a reward failing on more than `max_error_share` of the samples in `max_error_steps`
consecutive batches stops the run.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

__all__ = [
    "RewardCallback",
    "RewardError",
    "RewardOutcome",
    "Sample",
    "SampleError",
    "check_callbacks",
    "combine_rewards",
]


@dataclass(frozen=True)
class Sample:
    """One sampled response and the dataset row it answers."""

    prompt: str
    """The prompt text as the policy saw it (chat template applied, if any)."""
    response: str
    """The decoded response (special tokens removed)."""
    response_ids: Sequence[int]
    """The generated token ids, EOS included when the model emitted it."""
    truncated: bool
    """True when generation stopped at `max_new_tokens` without EOS."""
    ground_truth: Any = None
    """The row's answer (math) or tests (code), from the data module's configured field."""
    data_source: str = "default"
    """The row's data source, for per-source rewards and metrics."""
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    """Every other field of the dataset row."""


class RewardError(RuntimeError):
    """A reward callback failed and the configuration says to abort."""


class SampleError(Exception):
    """What `score` returns for a sample it could not score: `message` is shown on the
    console, once per callback and `kind` (e.g. the user function's exception type)."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class RewardCallback(L.Callback):
    """Base class for rewards. Subclass it and implement `score`.

    Args:
        weight: multiplier of this reward in the sum over reward callbacks.
        on_error: ``"abort"`` stops the run with a clear message; ``"value"`` gives the
            affected samples `error_value` and counts them in ``reward/errors``.
        error_value: the reward given to a sample whose score failed (``on_error="value"``).
        timeout_s: wall-clock limit for one `score` call on a whole batch (None: no limit,
            and `score` runs in the trainer's thread). With a limit it runs in a daemon
            thread of its own: past the limit the batch's samples fail, and until the call
            returns later batches fail at once instead of piling up threads. A thread cannot
            be killed: a reward that may hang runs its checks in processes it can kill (as
            `MathReward`, `VerlReward` do).
        max_error_share: stop the run when more than this share of a batch's samples fail
            in `max_error_steps` consecutive batches (None: never stop; ``on_error="value"``).
        max_error_steps: see `max_error_share`.
    """

    def __init__(
        self,
        weight: float = 1.0,
        on_error: Literal["abort", "value"] = "value",
        error_value: float = 0.0,
        timeout_s: float | None = 300.0,
        max_error_share: float | None = 0.5,
        max_error_steps: int = 3,
    ) -> None:
        if on_error not in ("abort", "value"):
            raise ValueError(f"{type(self).__name__}.on_error must be 'abort' or 'value', got {on_error!r}")
        if not math.isfinite(error_value):
            raise ValueError(f"{type(self).__name__}.error_value must be finite, got {error_value}")
        if not math.isfinite(weight):
            raise ValueError(f"{type(self).__name__}.weight must be finite, got {weight}")
        self.weight = float(weight)
        self.on_error = on_error
        self.error_value = float(error_value)
        self.timeout_s = timeout_s
        if max_error_share is not None and not 0 <= max_error_share < 1:
            raise ValueError(f"{type(self).__name__}.max_error_share must be in [0, 1) or None")
        self.max_error_share, self.max_error_steps = max_error_share, max(1, int(max_error_steps))
        self._warned_kinds: set[str] = set()
        self._bad_batches = 0

    correct_threshold: float | None = None
    """Verifier rewards (math, code) set this: a score above it means "correct". It decides
    `rollout/accuracy`, `val/accuracy` and which responses the positive-example NLL uses;
    with no verifier among the callbacks, a total reward > 0 counts as correct."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def score(self, samples: Sequence[Sample]) -> Sequence[float | BaseException | None]:
        """One reward per sample, in order. None, or an exception instance (whose message is
        shown), means "could not score this sample" (an error)."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Counts over the last `score` call's samples that the trainer logs with the rollout
        step, summed over DAPO's dynamic-sampling rounds (e.g. `CodeReward`'s
        ``code/passed``); none by default. The same keys on every call and every rank, zeros
        included: the ranks' values are summed by position."""
        return {}

    def close(self) -> None:
        """Release worker processes or connections; called at the end of fit/validate."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.close()


@dataclass
class RewardOutcome:
    """The combined reward of a batch and what went wrong computing it."""

    rewards: list[float]
    """Weighted sum over callbacks, one per sample."""
    per_callback: dict[str, list[float]]
    """Each callback's own (unweighted) scores, errors replaced by its `error_value`, by its
    `name` (a second callback of the same name is ``"<name>#2"``, and so on)."""
    errors: int
    """Number of (sample, callback) scores that failed."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The callbacks' `metrics()` summed, of the calls that returned: a call that raised or
    timed out gives its keys with 0 (its samples are in `errors`), not an earlier batch's."""

    def correct(self, callbacks: Sequence[RewardCallback]) -> list[bool]:
        """Whether every verifier (a callback with a `correct_threshold`) scores each sample
        above its threshold; without verifiers, whether the total reward is positive."""
        verifiers = [
            (cb.correct_threshold, scores)
            for cb, scores in zip(callbacks, self.per_callback.values())
            if cb.correct_threshold is not None
        ]
        if not verifiers:
            return [reward > 0 for reward in self.rewards]
        return [all(scores[i] > t for t, scores in verifiers) for i in range(len(self.rewards))]


class _Call:
    """One `score` call: in the caller's thread without `timeout_s`, else in a daemon thread
    of its own, so that a hung callback delays neither the other callbacks nor the exit."""

    def __init__(self, cb: RewardCallback, samples: Sequence[Sample]) -> None:
        self.cb, self.samples, self.box = cb, samples, {}
        self.returned = False  # `score` returned (its `metrics()` describe these samples)
        self.thread: threading.Thread | None = None
        if cb.timeout_s is None:
            return
        previous = cb.__dict__.get("_hung_call")
        if previous is not None and previous.is_alive():
            return  # still stuck in an earlier batch: a second thread would only pile up
        self.thread = threading.Thread(target=self._run, name=f"vapo-reward-{cb.name}", daemon=True)
        self.deadline = time.monotonic() + cb.timeout_s
        self.thread.start()

    def _run(self) -> None:
        try:
            self.box["value"] = self.cb.score(self.samples)
        except BaseException as err:  # handed to the caller by `result`
            self.box["error"] = err

    def result(self) -> Sequence[Any]:
        cb = self.cb
        if cb.timeout_s is None:
            value = cb.score(self.samples)
            self.returned = True
            return value
        if self.thread is None:
            raise TimeoutError(f"its call on an earlier batch, past timeout_s={cb.timeout_s}, is still running")
        self.thread.join(max(0.0, self.deadline - time.monotonic()))
        if self.thread.is_alive():
            cb._hung_call = self.thread
            raise TimeoutError(f"took longer than timeout_s={cb.timeout_s}")
        if "error" in self.box:
            raise self.box["error"]
        self.returned = True
        return self.box["value"]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _checked_scores(
    cb: RewardCallback, samples: Sequence[Sample], call: _Call
) -> tuple[list[float], list[tuple[str, str]]]:
    """`cb`'s scores with its error policy applied, and ``(kind, message)`` per failure."""
    n = len(samples)

    def fail(reason: str) -> None:
        if cb.on_error == "abort":
            raise RewardError(
                f"reward callback {cb.name} {reason}; set on_error='value' on it to give "
                f"such samples error_value={cb.error_value} and count them in reward/errors"
            )

    try:
        result = call.result()
        if isinstance(result, Mapping | str | bytes | set | frozenset):  # list() would read keys
            raise TypeError(
                f"score() returned a {type(result).__name__}: it must return one reward per "
                "sample, in the samples' order (a list)"
            )
        raw = list(result)
    except Exception as err:  # the user's code: any exception is a reward failure
        fail(f"raised {_describe(err)}")
        return [cb.error_value] * n, [(type(err).__name__, _describe(err))] * n
    if len(raw) != n:
        fail(f"returned {len(raw)} values for {n} samples")
        return [cb.error_value] * n, [("wrong length", f"{len(raw)} values for {n} samples")] * n
    scores, failures = [], []
    for i, value in enumerate(raw):
        if isinstance(value, SampleError):
            kind, reason, value = value.kind, str(value), math.nan
        elif isinstance(value, BaseException):  # the callback's own per-sample error
            kind, reason, value = type(value).__name__, _describe(value), math.nan
        else:
            kind, reason = "not a finite number", f"returned {value!r}"
            try:
                value = float(value)
            except (TypeError, ValueError):
                value = math.nan
        if not math.isfinite(value):
            fail(f"{reason} for sample {i} (response {samples[i].response[:80]!r})")
            failures.append((kind, f"{reason} (sample {i}, response {samples[i].response[:80]!r})"))
            value = cb.error_value
        scores.append(value)
    return scores, failures


def _report(cb: RewardCallback, failures: list[tuple[str, str]], n: int) -> None:
    """Warns once per callback and kind of failure; stops the run when more than
    `max_error_share` of the samples failed in `max_error_steps` consecutive batches."""
    for kind, message in failures:
        if kind not in cb._warned_kinds:
            cb._warned_kinds.add(kind)
            count = sum(k == kind for k, _ in failures)
            warnings.warn(  # on every rank: a failure on rank 1 is shown too
                f"reward callback {cb.name} failed on {count} of {n} samples ({kind}); first: "
                f"{message}. Failed samples get error_value={cb.error_value} and are counted in "
                "reward/errors; this warning is shown once per kind of failure",
                stacklevel=2,
            )
    if cb.max_error_share is None:
        return
    share = len(failures) / max(n, 1)
    cb._bad_batches = cb._bad_batches + 1 if share > cb.max_error_share else 0
    if cb._bad_batches >= cb.max_error_steps:
        raise RewardError(
            f"reward callback {cb.name} failed on more than {cb.max_error_share:.0%} of the "
            f"samples in {cb._bad_batches} consecutive batches ({len(failures)} of {n} in the "
            f"last; first: {failures[0][1]}). Fix the reward, or set max_error_share=null on "
            "it to keep training with error_value for the failed samples."
        )


def combine_rewards(callbacks: Sequence[RewardCallback], samples: Sequence[Sample]) -> RewardOutcome:
    """Weighted sum of every reward callback's scores (VAPO: R on the last token)."""
    if not callbacks:
        raise RewardError("no reward callback: add one, e.g. --trainer.callbacks+=vapo_lightning.rewards.MathReward")
    total = [0.0] * len(samples)
    per_callback, errors, metrics = {}, 0, {}
    calls = [_Call(cb, samples) for cb in callbacks]  # the threaded ones start now
    for cb, call in zip(callbacks, calls):
        scores, failures = _checked_scores(cb, samples, call)
        _report(cb, failures, len(samples))
        errors += len(failures)
        returned = call.returned
        for key, value in cb.metrics().items():  # += : a zero count is kept, not dropped
            metrics[key] = metrics.get(key, 0.0) + (float(value) if returned else 0.0)
        name, k = cb.name, 1
        while name in per_callback:
            k += 1
            name = f"{cb.name}#{k}"
        per_callback[name] = scores
        total = [t + cb.weight * s for t, s in zip(total, scores)]
    return RewardOutcome(total, per_callback, errors, metrics)


def score_rollout(r: Any, callbacks: Sequence[RewardCallback], device: Any = None) -> None:
    """Scores rollout `r`'s samples with `callbacks`: the total reward (`r.scores`, (B,)),
    whether every verifier counts each correct (`r.correct`), each callback's own score
    (`r.reward_parts`, (B, K), `r.reward_names`), errors and metrics, on `device`."""

    outcome = combine_rewards(callbacks, r.samples)
    r.scores = torch.tensor(outcome.rewards, dtype=torch.float32, device=device)
    r.correct = torch.tensor(outcome.correct(callbacks), device=device)
    r.reward_errors, r.reward_metrics = outcome.errors, dict(outcome.metrics)
    r.reward_names, parts = list(outcome.per_callback), list(outcome.per_callback.values())
    r.reward_parts = torch.tensor(parts, dtype=torch.float32, device=device).T  # (B, K)


def check_callbacks(callbacks: Sequence[Any]) -> None:
    """A callback with a `score` method that is no `RewardCallback` would be skipped without a
    word (its reward never reaching the sum): refuse it before any work. A reward class listed
    twice counts twice (a config layer's `callbacks:` list replaces the earlier layers' list,
    so restating it is the easy way to repeat one): say so."""
    repeated = Counter(type(cb).__qualname__ for cb in callbacks if isinstance(cb, RewardCallback))
    for name, times in repeated.items():
        if times > 1:
            rank_zero_warn(
                f"trainer.callbacks: {name} is listed {times} times, so its reward is added {times} "
                "times; to add a reward over a config's list without restating it, use "
                "`callbacks+:` in a YAML layer or --trainer.callbacks+= on the command line"
            )
    for cb in callbacks:
        if callable(getattr(cb, "score", None)) and not isinstance(cb, RewardCallback):
            raise TypeError(
                f"trainer.callbacks: {type(cb).__qualname__} has a score() method but is not a "
                "vapo_lightning.rewards.RewardCallback, so its reward would be ignored; subclass "
                "RewardCallback"
            )
