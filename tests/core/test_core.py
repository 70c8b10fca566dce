"""The math core against slow, obvious references and docs/algorithm.md#check-vectors."""

import math

import pytest
import torch

from vapo_lightning import core
from vapo_lightning.logprobs import chunk_rows_for

# --------------------------------------------------------------------------- references


def gae_reference(rewards, values, mask, gamma, lam):
    """The textbook backward loop, one element at a time, in float64."""
    B, T = rewards.shape
    lam = torch.as_tensor(lam, dtype=torch.float64).expand(B)
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        running = 0.0
        for i in reversed(range(len(valid))):
            t = valid[i]
            next_v = float(values[b, valid[i + 1]]) if i + 1 < len(valid) else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            running = delta + gamma * float(lam[b]) * running
            adv[b, t] = running
    ret = torch.where(mask.bool(), adv + values.double(), torch.zeros_like(adv))
    return adv, ret


def scan_reference(coef, x):
    y = torch.zeros_like(x, dtype=torch.float64)
    nxt = torch.zeros(x.shape[0], dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        nxt = x[:, t].double() + coef[:, t].double() * nxt
        y[:, t] = nxt
    return y


def random_batch(B, T, seed, holes=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    if holes:  # multi-turn style masks with gaps inside the response
        mask &= torch.rand(B, T, generator=g) > 0.3
        mask[:, 0] = True
    values = torch.randn(B, T, generator=g)
    values[~mask] = 1e3  # garbage must not leak
    rewards = torch.zeros(B, T)
    rewards[mask] = torch.randn(int(mask.sum()), generator=g) * 0.1
    return rewards, values, mask, lengths


# --------------------------------------------------------------------------- GAE


def spec_batch():
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 9, 9, 9, 9], [0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]])
    mask = torch.tensor([[1] * 4 + [0] * 4, [1] * 8], dtype=torch.bool)
    rewards = core.sparse_rewards(torch.tensor([1.0, -1.0]), mask)
    return rewards, values, mask


