"""What a rollout step logs: verl's metric names (docs/algorithm.md#metrics), phase timings.

`step_metrics` is a pure function of the rollout, the updates' statistics and the phase
timer; `reduce_over_ranks` combines the ranks' values; the module logs the result.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from vapo_lightning import core, rollout_correction
from vapo_lightning.critic_checks import GlobalSum, explained_variance
from vapo_lightning.rewards.math_answers import answer_forms
from vapo_lightning.updates import Step

__all__ = [
    "ALIASES",
    "PhaseTimer",
    "answer_shares",
    "drop_undefined",
    "reduce_over_ranks",
    "rollout_metrics",
    "step_metrics",
    "warn_without_reward_signal",
]

# The phases of a rollout step (`timing_s/<phase>`; `tools` too with model.tools).
PHASES = ("weight_sync", "gen", "reward", "old_log_prob", "values", "update_critic", "adv", "update_actor", "step")

# Metrics that are NaN where they are undefined (not a fault): such a step does not log them.
UNDEFINED_AS_NAN = ("critic/vf_explained_var",)

# Short names, logged beside verl's names for dashboards written against them (the one place
# they are defined; docs/algorithm.md#metrics lists both). `critic/score/mean` is verl's name
# for the mean sequence reward, logged for critic-free runs (GRPO, DAPO) too, as verl does.
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

    def move(self, seconds: float, source: str, target: str) -> None:
        """Counts `seconds` measured inside phase `source` as phase `target` (tool calls
        made while sampling)."""
        self.totals[source] -= seconds
        self.totals[target] += seconds

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


def answer_shares(prefix: str, responses: list[str]) -> dict[str, float]:
    """`<prefix>/answer_share`: responses with a final answer the math rules read (a box, an
    `Answer:` line, `####`, `The answer is N`); `<prefix>/boxed_share`: those whose answer is
    boxed (`rewards.math_answers.answer_forms`)."""
    forms = [answer_forms(text) for text in responses] or [(False, False)]
    return {
        f"{prefix}/answer_share": sum(a for a, _ in forms) / len(forms),
        f"{prefix}/boxed_share": sum(b for _, b in forms) / len(forms),
    }


def warn_without_reward_signal(m: dict[str, float]) -> None:
    """Says so (once per run) when every group of a step got equal rewards."""
    if m.get("rollout/zero_spread_groups") == 1.0:
        rank_zero_warn(
            "every prompt's responses got the same reward this step (rollout/zero_spread_groups "
            "= 1): group-normalised advantages are all 0 and the rewards hold no contrast to "
            "learn from; if this goes on, lower the task's difficulty or raise generation.n or "
            "the temperature",
        )


def rollout_metrics(step: Step, timer: PhaseTimer, global_sum: GlobalSum = Tensor.float) -> dict[str, float]:
    """Scores, lengths, values, advantages, lambda, timings and throughput of one rollout
    step; the critic's explained variance over every rank's tokens (`global_sum`), not a mean
    of the ranks' own."""
    r, adv = step.rollout, step.advantages
    mask, lengths = r.response_mask, r.response_lengths.float()
    m = {
        "critic/score/mean": r.scores.mean(),
        "rollout/accuracy": r.correct.float().mean(),
        "rollout/zero_spread_groups": core.zero_spread_share(r.scores, r.group_ids),  # of the total reward
        "rollout/all_or_none_correct_groups": core.zero_spread_share(r.correct.float(), r.group_ids),
        **answer_shares("rollout", [s.response for s in r.samples]),
        "response_length/mean": lengths.mean(),
        "response_length/max": lengths.max(),
        "response_length/min": lengths.min(),
        "response_length/clip_ratio": r.truncated.float().mean(),
        "prompt_length/mean": r.attention_mask[:, : r.prompt_length].sum(-1).float().mean(),
        "critic/advantages/mean": core.masked_mean(adv.advantages, mask),
    }
    for k, name in enumerate(r.reward_names):  # each reward callback's own mean (unweighted)
        m[f"reward/{name}"] = r.reward_parts[:, k].mean()
    if step.values is not None:
        m["critic/values/mean"] = core.masked_mean(step.values, mask)
        m["critic/returns/mean"] = core.masked_mean(adv.returns, mask)
        m["critic/vf_explained_var"] = explained_variance(step.values, adv.returns, mask, global_sum)
    if adv.lam_actor is not None:
        m["actor/lambda_actor/mean"] = adv.lam_actor.mean()
    if adv.critic_baseline is not None:  # 1: the critic's baseline, 0: the group mean's
        m["actor/critic_baseline"] = adv.critic_baseline.float().mean()
    if r.tool_calls is not None:
        m["tools/calls/mean"] = r.tool_calls.float().mean()
        m["tools/observation_tokens/mean"] = r.observation_tokens.float().mean()
        m["tools/share_of_responses"] = (r.tool_calls > 0).float().mean()
    # engine vs trainer (with pi_old taken from the engine there is nothing to compare)
    old = step.old.logprobs
    if r.rollout_logprobs is not None and old is not None and old is not r.rollout_logprobs:
        diff = rollout_correction.probs_diff(old, r.rollout_logprobs, mask)
        m["training/rollout_probs_diff_mean"] = core.masked_mean(diff, mask)
        m["training/rollout_probs_diff_max"] = diff.max()
    # Every phase each step, 0 where it did not run (no actor update while value pretraining):
    # a key logged only some steps would keep its stale value in Lightning's metrics.
    m.update({f"timing_s/{k}": 0.0 for k in PHASES})
    m.update({f"timing_s/{k}": v for k, v in timer.totals.items()})
    m["perf/time_per_step"] = timer.totals["step"]
    m["perf/throughput"] = float(r.attention_mask.sum()) / max(timer.totals["step"], 1e-9)  # tokens/s
    return {k: float(v) for k, v in m.items()}


