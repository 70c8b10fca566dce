"""What a rollout step logs: verl's metric names (docs/algorithm.md#metrics), phase timings.

`rollout_metrics` is a pure function of the rollout and the phase timer; the module adds
the update statistics, reduces across ranks and logs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vapo_lightning import core, correction
from vapo_lightning.rollout import Rollout

__all__ = ["ALIASES", "PhaseTimer", "rollout_metrics"]

# The seed document's short names, logged as aliases of verl's names.
ALIASES = {
    "reward": "critic/score/mean",
    "seq_len": "response_length/mean",
    "entropy": "actor/entropy",
    "value_loss": "critic/vf_loss",
    "policy_loss": "actor/pg_loss",
}


class PhaseTimer:
    """Wall time per phase (`timing_s/*`), synchronising CUDA so the numbers are real."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start


def rollout_metrics(r: Rollout, timer: PhaseTimer) -> dict[str, float]:
    """Scores, lengths, values, advantages, lambda, timings and throughput of one rollout."""
    mask, lengths = r.response_mask, r.response_lengths.float()
    m = {
        "critic/score/mean": r.scores.mean(),
        "rollout/accuracy": r.correct.float().mean(),
        "response_length/mean": lengths.mean(),
        "response_length/max": lengths.max(),
        "response_length/min": lengths.min(),
        "response_length/clip_ratio": r.truncated.float().mean(),
        "prompt_length/mean": r.attention_mask[:, : r.prompt_length].sum(-1).float().mean(),
        "critic/advantages/mean": core.masked_mean(r.advantages, mask),
    }
    if r.values is not None:
        m["critic/values/mean"] = core.masked_mean(r.values, mask)
        m["critic/returns/mean"] = core.masked_mean(r.returns, mask)
        m["critic/vf_explained_var"] = core.explained_variance(r.values, r.returns, mask)
    if r.lam_actor is not None:
        m["actor/lambda_actor/mean"] = r.lam_actor.mean()
    if r.tool_calls is not None:
        m["tools/calls/mean"] = r.tool_calls.float().mean()
        m["tools/observation_tokens/mean"] = r.observation_tokens.float().mean()
        m["tools/share_of_responses"] = (r.tool_calls > 0).float().mean()
    if r.rollout_logprobs is not None and r.old_logprobs is not None:  # engine vs trainer
        diff = correction.probs_diff(r.old_logprobs, r.rollout_logprobs, mask)
        m["training/rollout_probs_diff_mean"] = core.masked_mean(diff, mask)
        m["training/rollout_probs_diff_max"] = diff.max()
    m.update({f"timing_s/{k}": v for k, v in timer.totals.items()})
    m["perf/time_per_step"] = timer.totals["step"]
    m["perf/throughput"] = float(r.attention_mask.sum()) / max(
        timer.totals["step"], 1e-9
    )  # tokens/s
    return {k: float(v) for k, v in m.items()}
