"""The model passes of one rollout step, as functions of explicit inputs (verl's `dp_actor`
and `dp_critic`): the no-grad log-probs and values, and `ppo_epochs` × mini-batches ×
micro-batches of critic and actor updates (VAPO §4), with global token normalisers so the
loss and its gradient do not depend on how a mini-batch is split into micro-batches or
data-parallel ranks (§4.2). Each update returns its statistics; none calls back into the
trainer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from vapo_lightning import core, rollout_correction
from vapo_lightning.advantages import Advantages
from vapo_lightning.config import Algorithm
from vapo_lightning.packing import ROWS, Layout
from vapo_lightning.rollout import Rollout, critic_values, token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "OLD_LOGPROB_SOURCES",
    "Forwards",
    "OldPolicy",
    "RankOps",
    "Step",
    "clip_and_step",
    "compute_log_probs",
    "compute_values",
    "count_bad_steps",
    "micro_batches",
    "mini_batches",
    "old_policy",
    "token_budget_groups",
    "update_actor",
    "update_critic",
]

Stats = dict[str, list[float]]


@dataclass(frozen=True)
class RankOps:
    """What an update does across data-parallel ranks: `backward` (Lightning's
    `manual_backward`: precision plugin and strategy), `global_sum` (a sum over ranks), and for
    a sharded model whether its gradient accumulates unsharded over a mini-batch
    (`VAPOStrategy.accumulate_unsharded`)."""

    backward: Callable[[Tensor], None] = Tensor.backward
    global_sum: Callable[[Tensor], Tensor] = Tensor.float
    world_size: int = 1
    accumulate_unsharded: bool = False


@dataclass(frozen=True)
class Forwards:
    """How a step's forwards are cut, which the loss does not depend on (§4.2): micro-batches
    of `size` responses, or with `max_tokens` as many as fit in that many tokens; as many on
    every rank (`agree`: the maximum of a count over ranks, since each forward of a sharded
    model is collective); in `layout` (rows, or one prompt's responses packed over their
    shared prompt, `packing`)."""

    size: int
    max_tokens: int | None = None
    agree: Callable[[int], int] = int
    layout: Layout = ROWS

    @classmethod
    def of(cls, a: Algorithm, agree: Callable[[int], int] = int, layout: Layout = ROWS) -> Forwards:
        """The algorithm's micro-batches (`micro_batch_size`, `max_tokens_per_micro_batch`)."""
        return cls(a.micro_batch_size, a.max_tokens_per_micro_batch, agree, layout)

    def micro_batches(self, r: Rollout, index: Tensor | None = None) -> Iterator[tuple[Tensor, Rollout]]:
        """(rows of `r`, micro-batch) pairs over the rows `index` (default: all)."""
        return micro_batches(r, self.size, index, self.max_tokens, self.agree, self.layout.pack)