def test_gae_spec_vectors():
    rewards, values, mask = spec_batch()
    _, ret = core.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret[0, :4], torch.ones(4))
    torch.testing.assert_close(ret[1], -torch.ones(8))
    assert ret[0, 4:].abs().sum() == 0

    adv, _ = core.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv[0, :4], torch.tensor([0.799675, 0.7365, 0.67, 0.6]), atol=1e-6, rtol=0)
    seq1 = [-0.812827, -0.750344, -0.684572, -0.615339, -0.542462, -0.46575, -0.385, -0.3]
    torch.testing.assert_close(adv[1], torch.tensor(seq1), atol=1e-6, rtol=0)

    adv, _ = core.gae(rewards, values, mask, gamma=1.0, lam=torch.tensor([0.5, 0.75]))
    torch.testing.assert_close(adv[0, :4], torch.tensor([0.25, 0.3, 0.4, 0.6]), atol=1e-6, rtol=0)
    seq1 = [-0.386652, -0.382202, -0.37627, -0.368359, -0.357812, -0.34375, -0.325, -0.3]
    torch.testing.assert_close(adv[1], torch.tensor(seq1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("B,T", [(3, 1), (5, 17), (8, 64), (4, 200), (2, 4100)])
def test_gae_matches_reference(B, T, holes):
    rewards, values, mask, lengths = random_batch(B, T, seed=B * 1000 + T, holes=holes)
    for gamma, lam in [(1.0, 0.95), (0.99, 0.0), (1.0, core.length_adaptive_lam(lengths))]:
        adv, ret = core.gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv.double(), ref_adv, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ret.double(), ref_ret, atol=2e-5, rtol=1e-5)


def test_gae_garbage_at_masked_positions_changes_nothing():
    rewards, values, mask, _ = random_batch(6, 50, seed=3, holes=True)
    adv, ret = core.gae(rewards, values, mask, 1.0, 0.9)
    values2 = values.clone()
    values2[~mask] = torch.tensor([float("nan"), float("inf"), -7.0]).repeat(100)[: int((~mask).sum())]
    adv2, ret2 = core.gae(rewards, values2, mask, 1.0, 0.9)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_lambda_one_returns_are_reward_to_go_and_lambda_zero_is_td():
    rewards, values, mask, _ = random_batch(7, 33, seed=11)
    _, ret = core.gae(rewards, values, mask, 1.0, 1.0)
    mc = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
    torch.testing.assert_close(ret, torch.where(mask, mc, torch.zeros_like(mc)), atol=1e-5, rtol=1e-5)

    adv, _ = core.gae(rewards, values, mask, 1.0, 0.0)
    next_v = torch.where(mask[:, 1:], values[:, 1:], torch.zeros_like(values[:, 1:]))
    td = rewards + torch.cat([next_v, torch.zeros(7, 1)], 1) - values
    torch.testing.assert_close(adv, torch.where(mask, td, torch.zeros_like(td)), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T,block", [(1, 4), (7, 4), (64, 8), (1000, 16), (5000, 64)])
def test_reverse_linear_scan_matches_loop(T, block):
    g = torch.Generator().manual_seed(T)
    coef, x = torch.rand(3, T, generator=g), torch.randn(3, T, generator=g)
    torch.testing.assert_close(
        core.reverse_linear_scan(coef, x, block).double(),
        scan_reference(coef, x),
        atol=1e-5,
        rtol=1e-5,
    )


def test_length_adaptive_lam():
    lam = core.length_adaptive_lam(torch.tensor([1, 20, 100, 1000, 0]), alpha=0.05)
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.8, 0.98, 0.0]))
    lengths = torch.randint(1, 5000, (100,))
    ref = torch.tensor([min(1.0, max(0.0, 1 - 1 / (0.05 * int(l)))) for l in lengths])
    torch.testing.assert_close(core.length_adaptive_lam(lengths), ref)


# --------------------------------------------------------------------------- statistics


