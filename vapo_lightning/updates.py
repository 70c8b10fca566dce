"""The updates of one rollout step: `ppo_epochs` × mini-batches × micro-batches of critic
and actor steps (VAPO §4), with global token normalisers so the loss and its gradient do not
depend on how a mini-batch is split into micro-batches or data-parallel ranks (§4.2).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from vapo_lightning import core, correction
from vapo_lightning.metrics import PhaseTimer
from vapo_lightning.rollout import Rollout, critic_values, policy_logits

__all__ = ["PPOUpdates", "as_list"]


def as_list(x: Any) -> list:
    """`LightningModule.optimizers()` returns a bare optimizer when there is only one."""
    return x if isinstance(x, list) else [x]


def sync_gradients(model: torch.nn.Module, last: bool) -> None:
    """Data-parallel gradient reduction once per mini-batch, on its last micro-batch
    (FSDP2 / replicate); a no-op for an unwrapped model."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


class OldEstimate:
    """Where pi_old (or its entropy) or V_old of one update comes from: the no-grad pass that
    filled `r.<name>` before the update, or, in one pass (`PPOUpdates.is_one_pass`), the
    first forward of the update itself, recorded into the rollout as it goes. Either way the
    update reads ``estimate(rows, output)``: the old quantity of those rows, detached."""

    def __init__(self, r: Rollout, name: str) -> None:
        self.r, self.name = r, name
        self.recording = getattr(r, name) is None
        if self.recording:
            setattr(r, name, torch.zeros(r.response_mask.shape, device=r.response_mask.device))

    def __call__(self, rows: Tensor, output: Tensor) -> Tensor:
        store, T = getattr(self.r, self.name), output.shape[1]
        if self.recording:
            store[rows, :T] = output.detach()
        return store[rows, :T]