def mini_batches(n: int, size: int, epochs: int, pack: int = 1) -> list[Tensor]:
    """The rows of each mini-batch of `epochs` passes over n responses, shuffled anew at every
    epoch (one mini-batch: in order); runs of `pack` consecutive rows (responses to one prompt,
    `packing`) are shuffled as units and stay together."""
    if n <= size:
        return [torch.arange(n) for _ in range(epochs)]
    units = torch.arange(n).view(-1, pack)
    return [units[i].reshape(-1) for _ in range(epochs) for i in torch.randperm(len(units)).split(size // pack)]


def micro_batches(
    r: Rollout,
    size: int,
    index: Tensor | None = None,
    max_tokens: int | None = None,
    agree: Callable[[int], int] = int,
    pack: int = 1,
) -> Iterator[tuple[Tensor, Rollout]]:
    """(rows of `r`, micro-batch) pairs over the rows `index` (default: all); rows are
    grouped by length (prompt + response tokens), so `trimmed` cuts much of the padding, and
    runs of `pack` rows (one prompt's responses) stay together for a shared-prompt forward.
    The loss sums each token once over global normalisers (§4.2), so the grouping does not
    change the gradient.

    `size` responses a micro-batch, or with `max_tokens` as many as fit in that many tokens
    (rows × the longest row: what the forward's activations and logits hold), so memory stays
    flat as answers lengthen (verl's `ppo_max_token_len_per_gpu`, NeMo-RL's dynamic
    batching); a row longer than the budget goes alone. Every rank then makes as many
    micro-batches as the neediest (`agree`: the maximum over ranks), since each forward of a
    sharded model is collective."""
    index = torch.arange(len(r)) if index is None else index
    units = index.view(-1, pack)  # (units, pack)
    lengths = r.attention_mask[index].sum(-1).cpu().view(-1, pack).amax(-1)
    order = torch.argsort(lengths, stable=True)
    units, lengths = units[order], lengths[order]
    if max_tokens is None:
        groups = list(units.split(max(1, size // pack)))
    else:
        groups = token_budget_groups(lengths * pack, max_tokens, agree)
        groups = [units[g] for g in groups]
    for rows in groups:
        yield rows.reshape(-1), r.select(rows.reshape(-1)).trimmed()


def token_budget_groups(costs: Tensor, max_tokens: int, agree: Callable[[int], int] = int) -> list[Tensor]:
    """Consecutive groups of the units whose token counts `costs` (ascending) are given, each
    holding at most `max_tokens` as rows × its longest (a unit over the budget alone), in
    exactly `agree(the number this rank needs)` groups: the largest groups are halved until
    there are that many (every rank has as many units, each fitting alone, so the neediest
    rank's count never exceeds them)."""
    groups: list[list[int]] = []
    for i, cost in enumerate(costs.tolist()):  # ascending: a group's last unit is its longest
        if groups and (len(groups[-1]) + 1) * cost <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    count = agree(len(groups))
    if count > len(costs):
        raise RuntimeError(
            f"max_tokens_per_micro_batch: {count} micro-batches agreed over ranks for "
            f"{len(costs)} units on this rank (the ranks' batches differ in size)"
        )
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        half = len(groups[k]) // 2
        groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def per_token(r: Rollout) -> Tensor:
    """A zero (B, T) float tensor, one entry per response position."""
    return torch.zeros(r.response_mask.shape, device=r.response_mask.device)


def sync_gradients(model: torch.nn.Module, last: bool, ops: RankOps) -> None:
    """Whether this micro-batch's backward reduces the gradient over ranks. Replicated (ddp):
    once per mini-batch, on its last micro-batch. Sharded (FSDP2): after every micro-batch,
    so each rank holds only its shard of the gradient (verl's `dp_actor`, NeMo-RL,
    torchtitan#292); a mini-batch accumulated unsharded holds the whole model's gradient in
    fp32 on every rank, and only `ops.accumulate_unsharded` asks for it. A no-op for an
    unwrapped model."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and not ops.accumulate_unsharded:
        return  # (reduce-scatter on, FSDP2's default, never turned off)
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's and replicate's
    if callable(set_sync):
        set_sync(last)


# --------------------------------------------------------------------------- no-grad passes


class OldPolicy(NamedTuple):
    """pi_old's per-token quantities, (B, T) each, for the PPO ratio (§4.2-4.3)."""

    logprobs: Tensor | None  # log pi_old(a_t | s_t); None: the actor's own first forward
    entropy: Tensor | None  # pi_old's entropy at each position; None: not taken
    ref_logprobs: Tensor | None  # log pi_ref(a_t | s_t), only with a KL penalty


OLD_LOGPROB_SOURCES = ("recompute", "rollout", "first_forward")


class Step(NamedTuple):
    """One rollout step's experience and what the trainer estimated from it, for the metrics
    and the callbacks (torchtune's `Trajectory`)."""

    rollout: Rollout  # as sampled and scored
    old: OldPolicy
    values: Tensor | None  # (B, T) V_old; None without a critic
    advantages: Advantages


@torch.no_grad()
def compute_log_probs(
    policy: PreTrainedModel, r: Rollout, fw: Forwards, temperature: float, entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """log pi(a_t | s_t) and (with `entropy`) the entropy of pi at each response position,
    (B, T) each, under the sampling `temperature`; `policy` as the caller set it (eval)."""
    logprobs, entropies = per_token(r), per_token(r)
    for idx, micro in fw.micro_batches(r):
        lp, h = token_logprobs(policy, micro, temperature, entropy=entropy, layout=fw.layout)
        logprobs[idx, : lp.shape[1]] = lp
        if h is not None:
            entropies[idx, : lp.shape[1]] = h
    return logprobs, entropies if entropy else None


def old_policy(
    source: str,
    policy: PreTrainedModel,
    ref_policy: PreTrainedModel | None,
    r: Rollout,
    fw: Forwards,
    temperature: float,
) -> OldPolicy:
    """pi_old from `source`, one of `OLD_LOGPROB_SOURCES`: 'recompute', a no-grad pass of
    the policy (verl's default); 'rollout', the engine's own log-probs of what it sampled
    (verl's bypass mode; its entropy where the engine reports one); 'first_forward', none
    here: the actor update takes its first forward's, detached (verl's on-policy
    `old_log_prob = log_prob.detach()`, one epoch over one mini-batch). And pi_ref, a pass of
    the reference policy when there is one (a KL penalty): a frozen copy, or the policy itself
    with its adapters off (`lora.AdaptersOff`), so the policy is put in eval mode for both."""
    policy.eval()
    logprobs: Tensor | None
    entropy: Tensor | None
    if source == "recompute":
        logprobs, entropy = compute_log_probs(policy, r, fw, temperature)
    elif source == "rollout":
        logprobs, entropy = r.rollout_logprobs, r.entropy
    elif source == "first_forward":
        logprobs = entropy = None
    else:
        raise ValueError(f"pi_old source {source!r}: one of {OLD_LOGPROB_SOURCES}")
    ref = None
    if ref_policy is not None:
        ref = compute_log_probs(ref_policy, r, fw, temperature, entropy=False)[0]
    return OldPolicy(logprobs, entropy, ref)


@torch.no_grad()
def compute_values(critic: PreTrainedModel, r: Rollout, fw: Forwards) -> Tensor:
    """V(s_t) at each response position, (B, T)."""
    critic.eval()
    values = per_token(r)
    for idx, micro in fw.micro_batches(r):
        v = critic_values(critic, micro, fw.layout)
        values[idx, : v.shape[1]] = v
    return values


# --------------------------------------------------------------------------- updates


def update_critic(
    critic: PreTrainedModel,
    opt: torch.optim.Optimizer,
    r: Rollout,
    old_values: Tensor | None,
    returns: Tensor,
    batches: list[Tensor],
    algo: Algorithm,
    max_grad_norm: float,
    ops: RankOps,
    fw: Forwards | None = None,
) -> Stats:
    """`critic_updates_per_step` critic steps on each mini-batch of `batches`: `core.value_loss`
    toward `returns` (B, T) (decoupled GAE, §4.1), clipped around V_old `old_values` (B, T)
    (None: no clip, `algo.value_clip` None), over global token normalisers; forwards cut as
    `fw` says (None: `algo`'s micro-batches, in rows)."""
    fw = fw or Forwards.of(algo)
    stats: Stats = defaultdict(list)
    critic.train()
    for index in batches:
        mask = r.response_mask[index]
        n_tokens = ops.global_sum(mask.sum())  # (one all-reduce for all its steps)
        micros = list(fw.micro_batches(r, index))
        for _ in range(algo.critic_updates_per_step):
            loss_sum: Tensor | float = 0.0
            clip_sum: Tensor | float = 0.0
            for i, (rows, micro) in enumerate(micros):
                sync_gradients(critic, i == len(micros) - 1, ops)
                values, T = critic_values(critic, micro, fw.layout), micro.response_mask.shape[1]
                v_old = None if old_values is None else old_values[rows, :T]
                loss, clipfrac = core.value_loss(
                    values, v_old, returns[rows, :T], micro.response_mask, n_tokens, algo.value_clip
                )
                ops.backward(loss * ops.world_size)  # DDP / FSDP average gradients
                loss_sum += loss.detach() * ops.world_size
                clip_sum += clipfrac * micro.response_mask.sum() / mask.sum()
            stats["critic/vf_loss"].append(float(loss_sum))
            stats["critic/vf_clipfrac"].append(float(clip_sum))
            record_step(stats, "critic", clip_and_step(opt, critic, max_grad_norm))
    return stats


def update_actor(
    policy: PreTrainedModel,
    opt: torch.optim.Optimizer,
    r: Rollout,
    old: OldPolicy,
    advantages: Tensor,
    batches: list[Tensor],
    algo: Algorithm,
    temperature: float,
    max_grad_norm: float,
    ops: RankOps,
    fw: Forwards | None = None,
) -> tuple[Stats, OldPolicy]:
    """One actor step on each mini-batch of `batches`: `core.actor_loss` (clipped surrogate
    with Clip-Higher and the positive-example LM loss, §4.2-4.3) of `advantages` (B, T) against
    pi_old `old`, over global normalisers. Returns the statistics, and pi_old as the update
    read it: `old`, with what it lacked (the log-probs, on-policy; the entropy) taken from the
    update's forwards, detached. Forwards cut as `fw` says (None: `algo`'s, in rows)."""
    fw = fw or Forwards.of(algo)
    stats: Stats = defaultdict(list)
    policy.train()
    read = OldPolicy(
        per_token(r) if old.logprobs is None else old.logprobs,
        per_token(r) if old.entropy is None else old.entropy,
        old.ref_logprobs,
    )
    for index in batches:
        acc = actor_step(policy, r, old, read, advantages, index, algo, temperature, ops, fw)
        for k, v in acc.items():  # losses are this rank's share of the global sum
            stats[k].append(float(v) * (ops.world_size if k.endswith(("_loss", "entropy")) else 1))
        stats["actor/pg_clipfrac"].append(stats["actor/pg_clipfrac_high"][-1] + stats["actor/pg_clipfrac_lower"][-1])
        record_step(stats, "actor", clip_and_step(opt, policy, max_grad_norm))
    return stats, read


def actor_step(
    policy: PreTrainedModel,
    r: Rollout,
    old: OldPolicy,
    read: OldPolicy,
    advantages: Tensor,
    index: Tensor,
    a: Algorithm,
    temperature: float,
    ops: RankOps,
    fw: Forwards,
) -> dict[str, Tensor | float]:
    """The gradient of the actor loss on the rows `index` (micro-batch by micro-batch), and
    the step's metrics, token-weighted; what `old` lacks is taken from these forwards into
    `read` (pi_old as the update reads it: both tensors present)."""
    read_logprobs, read_entropy = read.logprobs, read.entropy
    if read_logprobs is None or read_entropy is None:
        raise ValueError("actor_step: `read` holds pi_old's log-probs and entropy, (B, T) each")
    mask, correct = r.response_mask[index], r.require("correct")[index]
    n_tokens = ops.global_sum(mask.sum())
    normalizers = {
        "normalizer": n_tokens
        if a.loss_agg == "token"
        else ops.global_sum(torch.tensor(len(index), device=mask.device)),
        "n_correct_tokens": ops.global_sum((mask & correct[:, None]).sum()),
    }
    micros = list(fw.micro_batches(r, index))
    acc: dict[str, Tensor | float] = defaultdict(float)
    for i, (rows, micro) in enumerate(micros):
        sync_gradients(policy, i == len(micros) - 1, ops)
        m, T = micro.response_mask, micro.response_mask.shape[1]
        # (B, T) each. The entropy: with a bonus, with its graph; without one, only its value
        # for the metric (verl's actor/entropy), pi_old's where `old` has it.
        bonus = a.entropy_coef > 0
        logprobs, entropy = token_logprobs(
            policy, micro, temperature, entropy=bonus or old.entropy is None, entropy_grad=bonus, layout=fw.layout
        )
        if old.logprobs is None:  # on-policy: this first forward is pi_old (verl's dp_actor)
            read_logprobs[rows, :T] = logprobs.detach()
        if old.entropy is None and entropy is not None:
            read_entropy[rows, :T] = entropy.detach()
        pi_old, old_entropy = read_logprobs[rows, :T], read_entropy[rows, :T]
        is_weights = None
        if a.rollout_is == "tis":  # truncated importance sampling against the engine that sampled
            if micro.rollout_logprobs is None:
                raise ValueError("rollout_is 'tis': the engine reported no log-probs of its samples")
            is_weights = rollout_correction.truncated_is_weights(pi_old, micro.rollout_logprobs, m, a.rollout_is_cap)
        loss, st = core.actor_loss(
            logprobs,
            pi_old,
            advantages[rows, :T],
            m,
            micro.require("correct"),
            **normalizers,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            clip_ratio_c=a.clip_ratio_c,
            agg=a.loss_agg,
            nll_coef=a.nll_coef,
            entropy=entropy if bonus else None,
            entropy_coef=a.entropy_coef,
            ref_logprobs=None if old.ref_logprobs is None else old.ref_logprobs[rows, :T],
            kl_coef=a.kl_coef,
            is_weights=is_weights,
        )
        ops.backward(loss * ops.world_size)
        with torch.no_grad():
            share = m.sum() / mask.sum()  # per-token means, weighted by tokens
            for k in ("pg_loss", "nll_loss", "kl_loss"):
                if k in st:
                    acc[f"actor/{k}"] += st[k]
            acc["actor/entropy"] += core.masked_sum(old_entropy, m) / n_tokens
            acc["actor/pg_clipfrac_high"] += st["clipfrac_high"] * share
            acc["actor/pg_clipfrac_lower"] += st["clipfrac_low"] * share
            acc["actor/ppo_kl"] += st["approx_kl"] * share
    return acc


def clip_and_step(opt: torch.optim.Optimizer, model: torch.nn.Module, max_norm: float) -> float:
    """Clips the gradient to `max_norm` and steps; a non-finite gradient norm skips the step
    (no bad update is ever applied). Returns the norm before clipping."""
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    if math.isfinite(norm):
        opt.step()
        # Under an autocast region that caches casts (Lightning < 2.6 runs training_step
        # so), the bf16 copies cast before this step would serve the next mini-batch's
        # forwards: stale weights. Dropped here; the next forward casts the new ones.
        torch.clear_autocast_cache()
    opt.zero_grad(set_to_none=True)
    return norm


def record_step(stats: Stats, name: str, norm: float) -> None:
    """`<name>/grad_norm` of an applied step, `<name>/update_skipped` of every step."""
    stats[f"{name}/update_skipped"].append(float(not math.isfinite(norm)))
    if math.isfinite(norm):
        stats[f"{name}/grad_norm"].append(norm)


def count_bad_steps(counts: dict[str, int], stats: Stats, limit: int) -> list[str]:
    """Updates `counts` (consecutive skipped steps of each model) from the steps in `stats`, in
    their order; returns the models whose run of skipped steps reached `limit` (counted up to
    the step that reached it)."""
    for name in counts:
        for skipped in stats.get(f"{name}/update_skipped", []):
            counts[name] = counts[name] + 1 if skipped else 0
            if counts[name] >= limit:
                break
    return [name for name in counts if counts[name] >= limit]
