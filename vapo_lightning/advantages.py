"""Advantages and critic targets of one rollout (VAPO §4.1-4.2; GRPO's group baseline).

Functions of the rollout (its rewards, V_old, lengths) and the algorithm's switches; the math
is `core`'s. Whitening takes its statistics over the valid tokens of every data-parallel rank
(`global_sum`), so ranks see one normalisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from vapo_lightning import core, critic_checks
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout

__all__ = ["actor_lambda", "actor_signal", "compute_advantages", "critic_gate", "critic_targets", "monte_carlo_returns"]


def actor_lambda(r: Rollout, a: Algorithm) -> Tensor:
    """(B,) lambda of the actor's GAE: length-adaptive (§4.2, Eq. 5) or fixed."""
    if a.length_adaptive_gae:
        return core.length_adaptive_lam(r.response_lengths, a.alpha).to(r.scores)
    return torch.full_like(r.scores, a.lam_actor)


@torch.no_grad()
def critic_targets(r: Rollout, a: Algorithm, value_pretraining: bool) -> Tensor:
    """The critic's regression targets, GAE returns (B, T) from V_old = `r.values`. Decoupled
    GAE (§4.1): with lam_critic (1: Monte-Carlo), and always Monte-Carlo while value
    pretraining (§4.1, §5.1); without decoupling, with the actor's lambda."""
    lam = 1.0 if value_pretraining else (a.lam_critic if a.decoupled_gae else actor_lambda(r, a))
    rewards = core.sparse_rewards(r.scores, r.response_mask)
    return core.gae(rewards, r.values, r.response_mask, a.gamma, lam)[1]


@torch.no_grad()
def compute_advantages(
    r: Rollout, a: Algorithm, value_pretraining: bool, global_sum: Callable[[Tensor], Tensor]
) -> None:
    """Fills `r.advantages` (B, T), and with a critic `r.lam_actor` and `r.returns`: GAE with
    the actor's lambda over V_old, or GRPO / DAPO's group-normalised outcome on every token
    (also where `a.critic_gate` finds the critic explaining too little: `r.critic_baseline`
    says which); whitened over all ranks' valid tokens if `a.whiten_advantages`."""
    mask = r.response_mask
    if a.advantage == "gae":
        r.lam_actor = actor_lambda(r, a)
        rewards = core.sparse_rewards(r.scores, mask)
        adv, _ = core.gae(rewards, r.values, mask, a.gamma, r.lam_actor)
        r.returns = critic_targets(r, a, value_pretraining)
        if a.critic_gate is not None and not value_pretraining:  # (no actor update to gate)
            r.critic_baseline = critic_gate(r, a, global_sum)
            if not r.critic_baseline.all():
                adv = (
                    core.group_normalized_advantages(r.scores, r.group_ids, a.group_std)[:, None]
                    * mask
                )
    else:
        adv = core.group_normalized_advantages(r.scores, r.group_ids, a.group_std)[:, None] * mask
    if a.whiten_advantages:
        adv = core.masked_whiten(adv, mask, global_sum(core.masked_moments(adv, mask)))
    r.advantages = adv


def monte_carlo_returns(scores: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """(B, T) the λ = 1 return G_t = Σ_k γ^k r_{t+k} of the sparse reward (R on the last
    response token, §4.1): R at every token when γ = 1; V_old cancels out at λ = 1."""
    rewards = core.sparse_rewards(scores, mask)
    return core.gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[1]


@torch.no_grad()
def critic_gate(r: Rollout, a: Algorithm, global_sum: Callable[[Tensor], Tensor]) -> Tensor:
    """EVPO's gate (arXiv 2604.19485, §4), (B,) all alike: 1 where the critic's explained variance on this
    batch, V_old against the λ = γ = 1 return over every rank's valid tokens, exceeds
    `a.critic_gate` (its variance reduction then beats the batch mean's), else 0; 0 where
    the return does not vary (nothing to explain). The same on every rank."""
    mc = monte_carlo_returns(r.scores, r.response_mask, a.gamma)
    ev = critic_checks.explained_variance(r.values, mc, r.response_mask, global_sum)
    return (ev > a.critic_gate).float().expand(len(r)).clone()  # (B,) alike; NaN > x is False


@torch.no_grad()
def actor_signal(r: Rollout, a: Algorithm) -> Tensor:
    """1 if the actor's loss has a gradient on this rank's batch, else 0: a non-zero advantage
    on some response token, or a term that does not go through the advantage (the
    positive-example LM loss with a correct response, a KL penalty, an entropy bonus). GRPO
    on a batch whose every group scored alike has none: its update would be a full forward
    and backward of a zero gradient, and AdamW's momentum and weight decay would still move
    the weights."""
    signal = bool(r.advantages[r.response_mask].ne(0).any())
    signal |= a.nll_coef > 0 and bool(r.correct.any())
    signal |= a.kl_coef > 0 or a.entropy_coef > 0
    return torch.tensor(float(signal), device=r.scores.device)
