"""The arithmetic of VAPO (arXiv 2504.05118): pure tensor functions, no state, no logging.

Layout convention everywhere: response tensors are (B, T), right-padded, with
`response_mask` (B, T) true on generated tokens. `values[:, t]` is V(s_t), the critic's
output at the position *before* response token t (for t = 0 the last prompt position).
Section numbers refer to VAPO v3; docs/algorithm.md gives the notation, defaults and checks.

Losses take their normaliser explicitly (e.g. the number of valid tokens of the whole
mini-batch, all-reduced over ranks by the caller), so splitting a mini-batch into
micro-batches or data-parallel shards changes neither the loss nor its gradient (§4.2).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from vapo_lightning.logprobs import entropy_from_logits, logprobs_from_logits

LossAgg = Literal["token", "sequence"]

__all__ = [
    "actor_loss",
    "aggregate",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_normalized_advantages",
    "informative_groups",
    "kl_penalty",
    "length_adaptive_lam",
    "logprobs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_whiten",
    "nll_loss",
    "overlong_penalty",
    "policy_loss",
    "reverse_linear_scan",
    "sparse_rewards",
    "value_loss",
]


# --------------------------------------------------------------------------- masked statistics


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over positions where `mask` is true (garbage elsewhere never leaks)."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over valid positions; 0 where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased variance of `x` over all valid positions (0 with fewer than two)."""
    n = mask.sum()
    centred = torch.where(mask.bool(), x - masked_mean(x, mask), torch.zeros_like(x))
    return (centred**2).sum() / (n - 1).clamp(min=1)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """(3,) count, sum and sum of squares of `x` over valid positions: summed over
    data-parallel ranks, the moments of the whole batch."""
    n = mask.sum().to(x.dtype)
    return torch.stack([n, masked_sum(x, mask), masked_sum(x * x, mask)])