def test_masked_statistics_match_reference():
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 9, generator=g), torch.rand(6, 9, generator=g) > 0.4
    x_gb = torch.where(mask, x, torch.full_like(x, float("nan")))
    valid = x[mask].double()
    assert math.isclose(core.masked_sum(x_gb, mask).item(), valid.sum().item(), rel_tol=1e-6)
    assert math.isclose(core.masked_mean(x_gb, mask).item(), valid.mean().item(), rel_tol=1e-6)
    row_means = torch.tensor([x[i][mask[i]].double().mean() for i in range(6)])
    torch.testing.assert_close(core.masked_mean(x_gb, mask, dim=-1).double(), row_means)
    w = core.masked_whiten(x_gb, mask)
    ref = (valid - valid.mean()) / valid.std(unbiased=True)
    torch.testing.assert_close(w[mask].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.all(w[~mask] == 0)


def test_explained_variance():
    g = torch.Generator().manual_seed(1)
    ret, mask = torch.randn(4, 10, generator=g), torch.rand(4, 10, generator=g) > 0.3
    vals = ret + 0.5 * torch.randn(4, 10, generator=g)
    r, v = ret[mask].double(), vals[mask].double()
    ref = 1 - (r - v).var() / r.var()
    assert math.isclose(core.explained_variance(vals, ret, mask).item(), ref.item(), rel_tol=1e-5)
    assert math.isclose(core.explained_variance(ret, ret, mask).item(), 1.0, abs_tol=1e-6)


def test_explained_variance_is_undefined_when_the_returns_do_not_vary():
    """Every response rewarded -1: Var[returns] = 0, so the ratio is undefined (NaN), not the
    -2e5 a division by the 1e-8 floor gave for a critic off by 0.01; a small but real spread
    is still a number."""
    mask = torch.ones(4, 6, dtype=torch.bool)
    returns, values = torch.full((4, 6), -1.0), torch.full((4, 6), -0.99)
    values[0, 0] = -1.02
    assert math.isnan(core.explained_variance(values, returns, mask).item())
    returns[0, 0] = -0.99  # one token differs: Var ~ 4e-6, defined
    ev = core.explained_variance(values, returns, mask).item()
    r, v = returns[mask].double(), values[mask].double()
    assert math.isclose(ev, (1 - (r - v).var() / r.var()).item(), rel_tol=1e-4)


def test_entropy_and_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 7, 50, generator=g) * 3
    labels = torch.randint(0, 50, (3, 7), generator=g)
    logp = torch.log_softmax(logits.double(), -1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(core.entropy_from_logits(logits, chunk_rows=4).double(), ref_ent, atol=1e-5, rtol=1e-5)
    ref_lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(core.logprobs_from_logits(logits, labels).double(), ref_lp, atol=1e-5, rtol=1e-5)


def test_logprobs_and_entropy_of_bf16_logits_are_fp32():
    """Mixed precision hands the loss bf16 logits; log-probs of bf16 logits rounded to bf16
    would put errors of ~0.01 into exp(logp - logp_old)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 300, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 300, (2, 5), generator=g)
    logp = torch.log_softmax(logits.double(), -1)  # the reference: exact math on the bf16 values
    lp = core.logprobs_from_logits(logits, labels, chunk_rows=3)
    ent = core.entropy_from_logits(logits, chunk_rows=3)
    assert lp.dtype == ent.dtype == torch.float32
    ref_lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)


def test_logprob_and_entropy_gradients_match_autograd_of_the_plain_formula():
    """Hand-written backwards (chunked, temperature applied inside) against float64 gradcheck
    and against autograd through log_softmax."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(10, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.randint(0, 7, (10,), generator=g)
    for tau in (1.0, 0.7):
        assert torch.autograd.gradcheck(
            lambda z, tau=tau: core.logprobs_from_logits(z, labels, tau, chunk_rows=3), (logits,)
        )
        assert torch.autograd.gradcheck(lambda z, tau=tau: core.entropy_from_logits(z, tau, chunk_rows=3), (logits,))
        w = torch.randn(10, generator=g, dtype=torch.float64)  # a weighted sum, like the losses
        logp = torch.log_softmax(logits / tau, -1)
        ref_lp = logp.gather(-1, labels[:, None]).squeeze(-1)
        ref_ent = -(logp.exp() * logp).sum(-1)
        for ours, ref in [
            (core.logprobs_from_logits(logits, labels, tau, chunk_rows=3), ref_lp),
            (core.entropy_from_logits(logits, tau, chunk_rows=3), ref_ent),
        ]:
            torch.testing.assert_close(ours, ref)
            (g_ours,) = torch.autograd.grad((ours * w).sum(), logits)
            (g_ref,) = torch.autograd.grad((ref * w).sum(), logits, retain_graph=True)
            torch.testing.assert_close(g_ours, g_ref)


def test_bf16_logits_are_not_copied_to_fp32_for_the_backward():
    """The saved tensors are the bf16 logits themselves and per-row statistics: an fp32 copy
    of (B, T, V) logits (152k vocab, 8k tokens: 5 GB per sequence) would double the memory."""
    logits = torch.randn(64, 40, 500).bfloat16().requires_grad_()
    labels = torch.randint(0, 500, (64, 40))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = core.logprobs_from_logits(logits, labels, 0.9, chunk_rows=256)
        ent = core.entropy_from_logits(logits, 0.9, chunk_rows=256)
    logit_bytes = logits.numel() * logits.element_size()
    per_row = 64 * 40 * 8  # int64 labels or fp32 statistics
    assert sum(saved) <= 2 * logit_bytes + 4 * per_row, (sum(saved), logit_bytes)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------- critic-free baselines


def test_group_normalized_advantages_match_reference():
    scores = torch.tensor([1.0, -1, 1, 1, 0.5, 0.5, 0.5, 2.0, -3.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 7, 7, 3, 3])
    adv = core.group_normalized_advantages(scores, groups)
    ref = torch.empty_like(scores)
    for gid in groups.unique():
        idx = groups == gid
        s = scores[idx].double()
        ref[idx] = ((s - s.mean()) / (s.std(unbiased=True) + 1e-6)).float()
    torch.testing.assert_close(adv, ref)
    assert torch.all(adv[4:7] == 0)  # an all-equal group has no signal
    torch.testing.assert_close(
        core.group_normalized_advantages(scores, groups, use_std=False)[:4],
        torch.tensor([0.5, -1.5, 0.5, 0.5]),
    )


def test_overlong_penalty():
    lengths = torch.tensor([10, 12, 16, 20, 21, 40])
    pen = core.overlong_penalty(lengths, max_len=20, cache_len=8)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0, -1.0]))


