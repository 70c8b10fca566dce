"""Rollout correction: the inference engine's sampling distribution against the trainer's.

An engine (vLLM) and the trainer compute the same policy with different kernels, so the
distribution the responses were sampled from, pi_engine, is not exactly the pi_old the update
divides by, more so in bf16. Two pure functions over (B, T) response tokens:

- `probs_diff`: |p_engine - p_trainer| per sampled token (verl's
  `training/rollout_probs_diff_mean` / `_max`), the metric that shows the mismatch;
- `truncated_is_weights`: truncated importance sampling (TIS; Yao et al. 2025, "Your efficient
  RL framework secretly brings you off-policy RL training"; verl's rollout correction):
  w_t = min(pi_old(a_t | s_t) / pi_engine(a_t | s_t), C), detached, multiplying each token's
  clipped surrogate (`core.policy_loss(is_weights=...)`), so the gradient estimates the
  trainer's policy although the engine sampled.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["probs_diff", "truncated_is_weights"]


def probs_diff(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """(B, T) |exp(log pi_engine) - exp(log pi_trainer)| on response tokens, 0 elsewhere."""
    mask = response_mask.bool()
    diff = (old_logprobs.float().exp() - rollout_logprobs.float().exp()).abs()
    return torch.where(mask, diff, torch.zeros_like(diff))


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, cap: float = 2.0
) -> Tensor:
    """(B, T) TIS weights min(exp(old_logprobs - rollout_logprobs), cap) on response tokens,
    0 elsewhere (garbage at masked positions never reaches the loss). No gradient flows: the
    weight corrects the sampling distribution, it is not optimised."""
    mask = response_mask.bool()
    log_w = old_logprobs.float() - rollout_logprobs.float()
    log_w = torch.where(mask, log_w, torch.zeros_like(log_w))
    return torch.where(mask, log_w.exp().clamp(max=cap), torch.zeros_like(log_w))