def masked_whiten(x: Tensor, mask: Tensor, moments: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid tokens; masked positions become 0. The mean and the
    unbiased variance come from `moments` (`masked_moments`, e.g. summed over ranks), by
    default this batch's."""
    n, s, ss = masked_moments(x, mask) if moments is None else moments
    mean = s / n
    var = (ss - n * mean * mean) / (n - 1).clamp(min=1)
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


# --------------------------------------------------------------------------- advantages (§4.1-4.2)


def length_adaptive_lam(response_lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """Length-adaptive GAE, Eq. 5: lambda_actor = 1 - 1 / (alpha * l), clamped to [0, 1].

    response_lengths: (B,) number of generated tokens l. Returns (B,) float.
    l = 20 -> 0, l = 100 -> 0.8, l = 1000 -> 0.98 for alpha = 0.05.
    """
    l = response_lengths.to(torch.get_default_dtype())
    return (1.0 - 1.0 / (alpha * l)).clamp(0.0, 1.0)


def reverse_linear_scan(coef: Tensor, x: Tensor, block: int = 64) -> Tensor:
    """y[:, t] = x[:, t] + coef[:, t] * y[:, t + 1] with y[:, T] = 0, for (B, T) inputs.

    A blocked parallel scan: within blocks of `block` steps a Hillis-Steele doubling
    (log2(block) vectorised passes), then the same scan over the blocks' first elements,
    then one pass adding each block's carry. No Python loop over T.
    """
    B, T = x.shape
    K = min(block, T)
    nb = -(-T // K)
    if nb * K != T:  # zero padding: y = 0 there, so it never reaches real positions
        x, coef = F.pad(x, (0, nb * K - T)), F.pad(coef, (0, nb * K - T))
    y = x.reshape(B, nb, K).clone()  # (B, nb, K) partial sums within each block
    a = coef.reshape(B, nb, K).clone()  # (B, nb, K) prod coef[t .. min(t + 2^k - 1, end)]
    s = 1
    while s < K:
        y[..., :-s] += a[..., :-s] * y[..., s:]  # right side evaluated before the write
        a[..., :-s] = a[..., :-s] * a[..., s:]
        s *= 2
    if nb > 1:
        # y at each block's first step, including everything after the block.
        heads = reverse_linear_scan(a[..., 0].contiguous(), y[..., 0].contiguous(), block)
        carry = F.pad(heads[:, 1:], (0, 1))  # (B, nb): y at the start of the next block
        y = y + a * carry.unsqueeze(-1)
    return y.reshape(B, nb * K)[:, :T]


def gae(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float | Tensor = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman 2016) with VAPO's per-sequence lambda.

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t);  A_t = sum_k (gamma * lam)^k delta_{t+k}.

    rewards, values, response_mask: (B, T), right-padded. lam: float or (B,) tensor (the
    length-adaptive lambda_actor of §4.2). After the last valid token V = 0 (terminal, no
    bootstrap, even when truncated). Masked positions are skipped: the recursion carries
    across them and their values (which may be garbage) never enter. Decoupled GAE (§4.1) is
    two calls: lam=lam_critic for the critic's returns, lam=lam_actor for the advantages.

    Returns (advantages, returns), both (B, T), zero at masked positions, returns =
    advantages + values; no whitening here.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    # V(s_{t+1}) of the next *valid* position (0 after the last one): a scan that carries the
    # value at the first valid position >= t backwards across masked positions.
    v_from = reverse_linear_scan((~mask).to(values.dtype), v)  # (B, T)
    next_v = F.pad(v_from[:, 1:], (0, 1))
    delta = torch.where(mask, rewards + gamma * next_v - v, zero)
    gl = gamma * torch.as_tensor(lam, dtype=values.dtype, device=values.device)
    gl = gl.reshape(-1, 1).expand_as(values) if gl.ndim else gl.expand_as(values)
    coef = torch.where(mask, gl, torch.ones_like(gl))
    advantages = torch.where(mask, reverse_linear_scan(coef, delta), zero)
    returns = torch.where(mask, advantages + v, zero)
    return advantages, returns


def sparse_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Places each sequence's scalar reward on its last valid token (VAPO "Notation").

    scores: (B,); response_mask: (B, T), right-padded, and it may have holes (tokens that
    are context, not actions, such as a tool's output): the reward goes to the last true
    position, not to position sum(mask) - 1. Returns (B, T).
    """
    mask = response_mask.bool()
    T = mask.shape[1]
    last = T - 1 - mask.flip(-1).long().argmax(-1)  # (B,) index of the last true position
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.nonzero(mask.any(-1)).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards


def group_normalized_advantages(scores: Tensor, group_ids: Tensor, use_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO / DAPO critic-free advantage: (R - mean_group) / std_group, per response.

    scores: (B,) rewards; group_ids: (B,) int, equal for responses of the same prompt.
    Unbiased std within each group (a single-response group gets advantage 0).
    Broadcast to tokens with `adv[:, None] * response_mask`.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    total = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device)
    mean = total.index_add(0, inverse, scores) / n
    centred = scores - mean[inverse]
    if not use_std:
        return centred
    sq = torch.zeros_like(total).index_add(0, inverse, centred**2)
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    return centred / (std[inverse] + eps)


def informative_groups(scores: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO's dynamic sampling filter: indices of the responses whose group's rewards are
    not all equal (a uniform group has zero group-normalised advantage). (B,) -> (K,)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if len(inverse) else 0
    hi = torch.full((n,), -torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, inverse, scores, "amax"
    )
    lo = torch.full_like(hi, torch.inf).scatter_reduce(0, inverse, scores, "amin")
    return torch.nonzero(hi[inverse] > lo[inverse]).squeeze(-1)


def zero_spread_share(scores: Tensor, group_ids: Tensor) -> Tensor:
    """The share of groups whose responses all got the same reward: no group-normalised
    advantage (GRPO, DAPO) and no reward contrast within the prompt. (B,), (B,) -> scalar."""
    groups = torch.unique(group_ids)
    if not len(groups):
        return scores.new_zeros(())
    informative = torch.unique(group_ids[informative_groups(scores, group_ids)])
    return 1.0 - scores.new_tensor(len(informative) / len(groups))


def overlong_penalty(response_lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward. (B,) lengths -> (B,) penalties.

    0 for l <= L_max - L_cache; ((L_max - L_cache) - l) / L_cache inside the cache window;
    -1 for l > L_max.
    """
    l = response_lengths.to(torch.get_default_dtype())
    soft = ((max_len - cache_len) - l) / cache_len
    return torch.where(l > max_len, -torch.ones_like(l), soft.clamp(max=0.0))


# --------------------------------------------------------------------------- per-token quantities
# logprobs_from_logits and entropy_from_logits: chunked, memory-lean kernels in `logprobs`.


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over valid tokens (1 = perfect critic); NaN,
    undefined, where the returns do not vary (Var < 1e-8: e.g. every response got the same
    reward), where dividing by ~0 would give any number (-2e5 for a critic off by 0.01)."""
    var_ret = masked_var(returns, mask)
    ev = 1.0 - masked_var(returns - values, mask) / var_ret.clamp(min=1e-8)
    return torch.where(var_ret >= 1e-8, ev, torch.full_like(ev, float("nan")))


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: Literal["k1", "k3"] = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) estimate: k1 = log r, k3 = r - 1 - log r with r = pi_ref/pi."""
    log_ratio = ref_logprobs - logprobs
    if kind == "k1":
        return -log_ratio
    return torch.exp(log_ratio) - 1.0 - log_ratio


# --------------------------------------------------------------------------- losses (§4.2-4.3)


def aggregate(loss: Tensor, mask: Tensor, agg: LossAgg, normalizer: float | Tensor) -> Tensor:
    """Reduces a (B, T) per-token loss to a scalar with an explicit global normaliser.

    "token" (token-level loss, §4.2 Eq. 7): sum over all valid tokens / `normalizer`, the
        number of valid tokens of the whole mini-batch (all micro-batches, all ranks).
    "sequence" (vanilla PPO's sample-level loss): sum over sequences of each sequence's
        token-mean / `normalizer`, the number of sequences of the whole mini-batch.
    """
    if agg == "token":
        total = masked_sum(loss, mask)
    elif agg == "sequence":
        total = masked_mean(loss, mask, dim=-1).sum()
    else:
        raise ValueError(f"loss aggregation must be 'token' or 'sequence', got {agg!r}")
    return total / torch.as_tensor(normalizer, dtype=loss.dtype, device=loss.device).clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    normalizer: float | Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
    agg: LossAgg = "token",
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with Clip-Higher (§4.3, Eq. 8), all inputs (B, T).

    L = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), r = exp(logp - old_logp).
    `clip_ratio_c` (verl's dual clip, not in the paper) bounds the loss of negative-advantage
    tokens at -A * c. `is_weights` (B, T), detached, scales each token's loss: truncated
    importance sampling against the engine that sampled (`rollout_correction.truncated_is_weights`).
    Returns (loss, stats) with stats (detached, micro-batch token means):
    clipfrac_high (r > 1 + clip_high, A > 0), clipfrac_low (r < 1 - clip_low, A < 0),
    approx_kl (mean of old_logp - logp).
    """
    # Garbage at masked positions must reach neither the loss nor the gradient.
    mask = response_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    if is_weights is not None:
        loss = loss * torch.where(mask, is_weights, torch.zeros_like(is_weights)).detach()
    with torch.no_grad():
        stats = {
            "clipfrac_high": masked_mean(((ratio > 1 + clip_high) & (advantages > 0)).float(), response_mask),
            "clipfrac_low": masked_mean(((ratio < 1 - clip_low) & (advantages < 0)).float(), response_mask),
            "approx_kl": masked_mean(-log_ratio, response_mask),
        }
    return aggregate(loss, response_mask, agg, normalizer), stats


def value_loss(
    values: Tensor,
    old_values: Tensor | None,
    returns: Tensor,
    response_mask: Tensor,
    normalizer: float | Tensor,
    clip_range: float | None = 0.2,
    agg: LossAgg = "token",
) -> tuple[Tensor, Tensor]:
    """Critic loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old_V + clip(V - old_V, +-eps).

    All inputs (B, T); `clip_range=None` disables clipping (then `old_values` is not read
    and may be None). Returns (loss, clipfrac): the fraction of valid tokens where the
    clipped term was the larger one.
    """
    mask = response_mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values))
    returns = torch.where(mask, returns, torch.zeros_like(returns))
    err = (values - returns) ** 2
    if clip_range is None:
        return aggregate(0.5 * err, response_mask, agg, normalizer), values.new_zeros(())
    if old_values is None:
        raise ValueError("value_loss: clip_range needs the old values")
    old_values = torch.where(mask, old_values, torch.zeros_like(old_values))
    v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
    err_clip = (v_clip - returns) ** 2
    loss = 0.5 * torch.maximum(err, err_clip)
    clipfrac = masked_mean((err_clip > err).float(), response_mask).detach()
    return aggregate(loss, response_mask, agg, normalizer), clipfrac


def nll_loss(logprobs: Tensor, response_mask: Tensor, correct: Tensor, normalizer: float | Tensor) -> Tensor:
    """Positive-example LM loss (§4.3, Eq. 9): token-mean NLL over correct responses only.

    logprobs, response_mask: (B, T); correct: (B,) bool. `normalizer` is the number of
    correct-response tokens of the whole mini-batch (0 gives a zero loss).
    """
    mask = response_mask.bool() & correct.bool().unsqueeze(-1)
    return aggregate(-torch.where(mask, logprobs, torch.zeros_like(logprobs)), mask, "token", normalizer)


def actor_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    correct: Tensor,
    normalizer: float | Tensor,
    n_correct_tokens: float | Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
    agg: LossAgg = "token",
    nll_coef: float = 0.1,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's objective, VAPO §4.3: the clipped surrogate with Clip-Higher (Eq. 8) plus
    mu times the positive-example LM loss (Eq. 10); optionally minus an entropy bonus and plus
    a KL penalty to a reference policy (neither is in the paper).

    logprobs, old_logprobs, advantages, response_mask: (B, T); correct: (B,) bool; entropy
    and ref_logprobs (B, T) when their coefficient is > 0. `normalizer` is the policy loss's
    (`aggregate`), `n_correct_tokens` the NLL's (`nll_loss`), both over the whole mini-batch.
    Returns (loss, stats): `policy_loss`'s stats and each term (pg_loss, nll_loss, kl_loss),
    detached.
    """
    pg, stats = policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        normalizer,
        clip_low,
        clip_high,
        clip_ratio_c,
        agg,
        is_weights,
    )
    loss, stats = pg, {**stats, "pg_loss": pg.detach()}
    if nll_coef > 0:
        nll = nll_loss(logprobs, response_mask, correct, n_correct_tokens)
        loss, stats["nll_loss"] = loss + nll_coef * nll, nll.detach()
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("actor_loss: entropy_coef > 0 needs the entropy")
        loss = loss - entropy_coef * aggregate(entropy, response_mask, agg, normalizer)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("actor_loss: kl_coef > 0 needs the reference policy's log-probs")
        kl = aggregate(kl_penalty(logprobs, ref_logprobs), response_mask, agg, normalizer)
        loss, stats["kl_loss"] = loss + kl_coef * kl, kl.detach()
    return loss, stats