def test_kl_penalty():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(core.kl_penalty(lp, ref, "k1"), lp - ref)
    r = torch.exp(ref - lp)
    torch.testing.assert_close(core.kl_penalty(lp, ref, "k3"), r - 1 - torch.log(r))


# --------------------------------------------------------------------------- losses


def policy_loss_reference(lp, old, adv, mask, clip_low, clip_high, agg, c=None):
    per_seq, total, tokens = [], 0.0, 0
    for b in range(lp.shape[0]):
        seq = []
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(lp[b, t] - old[b, t])
            a = float(adv[b, t])
            loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            seq.append(loss)
        total += sum(seq)
        tokens += len(seq)
        per_seq.append(sum(seq) / max(len(seq), 1))
    return total / tokens if agg == "token" else sum(per_seq) / len(per_seq)


def loss_inputs(B=6, T=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    lp = (old + torch.randn(B, T, generator=g) * 0.4).requires_grad_()
    adv = torch.randn(B, T, generator=g)
    return lp, old, adv, mask


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("c", [None, 3.0])
def test_policy_loss_matches_reference(agg, c):
    lp, old, adv, mask = loss_inputs()
    norm = mask.sum() if agg == "token" else mask.shape[0]
    loss, stats = core.policy_loss(lp, old, adv, mask, norm, 0.2, 0.28, clip_ratio_c=c, agg=agg)
    ref = policy_loss_reference(lp.detach(), old, adv, mask, 0.2, 0.28, agg, c)
    assert math.isclose(loss.item(), ref, rel_tol=1e-5)
    ratio = torch.exp(lp.detach() - old)[mask]
    assert math.isclose(stats["clipfrac_high"].item(), ((ratio > 1.28) & (adv[mask] > 0)).float().mean().item())
    assert math.isclose(stats["clipfrac_low"].item(), ((ratio < 0.8) & (adv[mask] < 0)).float().mean().item())
    assert math.isclose(stats["approx_kl"].item(), (old - lp.detach())[mask].mean().item(), rel_tol=1e-5)


def test_clip_higher_is_asymmetric():
    # A positive-advantage token at ratio 1.25 is inside [0.8, 1.28] (gets gradient) but
    # outside the symmetric [0.8, 1.2] (clipped): the point of Clip-Higher.
    old = torch.zeros(1, 1)
    lp = torch.full((1, 1), math.log(1.25), requires_grad=True)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    core.policy_loss(lp, old, adv, mask, 1, clip_low=0.2, clip_high=0.28)[0].backward()
    assert lp.grad.abs().item() > 1.0
    lp.grad = None
    core.policy_loss(lp, old, adv, mask, 1, clip_low=0.2, clip_high=0.2)[0].backward()
    assert lp.grad.abs().item() == 0.0


def split_sum(fn, parts, *tensors):
    """Runs `fn` on uneven micro-batches of the given (B, ...) tensors and sums the losses."""
    total, start = 0.0, 0
    for size in parts:
        total = total + fn(*(t[start : start + size] for t in tensors))
        start += size
    return total


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_losses_invariant_to_micro_batching(agg):
    lp, old, adv, mask = loss_inputs(B=7, T=13, seed=5)
    norm = mask.sum() if agg == "token" else 7
    correct = torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    n_correct_tokens = (mask & correct[:, None]).sum()  # global, like the token count

    def total_loss(lp, old, adv, mask, correct):
        pg, _ = core.policy_loss(lp, old, adv, mask, norm, agg=agg)
        vf, _ = core.value_loss(lp, old, adv, mask, norm, clip_range=0.2, agg=agg)
        nll = core.nll_loss(lp, mask, correct, n_correct_tokens)
        return pg + vf + 0.1 * nll

    whole = total_loss(lp, old, adv, mask, correct)
    (grad_whole,) = torch.autograd.grad(whole, lp)
    split = split_sum(total_loss, [1, 4, 2], lp, old, adv, mask, correct)
    (grad_split,) = torch.autograd.grad(split, lp)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_split, grad_whole, atol=1e-7, rtol=1e-6)
    # The peer bug (each micro-batch divided by its own count) would not be invariant:
    buggy = split_sum(
        lambda lp, old, adv, mask: core.policy_loss(lp, old, adv, mask, mask.sum(), agg="token")[0],
        [1, 4, 2],
        lp,
        old,
        adv,
        mask,
    )
    assert not math.isclose(buggy.item(), core.policy_loss(lp, old, adv, mask, mask.sum())[0].item(), rel_tol=1e-3)


