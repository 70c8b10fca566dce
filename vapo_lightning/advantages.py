"""Advantages and critic targets of one rollout (VAPO §4.1-4.2; GRPO's group baseline).

Functions of the rollout as sampled and scored (its rewards, lengths, groups), V_old and the
algorithm's switches; they return what they compute and write nothing. The math is `core`'s.
Whitening takes its statistics over the valid tokens of every data-parallel rank
(`global_sum`), so ranks see one normalisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from vapo_lightning import core, critic_checks
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout

__all__ = [
    "Advantages",
    "actor_lambda",
    "compute_advantages",
    "critic_gate",
    "critic_targets",
    "has_actor_gradient",
    "monte_carlo_returns",
]


class Advantages(NamedTuple):
    """What the advantage phase hands to both updates (torchtune's `estimate_advantages`)."""

    advantages: Tensor  # (B, T) the actor's, whitened if asked
    returns: Tensor | None  # (B, T) the critic's targets; None without a critic
    lam_actor: Tensor | None  # (B,) the actor's GAE lambda; None without a critic
    critic_baseline: Tensor | None  # (B,) 1: the critic's values are the baseline, 0: the
    # group mean's (`Algorithm.critic_gate`, alike in every row); None: no gate


def actor_lambda(r: Rollout, a: Algorithm) -> Tensor:
    """(B,) lambda of the actor's GAE: length-adaptive (§4.2, Eq. 5) or fixed."""
    if a.length_adaptive_gae:
        return core.length_adaptive_lam(r.response_lengths, a.alpha).to(r.require("scores"))
    return torch.full_like(r.require("scores"), a.lam_actor)


@torch.no_grad()
def critic_targets(r: Rollout, values: Tensor, a: Algorithm, value_pretraining: bool) -> Tensor:
    """The critic's regression targets, GAE returns (B, T) from V_old `values` (B, T).
    Decoupled GAE (§4.1): with lam_critic (1: Monte-Carlo), and always Monte-Carlo while
    value pretraining (§4.1, §5.1); without decoupling, with the actor's lambda."""
    lam = 1.0 if value_pretraining else (a.lam_critic if a.decoupled_gae else actor_lambda(r, a))
    rewards = core.sparse_rewards(r.require("scores"), r.response_mask)
    return core.gae(rewards, values, r.response_mask, a.gamma, lam)[1]


@torch.no_grad()
def compute_advantages(
    r: Rollout,
    values: Tensor | None,
    a: Algorithm,
    value_pretraining: bool,
    global_sum: Callable[[Tensor], Tensor],
) -> Advantages:
    """The actor's advantages (B, T) and, with a critic (V_old `values`, (B, T)), the critic's
    targets: GAE with the actor's lambda over V_old, or GRPO / DAPO's group-normalised outcome
    on every token (also where `a.critic_gate` finds the critic explaining too little);
    whitened over all ranks' valid tokens if `a.whiten_advantages`. The returns are taken
    before any whitening (§4.1)."""
    mask, scores = r.response_mask, r.require("scores")
    returns = lam = gate = None
    if a.advantage == "gae":
        if values is None:
            raise ValueError("advantage 'gae' needs V_old: the values of a critic")
        lam = actor_lambda(r, a)
        rewards = core.sparse_rewards(scores, mask)
        adv, _ = core.gae(rewards, values, mask, a.gamma, lam)
        returns = critic_targets(r, values, a, value_pretraining)
        if a.critic_gate is not None and not value_pretraining:  # (no actor update to gate)
            gate = critic_gate(r, values, a, global_sum)
            if not gate.all():
                adv = core.group_normalized_advantages(scores, r.group_ids, a.group_std)[:, None] * mask
    else:
        adv = core.group_normalized_advantages(scores, r.group_ids, a.group_std)[:, None] * mask
    if a.whiten_advantages:
        adv = core.masked_whiten(adv, mask, global_sum(core.masked_moments(adv, mask)))
    return Advantages(adv, returns, lam, gate)


def monte_carlo_returns(scores: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """(B, T) the λ = 1 return G_t = Σ_k γ^k r_{t+k} of the sparse reward (R on the last
    response token, §4.1): R at every token when γ = 1; V_old cancels out at λ = 1."""
    rewards = core.sparse_rewards(scores, mask)
    return core.gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[1]


@torch.no_grad()
def critic_gate(r: Rollout, values: Tensor, a: Algorithm, global_sum: Callable[[Tensor], Tensor]) -> Tensor:
    """EVPO's gate (arXiv 2604.19485, §4), (B,) all alike: 1 where the critic's explained
    variance on this batch, V_old `values` against the λ = γ = 1 return over every rank's
    valid tokens, exceeds `a.critic_gate` (its variance reduction then beats the batch
    mean's), else 0; 0 where the return does not vary (nothing to explain). The same on
    every rank."""
    if a.critic_gate is None:
        raise ValueError("critic_gate: Algorithm.critic_gate is None (no gate asked for)")
    mc = monte_carlo_returns(r.require("scores"), r.response_mask, a.gamma)
    ev = critic_checks.explained_variance(values, mc, r.response_mask, global_sum)
    return (ev > a.critic_gate).float().expand(len(r)).clone()  # (B,) alike; NaN > x is False


@torch.no_grad()
def has_actor_gradient(r: Rollout, advantages: Tensor, a: Algorithm) -> Tensor:
    """1 if the actor's loss has a gradient on this rank's batch, else 0: a non-zero advantage
    (B, T) on some response token, or a term that does not go through the advantage (the
    positive-example LM loss with a correct response, a KL penalty, an entropy bonus). GRPO
    on a batch whose every group scored alike has none: its update would be a full forward
    and backward of a zero gradient, and AdamW's momentum and weight decay would still move
    the weights."""
    signal = bool(advantages[r.response_mask].ne(0).any())
    signal |= a.nll_coef > 0 and bool(r.require("correct").any())
    signal |= a.kl_coef > 0 or a.entropy_coef > 0
    return torch.tensor(float(signal), device=advantages.device)