def step_metrics(
    step: Step,
    stats: dict[str, list[float]],
    timer: PhaseTimer,
    *,
    actor_lr: float,
    critic_lr: float | None,
    value_pretraining: bool,
    tools: bool,
    global_sum: GlobalSum = Tensor.float,
) -> dict[str, float]:
    """Everything one rollout step logs on one rank: the updates' statistics (averaged over
    their steps), the rollout's, learning rates, reward and tool errors, and the aliases."""
    r = step.rollout
    m = {k: sum(v) / len(v) for k, v in stats.items() if v}
    m.update(rollout_metrics(step, timer, global_sum))
    warn_without_reward_signal(m)  # rank 0's groups
    m.update(
        {
            "actor/lr": actor_lr,
            "warmup/active": float(value_pretraining),
            "reward/errors": float(r.reward_errors),
            "rollout/responses_sampled": float(r.sampled),
            **r.reward_metrics,
        }
    )
    if tools:
        m["tools/errors"] = float(len(r.tool_errors))
    if critic_lr is not None:
        m["critic/lr"] = critic_lr
    m.update({alias: m[name] for alias, name in ALIASES.items() if name in m})
    return m


def reduce_over_ranks(names: list[str], every: Tensor, summed: set[str]) -> dict[str, float]:
    """Each metric over ranks, from `every` (world, K) (one all-gather for all metrics): max
    / min for the extremes, the sum for the counts in `summed` (errors: the run's, not one
    rank's), the mean for the rest."""
    ops = {"/max": torch.amax, "/min": torch.amin}

    def reduce(k: str, column: Tensor) -> Tensor:
        return column.sum() if k in summed else ops.get(k[k.rfind("/") :], torch.mean)(column)

    return {k: float(reduce(k, every[:, i])) for i, k in enumerate(names)}


def drop_undefined(m: dict[str, float]) -> dict[str, float]:
    """`m` without the metrics undefined this step (`UNDEFINED_AS_NAN`): a curve skips the
    step rather than plotting a number. Any other NaN (a loss) stays, to be seen."""
    return {k: v for k, v in m.items() if not (k in UNDEFINED_AS_NAN and math.isnan(v))}