class PPOUpdates:
    """Mixed into VAPOModule: needs `policy`, `critic`, `ref_policy`, `algo`, `gen`, `optim`,
    `actor_frozen`, and its `compute_old_logprobs`, `compute_advantages`, `critic_targets`."""

    def update(self, r: Rollout, timer: PhaseTimer) -> dict[str, float]:
        """`ppo_epochs` × mini-batches: `critic_updates_per_step` critic steps, then one
        actor step (none while value pretraining freezes the actor).

        pi_old and V_old are the no-grad passes' (`r.old_logprobs`, `r.values`), or, in one
        pass, the first forward of the critic and the actor update (`OldEstimate`); the
        advantages follow V_old, before the first actor step. Same gradients either way
        (tests/test_updates.py), as long as the models have no active dropout."""
        a, stats = self.algo, defaultdict(list)
        actor_opt, *critic_opt = as_list(self.optimizers())
        for _ in range(a.ppo_epochs):
            for idx in self.mini_batch_indices(r):
                if self.critic is not None:
                    with timer("update_critic"):
                        for _ in range(a.critic_updates_per_step):
                            self.critic_update(r, idx, critic_opt[0], stats)
                if r.advantages is None:
                    with timer("adv"):
                        self.compute_advantages(r)  # decoupled, length-adaptive GAE
                if not self.actor_frozen:
                    with timer("update_actor"):
                        self.actor_update(r, idx, actor_opt, stats)
        if r.old_logprobs is None:  # a frozen actor in one pass: pi_old for the metrics only
            with timer("old_log_prob"):
                self.compute_old_logprobs(r)
        return self.step_schedulers(stats)

    def is_one_pass(self, r: Rollout) -> bool:
        """One epoch over one mini-batch, no reference policy: pi_old and V_old are the models
        as they stand, so the updates' own forwards give them and the no-grad passes are skipped."""
        return self.algo.ppo_epochs == 1 and len(r) <= self.algo.mini_batch_size and self.ref_policy is None

    def mini_batch_indices(self, r: Rollout) -> list[Tensor]:
        """The rows of each mini-batch, shuffled anew at every epoch (one mini-batch: in order)."""
        if len(r) <= self.algo.mini_batch_size:
            return [torch.arange(len(r))]
        return list(torch.randperm(len(r)).split(self.algo.mini_batch_size))

    def step_schedulers(self, stats: dict[str, list[float]]) -> dict[str, float]:
        actor_sched, *critic_sched = as_list(self.lr_schedulers())
        if self.critic is not None:
            critic_sched[0].step()
        if not self.actor_frozen:
            actor_sched.step()
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def critic_update(self, r: Rollout, index: Tensor, opt: Any, stats: dict[str, list[float]]) -> None:
        """One critic step on the rows `index` of `r`: `core.value_loss` against the targets
        of decoupled GAE (`critic_targets`, from V_old), over global token normalisers."""
        self.critic.train()
        mask = r.response_mask[index]
        n_tokens = self.global_sum(mask.sum())
        v_old = OldEstimate(r, "values")
        loss_sum = clip_sum = 0.0
        micros = list(self.micro_batches(r, index))
        for i, (rows, micro) in enumerate(micros):
            sync_gradients(self.critic, last=i == len(micros) - 1)
            values = critic_values(self.critic, micro)
            micro.values = v_old(rows, values)
            loss, clipfrac = core.value_loss(
                values, micro.values, self.critic_targets(micro), micro.response_mask,
                n_tokens, self.algo.value_clip,
            )  # fmt: skip
            self.manual_backward(loss * self.trainer.world_size)  # DDP / FSDP average gradients
            loss_sum += loss.detach() * self.trainer.world_size
            clip_sum += clipfrac * micro.response_mask.sum() / mask.sum()
        stats["critic/vf_loss"].append(float(loss_sum))
        stats["critic/vf_clipfrac"].append(float(clip_sum))
        self.clip_and_step(opt, self.critic, "critic", stats)

    def actor_update(self, r: Rollout, index: Tensor, opt: Any, stats: dict[str, list[float]]) -> None:
        """One actor step on the rows `index` of `r`: `core.actor_loss` (clipped surrogate
        with Clip-Higher and the positive-example LM loss) over global normalisers (§4.2)."""
        a = self.algo
        self.policy.train()
        mask, correct = r.response_mask[index], r.correct[index]
        n_tokens = self.global_sum(mask.sum())
        normalizers = {
            "normalizer": n_tokens
            if a.loss_agg == "token"
            else self.global_sum(torch.tensor(len(index), device=mask.device)),
            "n_correct_tokens": self.global_sum((mask & correct[:, None]).sum()),
        }
        temperature = self.logprob_temperature
        pi_old, entropy_old = OldEstimate(r, "old_logprobs"), OldEstimate(r, "entropy")
        micros = list(self.micro_batches(r, index))
        acc: dict[str, Tensor | float] = defaultdict(float)
        for i, (rows, micro) in enumerate(micros):
            sync_gradients(self.policy, last=i == len(micros) - 1)
            m = micro.response_mask
            logits = policy_logits(self.policy, micro)
            logprobs = core.logprobs_from_logits(logits, micro.responses, temperature)
            # With an entropy bonus the entropy needs its graph; otherwise only its value.
            with torch.set_grad_enabled(a.entropy_coef > 0):
                entropy = core.entropy_from_logits(logits, temperature)  # (B, T)
            micro.old_logprobs = pi_old(rows, logprobs)
            entropy_old(rows, entropy)  # recorded for the metrics (one pass)
            is_weights = (  # truncated importance sampling against the engine that sampled
                correction.truncated_is_weights(
                    micro.old_logprobs, micro.rollout_logprobs, m, a.rollout_is_cap
                )
                if a.rollout_is == "tis"
                else None
            )
            loss, st = core.actor_loss(
                logprobs, micro.old_logprobs, micro.advantages, m, micro.correct, **normalizers,
                clip_low=a.clip_low, clip_high=a.clip_high, clip_ratio_c=a.clip_ratio_c,
                agg=a.loss_agg, nll_coef=a.nll_coef, entropy=entropy, entropy_coef=a.entropy_coef,
                ref_logprobs=micro.ref_logprobs, kl_coef=a.kl_coef, is_weights=is_weights,
            )  # fmt: skip
            self.manual_backward(loss * self.trainer.world_size)
            with torch.no_grad():
                share = m.sum() / mask.sum()  # per-token means, weighted by tokens
                for k in ("pg_loss", "nll_loss", "kl_loss"):
                    if k in st:
                        acc[f"actor/{k}"] += st[k]
                acc["actor/entropy"] += core.masked_sum(entropy.detach(), m) / n_tokens
                acc["actor/pg_clipfrac_high"] += st["clipfrac_high"] * share
                acc["actor/pg_clipfrac_lower"] += st["clipfrac_low"] * share
                acc["actor/ppo_kl"] += st["approx_kl"] * share
        world = self.trainer.world_size
        for k, v in acc.items():  # losses are this rank's share of the global sum
            scale = world if k.endswith(("_loss", "entropy")) else 1
            stats[k].append(float(v) * scale)
        stats["actor/pg_clipfrac"].append(
            stats["actor/pg_clipfrac_high"][-1] + stats["actor/pg_clipfrac_lower"][-1]
        )
        self.clip_and_step(opt, self.policy, "actor", stats)

    def clip_and_step(
        self, opt: Any, model: torch.nn.Module, name: str, stats: dict[str, list[float]]
    ) -> None:
        """Clips and steps; a non-finite gradient norm skips the step (counted in
        `<name>/update_skipped`). After `max_bad_steps` in a row the run stops, leaving a
        checkpoint of the last good state (no bad update was ever applied)."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.optim.max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stats[f"{name}/update_skipped"].append(float(not math.isfinite(norm)))
        if math.isfinite(norm):
            self.bad_updates[name] = 0
            stats[f"{name}/grad_norm"].append(norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if name == "actor":  # a new policy: the rollout engine's copy is now stale
                self.policy_version += 1
            # Under an autocast region that caches casts (Lightning < 2.6 runs training_step
            # so), the bf16 copies cast before this step would serve the next mini-batch's
            # forwards: stale weights. Dropped here; the next forward casts the new ones.
            torch.clear_autocast_cache()
            return
        opt.zero_grad(set_to_none=True)
        self.bad_updates[name] += 1
        if self.bad_updates[name] >= self.algo.max_bad_steps:
            path = os.path.join(self.trainer.default_root_dir, "checkpoints", "last_good.ckpt")
            self.trainer.save_checkpoint(path)
            raise FloatingPointError(
                f"{self.bad_updates[name]} consecutive {name} updates had a non-finite gradient (NaN/inf in "
                f"logits, losses or gradients); stopped. The last good state is in {path}: lower "
                "model.optim learning rates or model.optim.max_grad_norm, check rewards and data, then "
                f"resume with --ckpt_path {path}."
            )

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the rollouts were sampled from, which log-probs
        and entropies are taken under (greedy sampling, 0: the plain softmax, 1)."""
        return self.gen.temperature or 1.0

    @staticmethod
    def per_token(r: Rollout) -> Tensor:
        """A zero (B, T) float tensor, one entry per response position."""
        return torch.zeros(r.response_mask.shape, device=r.response_mask.device)

    def micro_batches(self, r: Rollout, index: Tensor | None = None) -> Iterator[tuple[Tensor, Rollout]]:
        """(rows of `r`, micro-batch) pairs over the rows `index` (default: all); rows are
        grouped by length (prompt + response tokens), so `trimmed` cuts much of the padding.
        The loss sums each token once over global normalisers (§4.2), so the grouping does not
        change the gradient."""
        index = torch.arange(len(r)) if index is None else index
        order = index[torch.argsort(r.attention_mask[index].sum(-1).cpu(), stable=True)]
        for rows in order.split(self.algo.micro_batch_size):
            yield rows, r.select(rows).trimmed()

    def global_sum(self, x: Tensor) -> Tensor:
        """All-reduces a normaliser over data-parallel ranks (token-level loss, §4.2)."""
        x = x.float()
        return (
            self.trainer.strategy.reduce(x, reduce_op="sum") if self.trainer.world_size > 1 else x
        )
