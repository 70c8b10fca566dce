"""`model.algorithm.critic_gate` (EVPO's gate, arXiv 2604.19485): the critic's GAE advantages
where its explained variance on the batch exceeds the threshold, the group mean's otherwise."""

from __future__ import annotations

import pytest
import torch

from vapo_lightning.advantages import Advantages, compute_advantages
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout


def rollout(values: str) -> tuple[Rollout, torch.Tensor]:
    """8 responses to 2 prompts; rewards 1 / 0; V_old that knows each answer's reward
    ("knows", up to a little noise) or is noise ("noise")."""
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    lengths = torch.tensor([6, 4, 5, 3, 6, 2, 4, 5])
    mask = torch.arange(T)[None] < lengths[:, None]
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    v = (
        scores[:, None] + 0.1 * torch.randn(B, T, generator=g)
        if values == "knows"
        else 3 * torch.randn(B, T, generator=g)
    )
    r = Rollout(
        input_ids=torch.zeros(B, 2 + T, dtype=torch.long),
        attention_mask=torch.ones(B, 2 + T, dtype=torch.long),
        response_mask=mask,
        group_ids=torch.arange(B) // 4,
        truncated=torch.zeros(B, dtype=torch.bool),
    )
    r.scores = scores
    return r, v * mask


def advantages(case: tuple[Rollout, torch.Tensor], **algo) -> Advantages:
    return compute_advantages(*case, Algorithm(**algo), False, torch.Tensor.float)


@pytest.mark.parametrize("whiten", [True, False])
def test_a_critic_that_explains_the_return_keeps_its_advantages(whiten):
    ungated = advantages(rollout("knows"), whiten_advantages=whiten)
    gated = advantages(rollout("knows"), critic_gate=0.0, whiten_advantages=whiten)
    assert gated.critic_baseline.tolist() == [1.0] * 8
    assert torch.equal(gated.advantages, ungated.advantages)


@pytest.mark.parametrize("whiten", [True, False])
def test_a_critic_that_explains_nothing_gives_way_to_the_group_mean(whiten):
    grpo = advantages(rollout("noise"), advantage="group", whiten_advantages=whiten)
    gated = advantages(rollout("noise"), critic_gate=0.0, whiten_advantages=whiten)
    assert gated.critic_baseline.tolist() == [0.0] * 8
    assert torch.allclose(gated.advantages, grpo.advantages)
    ungated = advantages(rollout("noise"), whiten_advantages=whiten)
    assert not torch.allclose(gated.advantages, ungated.advantages)  # the gate acted
    assert gated.returns is not None and gated.lam_actor is not None  # the critic still learns its targets


def test_the_threshold_decides_and_no_gate_changes_nothing():
    assert advantages(rollout("knows"), critic_gate=0.999).critic_baseline.tolist() == [0.0] * 8  # EV ~0.96
    assert advantages(rollout("noise")).critic_baseline is None
    with pytest.raises(ValueError, match="critic_gate"):
        Algorithm(advantage="group", critic_gate=0.0)
