"""Rollout correction (engine vs trainer) against slow, obvious references."""

import math

import torch

from vapo_lightning import core, rollout_correction


def batch(seed: int, B: int = 5, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * 0.8  # engine and trainer disagree
    old[~mask], rollout[~mask] = 1e3, -1e3  # garbage at masked positions
    return old, rollout, mask


def test_truncated_is_weights_against_a_loop():
    old, rollout, mask = batch(0)
    w = rollout_correction.truncated_is_weights(old, rollout, mask, cap=2.0)
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            want = min(math.exp(float(old[b, t]) - float(rollout[b, t])), 2.0) if mask[b, t] else 0.0
            assert abs(float(w[b, t]) - want) < 1e-5
    assert (w[mask] == 2.0).any() and (w[mask] < 1).any()  # the cap and the shrink both occur
    assert torch.isfinite(w).all()


def test_probs_diff_against_a_loop():
    old, rollout, mask = batch(1)
    d = rollout_correction.probs_diff(old, rollout, mask)
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            want = abs(math.exp(float(old[b, t])) - math.exp(float(rollout[b, t]))) if mask[b, t] else 0.0
            assert abs(float(d[b, t]) - want) < 1e-6


def test_policy_loss_with_is_weights_scales_each_token():
    old, rollout, mask = batch(2)
    old = torch.where(mask, old, torch.zeros_like(old))
    g = torch.Generator().manual_seed(3)
    logprobs = (old + torch.randn(old.shape, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(old.shape, generator=g)
    n = mask.sum()
    w = rollout_correction.truncated_is_weights(old, rollout, mask, cap=2.0)
    plain, _ = core.policy_loss(logprobs, old, adv, mask, n)
    ones, _ = core.policy_loss(logprobs, old, adv, mask, n, is_weights=torch.ones_like(old))
    assert torch.allclose(plain, ones)
    weighted, _ = core.policy_loss(logprobs, old, adv, mask, n, is_weights=w)
    total = 0.0  # slow reference: each token's clipped surrogate times its weight
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(float(logprobs[b, t]) - float(old[b, t]))
            a = float(adv[b, t])
            surrogate = max(-a * r, -a * min(max(r, 0.8), 1.28))
            total += surrogate * float(w[b, t])
    assert abs(float(weighted) - total / int(n)) < 1e-5
    # The weights carry no gradient of their own: d loss / d logprobs is w times the plain one.
    (g_w,) = torch.autograd.grad(weighted, logprobs)
    (g_p,) = torch.autograd.grad(plain, logprobs)
    assert torch.allclose(g_w, g_p * w, atol=1e-6)
    assert not torch.allclose(weighted, plain)