def test_value_loss_matches_reference():
    g = torch.Generator().manual_seed(9)
    v, old, ret = (
        torch.randn(4, 6, generator=g),
        torch.randn(4, 6, generator=g),
        torch.randn(4, 6, generator=g),
    )
    mask = torch.rand(4, 6, generator=g) > 0.3
    loss, clipfrac = core.value_loss(v, old, ret, mask, mask.sum(), clip_range=0.2)
    terms, clipped = [], 0
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        vc = old[b, t] + max(-0.2, min(0.2, float(v[b, t] - old[b, t])))
        e1, e2 = float(v[b, t] - ret[b, t]) ** 2, float(vc - ret[b, t]) ** 2
        terms.append(0.5 * max(e1, e2))
        clipped += e2 > e1
    assert math.isclose(loss.item(), sum(terms) / len(terms), rel_tol=1e-5)
    assert math.isclose(clipfrac.item(), clipped / len(terms), rel_tol=1e-6)
    unclipped, _ = core.value_loss(v, old, ret, mask, mask.sum(), clip_range=None)
    ref = 0.5 * ((v - ret)[mask] ** 2).mean()
    assert math.isclose(unclipped.item(), ref.item(), rel_tol=1e-5)
    assert torch.equal(core.value_loss(v, None, ret, mask, mask.sum(), clip_range=None)[0], unclipped)
    with pytest.raises(ValueError, match="clip_range needs the old values"):
        core.value_loss(v, None, ret, mask, mask.sum(), clip_range=0.2)


def test_nll_loss_uses_correct_responses_only():
    lp, _, _, mask = loss_inputs(B=4, T=5, seed=2)
    correct = torch.tensor([True, False, True, False])
    n = (mask & correct[:, None]).sum()
    loss = core.nll_loss(lp, mask, correct, n)
    ref = -lp.detach()[mask & correct[:, None]].mean()
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-6)
    loss.backward()
    assert torch.all(lp.grad[~correct] == 0) and torch.all(lp.grad[correct][mask[correct]] != 0)
    none = core.nll_loss(lp, mask, torch.zeros(4, dtype=torch.bool), 0)
    assert none.item() == 0.0


