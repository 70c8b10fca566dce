"""`critic_checks` against slow, obvious references (loops over tokens and prompts), and its
explained variance over 2 gloo ranks against one process over the concatenated batch."""

from __future__ import annotations

import math
import os
import statistics
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vapo_lightning import critic_checks as cc


def batch(seed: int, B: int = 12, T: int = 9, groups: int = 4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    values = torch.randn(B, T, generator=g)
    scores = torch.randint(0, 2, (B,), generator=g).float()
    returns = scores[:, None].expand(B, T) + 0.1 * torch.randn(B, T, generator=g)
    group_ids = torch.arange(B) % groups
    return values, returns, mask, scores, group_ids


def ev_reference(values, returns, mask) -> float:
    ys = [float(returns[i, t]) for i in range(len(mask)) for t in range(mask.shape[1]) if mask[i, t]]
    es = [float(returns[i, t] - values[i, t]) for i in range(len(mask)) for t in range(mask.shape[1]) if mask[i, t]]
    if len(ys) < 2 or statistics.variance(ys) < 1e-8:
        return float("nan")
    return 1 - statistics.variance(es) / statistics.variance(ys)


def test_explained_variance_matches_the_reference_and_core():
    from vapo_lightning import core

    for seed in range(5):
        values, returns, mask, *_ = batch(seed)
        got = float(cc.explained_variance(values, returns, mask))
        assert got == pytest.approx(ev_reference(values, returns, mask), abs=1e-5)
        assert got == pytest.approx(float(core.explained_variance(values, returns, mask)), abs=1e-5)
    values, _, mask, *_ = batch(0)
    assert math.isnan(float(cc.explained_variance(values, torch.ones_like(values), mask)))  # nothing to explain
    assert float(cc.explained_variance(torch.ones_like(values) * 3, values + 3, mask)) == pytest.approx(0.0, abs=1e-5)


def test_position_masks_split_each_response_into_tenths():
    mask = torch.zeros(3, 25, dtype=torch.bool)
    for i, L in enumerate((20, 10, 3)):
        mask[i, :L] = True
    masks = cc.position_masks(mask)
    for i, L in enumerate((20, 10, 3)):
        for k in (0, 5, 9):
            expected = [t for t in range(L) if (10 * t) // L == k]
            assert torch.nonzero(masks[k][i])[:, 0].tolist() == expected
    assert masks[0][:, 0].all()  # the first token of every response
    assert masks[9][0, 19] and masks[9][1, 9] and not masks[9][2].any()  # 3 tokens reach tenths 0, 3, 6


def test_calibration_is_the_correlation_over_prompts():
    g = torch.Generator().manual_seed(3)
    v0, success = torch.randn(20, generator=g), torch.randint(0, 2, (20,), generator=g).float()
    group_ids = torch.arange(20) // 4 * 7  # 5 prompts with unordered, sparse ids
    per_prompt = {}
    for v, s, gid in zip(v0.tolist(), success.tolist(), group_ids.tolist()):
        per_prompt.setdefault(gid, []).append((v, s))
    xs = [statistics.mean(v for v, _ in rows) for rows in per_prompt.values()]
    ys = [statistics.mean(s for _, s in rows) for rows in per_prompt.values()]
    assert float(cc.calibration(v0, success, group_ids)) == pytest.approx(statistics.correlation(xs, ys), abs=1e-5)
    assert math.isnan(float(cc.calibration(v0, torch.ones(20), group_ids)))


def test_baseline_shares_against_loops():
    values, _, mask, scores, group_ids = batch(4)
    shares = cc.baseline_shares(values, scores, group_ids, mask)
    R = [float(scores[i]) for i in range(len(scores)) for t in range(mask.shape[1]) if mask[i, t]]
    mean = {int(gid): float(scores[group_ids == gid].mean()) for gid in group_ids.unique()}
    resid_g = [
        float(scores[i]) - mean[int(group_ids[i])]
        for i in range(len(scores))
        for t in range(mask.shape[1])
        if mask[i, t]
    ]
    resid_c = [float(scores[i] - values[i, t]) for i in range(len(scores)) for t in range(mask.shape[1]) if mask[i, t]]
    var_r = statistics.variance(R)
    assert float(shares["group_mean"]) == pytest.approx(1 - statistics.variance(resid_g) / var_r, abs=1e-5)
    assert float(shares["critic"]) == pytest.approx(1 - statistics.variance(resid_c) / var_r, abs=1e-5)
    # a critic that knows each prompt's mean reward removes what the group mean removes
    knows = torch.tensor([mean[int(gid)] for gid in group_ids])[:, None].expand_as(values)
    assert float(cc.baseline_shares(knows, scores, group_ids, mask)["critic"]) == pytest.approx(
        float(shares["group_mean"]), abs=1e-5
    )


def _two_ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    values, returns, mask, *_ = batch(10 + rank, B=12 + 6 * rank, T=30)  # ranks of unequal size

    def global_sum(x):
        x = x.clone().float()
        dist.all_reduce(x)
        return x

    ev = cc.explained_variance(values, returns, mask, global_sum)
    by_position = cc.explained_variance_by_position(values, returns, mask, global_sum)
    torch.save({"ev": ev, **by_position}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_explained_variance_over_two_gloo_ranks_is_that_of_the_concatenated_batch():
    """Each rank holds its own batch (of different sizes); summed moments give every rank
    the one-process number over both batches, which a mean of the ranks' own ratios is not."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'init')}", os.path.join(tmp, "ev")
        mp.start_processes(_two_ranks, args=(init, out), nprocs=2, start_method="spawn")
        got = [torch.load(f"{out}.{rank}") for rank in range(2)]
    parts = [batch(10 + rank, B=12 + 6 * rank, T=30) for rank in range(2)]
    T = max(p[0].shape[1] for p in parts)
    values, returns, mask = (torch.cat([p[i] for p in parts]) for i in range(3))
    assert values.shape[1] == T
    whole = float(cc.explained_variance(values, returns, mask))
    assert whole == pytest.approx(ev_reference(values, returns, mask), abs=1e-5)
    for rank in range(2):
        assert float(got[rank]["ev"]) == pytest.approx(whole, abs=1e-5)
        for k, v in cc.explained_variance_by_position(values, returns, mask).items():
            assert not math.isnan(float(v))  # (every tenth holds tokens of several responses)
            assert float(got[rank][k]) == pytest.approx(float(v), abs=1e-5)
    each = [float(cc.explained_variance(*p[:3])) for p in parts]
    assert abs(statistics.mean(each) - whole) > 1e-3  # what averaging over ranks would have logged
