"""The reward plug-in API: what a reward callback receives and how its scores are combined.

VAPO's reward is sparse (VAPO_SPEC "Notation"): one scalar per response, placed on the last
generated token. Users write a `RewardCallback` subclass whose `score` maps a batch of
`Sample`s to one float per sample; the trainer finds every `RewardCallback` among
`trainer.callbacks` and adds their scores with their weights (`combine_rewards`).

A reward that raises, hangs past `timeout_s`, returns NaN / None / the wrong number of
values is never silently turned into a zero: by `on_error` it either aborts the run with a
message naming the callback, or gives `error_value` to the affected samples and counts them
(logged as `reward/errors`).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L

__all__ = ["RewardCallback", "RewardError", "RewardOutcome", "Sample", "combine_rewards"]


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


class RewardCallback(L.Callback):
    """Base class for rewards. Subclass it and implement `score`.

    Args:
        weight: multiplier of this reward in the sum over reward callbacks.
        on_error: ``"abort"`` stops the run with a clear message; ``"value"`` gives the
            affected samples `error_value` and counts them in ``reward/errors``.
        error_value: the reward given to a sample whose score failed (``on_error="value"``).
        timeout_s: wall-clock limit for one `score` call on a whole batch (None: no limit).
            A Python thread cannot be killed: a reward that must survive hostile inputs
            enforces its own limit from outside its checking code (see `MathReward`).
    """

    def __init__(
        self,
        weight: float = 1.0,
        on_error: Literal["abort", "value"] = "value",
        error_value: float = 0.0,
        timeout_s: float | None = 300.0,
    ) -> None:
        if on_error not in ("abort", "value"):
            raise ValueError(
                f"{type(self).__name__}.on_error must be 'abort' or 'value', got {on_error!r}"
            )
        if not math.isfinite(error_value):
            raise ValueError(f"{type(self).__name__}.error_value must be finite, got {error_value}")
        self.weight = float(weight)
        self.on_error = on_error
        self.error_value = float(error_value)
        self.timeout_s = timeout_s

    correct_threshold: float | None = None
    """Verifier rewards (math, code) set this: a score above it means "correct". It decides
    `rollout/accuracy`, `val/accuracy` and which responses the positive-example NLL uses;
    with no verifier among the callbacks, a total reward > 0 counts as correct."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def score(self, samples: Sequence[Sample]) -> Sequence[float | None]:
        """One reward per sample, in order. None means "could not score" (an error)."""
        raise NotImplementedError

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
    """Each callback's own (unweighted) scores, errors replaced by its `error_value`."""
    errors: int
    """Number of (sample, callback) scores that failed."""


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="vapo-reward")


def _call_with_timeout(cb: RewardCallback, samples: Sequence[Sample]) -> Sequence[Any]:
    if cb.timeout_s is None:
        return cb.score(samples)
    future = _POOL.submit(cb.score, samples)
    try:
        return future.result(timeout=cb.timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"took longer than timeout_s={cb.timeout_s}") from None


def _checked_scores(cb: RewardCallback, samples: Sequence[Sample]) -> tuple[list[float], int]:
    """Runs `cb.score` and applies its error policy; returns (scores, number of errors)."""
    n = len(samples)

    def fail(reason: str) -> None:
        if cb.on_error == "abort":
            raise RewardError(
                f"reward callback {cb.name} {reason}; set on_error='value' on it to give "
                f"such samples error_value={cb.error_value} and count them in reward/errors"
            )

    try:
        raw = list(_call_with_timeout(cb, samples))
    except Exception as err:  # the user's code: any exception is a reward failure
        fail(f"raised {type(err).__name__}: {err}")
        return [cb.error_value] * n, n
    if len(raw) != n:
        fail(f"returned {len(raw)} values for {n} samples")
        return [cb.error_value] * n, n
    scores, errors = [], 0
    for i, value in enumerate(raw):
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            fail(f"returned {raw[i]!r} for sample {i} (response {samples[i].response[:80]!r})")
            errors += 1
            value = cb.error_value
        scores.append(value)
    return scores, errors


def combine_rewards(
    callbacks: Sequence[RewardCallback], samples: Sequence[Sample]
) -> RewardOutcome:
    """Weighted sum of every reward callback's scores (VAPO: R on the last token)."""
    if not callbacks:
        raise RewardError(
            "no reward callback: add one, e.g. --trainer.callbacks+=vapo_lightning.rewards.MathReward"
        )
    total = [0.0] * len(samples)
    per_callback, errors = {}, 0
    for cb in callbacks:
        scores, n_err = _checked_scores(cb, samples)
        errors += n_err
        per_callback[cb.name] = scores
        total = [t + cb.weight * s for t, s in zip(total, scores)]
    return RewardOutcome(total, per_callback, errors)