def test_losses_ignore_garbage_at_masked_positions_in_value_and_gradient():
    lp, old, adv, mask = loss_inputs(B=5, T=8, seed=4)
    loss, _ = core.policy_loss(lp, old, adv, mask, mask.sum())
    (g1,) = torch.autograd.grad(loss, lp)
    old2, adv2 = old.clone(), adv.clone()
    old2[~mask], adv2[~mask] = -1e30, float("nan")
    loss2, _ = core.policy_loss(lp, old2, adv2, mask, mask.sum())
    (g2,) = torch.autograd.grad(loss2, lp)
    assert torch.equal(loss, loss2) and torch.equal(g1, g2)


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_actor_loss_matches_reference(agg):
    """The assembled objective: surrogate + mu * NLL over correct tokens - entropy bonus + KL,
    each term computed by loops."""
    lp, old, adv, mask = loss_inputs(seed=3)
    g = torch.Generator().manual_seed(4)
    correct = torch.tensor([True, False, True, True, False, True])
    entropy, ref = torch.rand(*lp.shape, generator=g), old + 0.1 * torch.randn(*lp.shape, generator=g)
    norm = mask.sum() if agg == "token" else mask.shape[0]
    n_correct = (mask & correct[:, None]).sum()
    loss, stats = core.actor_loss(
        lp,
        old,
        adv,
        mask,
        correct,
        norm,
        n_correct,
        0.2,
        0.28,
        agg=agg,
        nll_coef=0.1,
        entropy=entropy,
        entropy_coef=0.01,
        ref_logprobs=ref,
        kl_coef=0.05,
    )

    def agg_ref(per_token):  # token: sum / tokens; sequence: mean of per-sequence means
        seqs = [[per_token(b, t) for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
        if agg == "token":
            return sum(map(sum, seqs)) / sum(map(len, seqs))
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)

    lpd = lp.detach()
    pg = policy_loss_reference(lpd, old, adv, mask, 0.2, 0.28, agg)
    nll_terms = [-float(lpd[b, t]) for b in range(6) for t in range(lp.shape[1]) if mask[b, t] and correct[b]]
    nll = sum(nll_terms) / len(nll_terms)
    ent = agg_ref(lambda b, t: float(entropy[b, t]))
    kl = agg_ref(lambda b, t: math.exp(ref[b, t] - lpd[b, t]) - 1 - (ref[b, t] - lpd[b, t]))
    assert math.isclose(loss.item(), pg + 0.1 * nll - 0.01 * ent + 0.05 * kl, rel_tol=1e-5)
    assert math.isclose(stats["pg_loss"].item(), pg, rel_tol=1e-5)
    assert math.isclose(stats["nll_loss"].item(), nll, rel_tol=1e-5)
    assert math.isclose(stats["kl_loss"].item(), float(kl), rel_tol=1e-4)
    bare, bare_stats = core.actor_loss(lp, old, adv, mask, correct, norm, n_correct, agg=agg, nll_coef=0.0)
    assert math.isclose(bare.item(), pg, rel_tol=1e-5) and "nll_loss" not in bare_stats
    with pytest.raises(ValueError, match="entropy_coef > 0 needs the entropy"):
        core.actor_loss(lp, old, adv, mask, correct, norm, n_correct, agg=agg, entropy_coef=0.01)
    with pytest.raises(ValueError, match="kl_coef > 0 needs the reference"):
        core.actor_loss(lp, old, adv, mask, correct, norm, n_correct, agg=agg, kl_coef=0.05)


def test_observation_tokens_are_not_steps():
    """Tokens inside a response that are context, not actions (a tool's output), are holes
    in the mask: the sparse reward lands on the last action, and advantages and returns at
    the actions equal plain GAE over the sequence with those tokens deleted, whatever the
    values at the holes. The length-adaptive lambda counts actions only."""
    g = torch.Generator().manual_seed(11)
    B, T = 5, 40
    mask = torch.arange(T)[None] < torch.tensor([40, 31, 17, 2, 25])[:, None]
    mask[:, 5:12] &= torch.tensor([True, False, True, False, False])[:, None]  # observations
    mask[2, 14:17] = False  # a response that ends in an observation: last action at 13
    scores = torch.randn(B, generator=g)
    values = torch.randn(B, T, generator=g)
    values[~mask] = float("nan")  # garbage at observation and padding positions
    rewards = core.sparse_rewards(scores, mask)
    lam = core.length_adaptive_lam(mask.sum(-1), 0.05)
    adv, ret = core.gae(rewards, values, mask, 1.0, lam)
    assert rewards[2, 13] == scores[2] and rewards.count_nonzero() == B
    for b in range(B):
        keep = mask[b].nonzero().squeeze(-1)
        n = len(keep)
        dense_mask = torch.ones(1, n, dtype=torch.bool)
        dense_rewards = core.sparse_rewards(scores[b : b + 1], dense_mask)
        ref_adv, ref_ret = gae_reference(dense_rewards, values[b : b + 1, keep], dense_mask, 1.0, lam[b : b + 1])
        torch.testing.assert_close(adv[b, keep].double(), ref_adv[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[b, keep].double(), ref_ret[0], atol=1e-5, rtol=1e-5)
        assert adv[b, ~mask[b]].eq(0).all() and ret[b, ~mask[b]].eq(0).all()


def reference_zero_spread_share(scores: list[float], group_ids: list[int]) -> float:
    groups: dict[int, set[float]] = {}
    for score, group in zip(scores, group_ids):
        groups.setdefault(group, set()).add(score)
    return sum(len(s) == 1 for s in groups.values()) / len(groups) if groups else 0.0


@pytest.mark.parametrize("seed", range(5))
def test_zero_spread_share_against_the_loop(seed):
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.randint(0, 6, (24,), generator=g) * 7  # ids need not be 0..n-1
    scores = torch.randint(0, 2, (24,), generator=g).float() * 2 - 1
    got = core.zero_spread_share(scores, group_ids)
    assert got.item() == pytest.approx(reference_zero_spread_share(scores.tolist(), group_ids.tolist()))
    # informative_groups keeps exactly the responses of the groups counted as spread
    kept = set(group_ids[core.informative_groups(scores, group_ids)].tolist())
    spread = {gid for gid in set(group_ids.tolist()) if len(set(scores[group_ids == gid].tolist())) > 1}
    assert kept == spread


def test_zero_spread_share_edges():
    assert core.zero_spread_share(torch.tensor([-1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert core.zero_spread_share(torch.tensor([-1.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])) == 0.5
    assert core.zero_spread_share(torch.tensor([]), torch.tensor([], dtype=torch.long)) == 0.0


def test_on_the_cpu_the_token_kernels_work_in_chunks_that_fit_a_cache():
    """About 2^20 logits a chunk on the CPU (21 rows of a 49,152-token vocabulary), 2^26 on
    other devices, whatever the vocabulary (a fixed 4,096 rows of Qwen2.5's 152,064 tokens
    was a 2.5 GB fp32 temporary); by default the kernels take that size and give the
    one-chunk values."""
    assert chunk_rows_for(torch.empty(0, 49152)) == 21
    assert chunk_rows_for(torch.empty(0, 50)) == 2**20 // 50
    for vocab in (49152, 152064, 262144):  # SmolLM2, Qwen2.5, Gemma 3
        rows = chunk_rows_for(torch.empty(0, vocab, device="meta"))  # (any device but the CPU)
        assert rows * vocab * 4 <= 256 * 2**20 < (rows + 1) * vocab * 4
    logits = torch.randn(3, 7, 2**18).bfloat16()  # 4 rows a chunk by default: 21 rows in 6
    labels = torch.randint(0, 2**18, (3, 7))
    whole = (core.logprobs_from_logits(logits, labels, 0.7, 21), core.entropy_from_logits(logits, 0.7, 21))
    chunked = (core.logprobs_from_logits(logits, labels, 0.7), core.entropy_from_logits(logits, 0.7))
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
