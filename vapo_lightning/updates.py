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


class PPOUpdates:
    """Mixed into VAPOModule: needs `policy`, `critic`, `ref_policy`, `algo`, `gen`, `optim`,
    `actor_frozen`, and its `compute_old_logprobs`, `compute_advantages`, `critic_targets`."""

    def update(self, r: Rollout, timer: PhaseTimer) -> dict[str, float]:
        stats: dict[str, list[float]] = defaultdict(list)
        actor_opt, *critic_opt = as_list(self.optimizers())
        for _ in range(self.algo.ppo_epochs):
            for idx in torch.randperm(len(r)).split(self.algo.mini_batch_size):
                mb = r.select(idx)
                if self.critic is not None:
                    with timer("update_critic"):
                        self.critic_update(mb, critic_opt[0], stats)
                if not self.actor_frozen:
                    with timer("update_actor"):
                        self.actor_update(mb, actor_opt, stats)
        return self.step_schedulers(stats)

    def update_one_pass(self, r: Rollout, timer: PhaseTimer) -> dict[str, float]:
        """One epoch over one mini-batch: pi_old and V_old are the models as they stand, so
        the updates' own forwards provide them and the two no-grad passes are skipped. The
        critic steps first, recording V_old; advantages follow; then the actor, with
        ratio = 1 at its single step. The same gradients as `update` (tests/test_micro_batches.py)
        as long as the models have no active dropout (pi_old comes from a train-mode forward)."""
        stats: dict[str, list[float]] = defaultdict(list)
        actor_opt, *critic_opt = as_list(self.optimizers())
        if self.critic is not None:
            with timer("update_critic"):
                self.critic_update(r, critic_opt[0], stats, fresh=True)
        with timer("adv"):
            self.compute_advantages(r)
        if self.actor_frozen:  # value pretraining: pi_old only for the entropy metrics
            with timer("old_log_prob"):
                self.compute_old_logprobs(r)
        else:
            with timer("update_actor"):
                self.actor_update(r, actor_opt, stats, fresh=True)
        return self.step_schedulers(stats)

    def is_one_pass(self, r: Rollout) -> bool:
        return self.algo.ppo_epochs == 1 and len(r) <= self.algo.mini_batch_size and self.ref_policy is None

    def step_schedulers(self, stats: dict[str, list[float]]) -> dict[str, float]:
        actor_sched, *critic_sched = as_list(self.lr_schedulers())
        if self.critic is not None:
            critic_sched[0].step()
        if not self.actor_frozen:
            actor_sched.step()
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def critic_update(
        self, mb: Rollout, opt: Any, stats: dict[str, list[float]], fresh: bool = False
    ) -> None:
        """fresh: V_old is this forward's output (`update_one_pass`); it is written to
        `mb.values` and the targets are computed here, micro-batch by micro-batch."""
        self.critic.train()
        n_tokens = self.global_sum(mb.response_mask.sum())
        loss_sum = clip_sum = 0.0
        if fresh:
            mb.values = self.per_token(mb)
        micros = list(self.micro_batches(mb))
        for i, (idx, micro) in enumerate(micros):
            sync_gradients(self.critic, last=i == len(micros) - 1)
            values = critic_values(self.critic, micro)
            if fresh:
                micro.values = values.detach()
                mb.values[idx, : values.shape[1]] = micro.values
                micro.returns = self.critic_targets(micro)
            loss, clipfrac = core.value_loss(
                values,
                micro.values,
                micro.returns,
                micro.response_mask,
                n_tokens,
                self.algo.value_clip,
            )
            self.manual_backward(loss * self.trainer.world_size)  # DDP / FSDP average gradients
            loss_sum += loss.detach() * self.trainer.world_size
            clip_sum += clipfrac * micro.response_mask.sum() / mb.response_mask.sum()
        stats["critic/vf_loss"].append(float(loss_sum))
        stats["critic/vf_clipfrac"].append(float(clip_sum))
        self.optimizer_step(opt, self.critic, "critic", stats)

    def actor_update(
        self, mb: Rollout, opt: Any, stats: dict[str, list[float]], fresh: bool = False
    ) -> None:
        """fresh: pi_old is this forward's output, detached (`update_one_pass`); it and the
        entropy are written to `mb.old_logprobs` / `mb.entropy` for the metrics."""
        a = self.algo
        self.policy.train()
        mask = mb.response_mask
        n_tokens = self.global_sum(mask.sum())
        normalizer = (
            n_tokens
            if a.loss_agg == "token"
            else self.global_sum(torch.tensor(len(mb), device=mask.device))
        )
        n_correct = self.global_sum((mask & mb.correct[:, None]).sum())
        temperature = self.logprob_temperature
        if fresh:
            mb.old_logprobs, mb.entropy = self.per_token(mb), self.per_token(mb)
        micros = list(self.micro_batches(mb))
        acc: dict[str, Tensor | float] = defaultdict(float)
        for i, (idx, micro) in enumerate(micros):
            sync_gradients(self.policy, last=i == len(micros) - 1)
            m = micro.response_mask
            logits = policy_logits(self.policy, micro)
            logprobs = core.logprobs_from_logits(logits, micro.responses, temperature)
            if fresh:
                micro.old_logprobs = logprobs.detach()
                mb.old_logprobs[idx, : m.shape[1]] = micro.old_logprobs
            is_weights = (  # truncated importance sampling against the engine that sampled
                correction.truncated_is_weights(
                    micro.old_logprobs, micro.rollout_logprobs, m, a.rollout_is_cap
                )
                if a.rollout_is == "tis"
                else None
            )
            pg, st = core.policy_loss(
                logprobs, micro.old_logprobs, micro.advantages, m, normalizer,
                a.clip_low, a.clip_high, a.clip_ratio_c, a.loss_agg, is_weights,
            )  # fmt: skip
            loss = pg
            if a.nll_coef > 0:  # positive-example LM loss (§4.3, Eq. 10)
                nll = core.nll_loss(logprobs, m, micro.correct, n_correct)
                loss = loss + a.nll_coef * nll
                acc["actor/nll_loss"] += nll.detach()
            # With an entropy bonus the entropy needs its graph; otherwise only its value.
            with torch.set_grad_enabled(a.entropy_coef > 0):
                entropy = core.entropy_from_logits(logits, temperature)  # (B, T)
            if fresh:
                mb.entropy[idx, : m.shape[1]] = entropy.detach()
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * core.aggregate(entropy, m, a.loss_agg, normalizer)
            if a.kl_coef > 0:
                kl = core.aggregate(
                    core.kl_penalty(logprobs, micro.ref_logprobs), m, a.loss_agg, normalizer
                )
                loss = loss + a.kl_coef * kl
                acc["actor/kl_loss"] += kl.detach()
            self.manual_backward(loss * self.trainer.world_size)
            with torch.no_grad():
                share = m.sum() / mask.sum()  # per-token means, weighted by tokens
                acc["actor/pg_loss"] += pg.detach()
                acc["actor/entropy"] += core.masked_sum(entropy.detach(), m) / n_tokens
                for name, key in [
                    ("pg_clipfrac_high", "clipfrac_high"),
                    ("pg_clipfrac_lower", "clipfrac_low"),
                ]:
                    acc[f"actor/{name}"] += st[key] * share
                acc["actor/ppo_kl"] += st["approx_kl"] * share
        world = self.trainer.world_size
        for k, v in acc.items():  # losses are this rank's share of the global sum
            scale = world if k.endswith(("_loss", "entropy")) else 1
            stats[k].append(float(v) * scale)
        stats["actor/pg_clipfrac"].append(
            stats["actor/pg_clipfrac_high"][-1] + stats["actor/pg_clipfrac_lower"][-1]
        )
        self.optimizer_step(opt, self.policy, "actor", stats)

    def optimizer_step(
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

    def micro_batches(self, r: Rollout) -> Iterator[tuple[Tensor, Rollout]]:
        """(row index, micro-batch) pairs; rows are grouped by length (prompt + response
        tokens), so `trimmed` cuts much of the padding. The loss sums each token once over global
        normalisers (§4.2), so the grouping does not change the gradient."""
        order = torch.argsort(r.attention_mask.sum(-1), stable=True)
        for idx in order.split(self.algo.micro_batch_size):
            yield idx, r.select(idx).trimmed()

    def global_sum(self, x: Tensor) -> Tensor:
        """All-reduces a normaliser over data-parallel ranks (token-level loss, §4.2)."""
        x = x.float()
        return (
            self.trainer.strategy.reduce(x, reduce_op="sum") if self.trainer.world_size > 1 else x
        )
