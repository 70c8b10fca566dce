"""The updates (`vapo_lightning.updates`): micro-batching is bookkeeping only (rows are grouped
by length to cut padding, and the old log-probs, values and both models' gradients equal those
of one row at a time); pi_old from the actor's first forward (on-policy) gives the gradients
of pi_old from a no-grad pass; several critic steps per actor step."""

from __future__ import annotations

import pytest
import torch

from tests.update_helpers import B, module_with, old_estimates, rollout, run_updates
from vapo_lightning import core
from vapo_lightning.advantages import compute_advantages, critic_targets
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import critic_values, policy_logits
from vapo_lightning.updates import (
    OldPolicy,
    micro_batches,
)


@pytest.mark.parametrize("micro", [1, 2, 8])
def test_old_logprobs_and_values_equal_one_row_at_a_time(tok, micro):
    module = module_with(tok, micro)
    r = rollout(module.policy.config.vocab_size)
    old, values = old_estimates(module, r)
    with torch.no_grad():
        for i in range(B):
            row = r.select([i]).trimmed()
            n = row.response_mask.shape[1]
            lp = core.logprobs_from_logits(policy_logits(module.policy, row), row.responses)
            torch.testing.assert_close(old.logprobs[i, :n], lp[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values[i, :n], critic_values(module.critic, row)[0], atol=1e-5, rtol=1e-5)


def test_micro_batches_group_rows_by_length(tok):
    module = module_with(tok, 2)
    r = rollout(module.policy.config.vocab_size)
    groups = [idx for idx, _ in micro_batches(r, 2)]
    assert sorted(torch.cat(groups).tolist()) == list(range(B))
    widths = [micro.input_ids.shape[1] for _, micro in micro_batches(r, 2)]
    total = r.attention_mask.sum(-1)
    assert [int(total[idx].max()) for idx in groups] == sorted(int(total[idx].max()) for idx in groups)
    assert sum(widths) < len(groups) * r.input_ids.shape[1]  # padding was cut


def gradients(tok, micro: int, frozen: bool = False, source: str = "recompute", **algorithm):
    """Both models' gradients of one update (pi_old from `source`, V_old from a no-grad
    pass) on the same rollout, captured before the step."""
    module = module_with(tok, micro, **algorithm)
    r = rollout(module.policy.config.vocab_size)
    old, values = old_estimates(module, r, source)
    steps, _, _ = run_updates(module, r, old, values, frozen)
    return {f"{name}.{n}": g for name, step in steps for n, g in step.items()}


def test_gradients_do_not_depend_on_the_micro_batch_split(tok):
    whole, single, pairs = gradients(tok, 8), gradients(tok, 1), gradients(tok, 2)
    assert whole.keys() == single.keys() and any(g.abs().sum() > 0 for g in whole.values())
    for k in whole:
        torch.testing.assert_close(single[k], whole[k], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(pairs[k], whole[k], atol=1e-6, rtol=1e-4)


def test_gradients_are_the_same_with_micro_batches_by_tokens(tok):
    """Micro-batches by a token budget are bookkeeping too: the gradients of the split by
    responses, and every micro-batch within the budget (rows × its longest row)."""
    whole = gradients(tok, 8)
    budgeted = gradients(tok, 8, max_tokens_per_micro_batch=40)
    for k in whole:
        torch.testing.assert_close(budgeted[k], whole[k], atol=1e-6, rtol=1e-4)
    r = rollout(module_with(tok, 8).policy.config.vocab_size)
    total = r.attention_mask.sum(-1)
    parts = [idx for idx, _ in micro_batches(r, 8, max_tokens=40)]
    assert sorted(torch.cat(parts).tolist()) == list(range(B)) and len(parts) > 1
    for idx in parts:
        assert len(idx) * int(total[idx].max()) <= 40 or len(idx) == 1


def test_token_budget_groups_against_a_slow_reference():
    """Ascending costs filled greedily to the budget; then as many groups as the ranks agree
    on, by halving the largest; every unit once, in order."""
    from vapo_lightning.updates import token_budget_groups

    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        costs = torch.sort(torch.randint(1, 60, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)).values
        budget = int(torch.randint(10, 200, (1,), generator=g))
        expected: list[list[int]] = []  # the reference: one unit at a time
        for i, c in enumerate(costs.tolist()):
            if expected and (len(expected[-1]) + 1) * c <= budget:
                expected[-1].append(i)
            else:
                expected.append([i])
        got = token_budget_groups(costs, budget)
        assert [x.tolist() for x in got] == expected
        more = min(len(costs), len(expected) + 2)  # another rank needs more
        agreed = token_budget_groups(costs, budget, agree=lambda n, more=more: max(n, more))
        assert len(agreed) == more and torch.cat(agreed).tolist() == list(range(len(costs)))
        assert all(len(x) for x in agreed)
    with pytest.raises(RuntimeError, match="micro-batches agreed"):
        token_budget_groups(torch.tensor([5, 5]), 100, agree=lambda n: 3)


ONE_PASS_CASES = {
    "vapo": {},
    "sequence-level loss": {"loss_agg": "sequence"},
    "entropy bonus": {"entropy_coef": 0.01},
    "rollout correction": {"rollout_is": "tis"},
}


@pytest.mark.parametrize("case", list(ONE_PASS_CASES))
def test_pi_old_from_the_first_forward_equals_a_pass(tok, case):
    """One epoch over one mini-batch: the actor's own first forward, detached, stands in for
    the no-grad pi_old pass (verl's on-policy shortcut); the gradients are unchanged."""
    settings = ONE_PASS_CASES[case]
    module = module_with(tok, 2, **settings)
    r = rollout(module.policy.config.vocab_size)
    old, values = old_estimates(module, r, "first_forward")
    assert old == OldPolicy(None, None, None)
    steps, stats, read = run_updates(module, r, old, values)  # (lr 0: the policy stays pi_old)
    grads = {f"{name}.{n}": g for name, step in steps for n, g in step.items()}
    want = gradients(tok, 2, **settings)
    assert grads.keys() == want.keys() and any(k.startswith("actor") for k in want)
    for k in want:
        torch.testing.assert_close(grads[k], want[k], atol=1e-6, rtol=1e-4)
    assert stats["critic/vf_clipfrac"] == [0] and stats["actor/pg_clipfrac"] == [0]
    passed, mask = old_estimates(module, r)[0], r.response_mask  # pi_old the update read: a pass's
    torch.testing.assert_close(read.logprobs[mask], passed.logprobs[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read.entropy[mask], passed.entropy[mask], atol=1e-5, rtol=1e-5)


def test_the_pi_old_source_is_chosen_once_from_the_configured_batch():
    a = Algorithm(mini_batch_size=B)
    assert a.old_logprob_source(B, reference_policy=False) == "first_forward"
    assert a.old_logprob_source(2 * B, reference_policy=False) == "recompute"  # two mini-batches
    assert a.old_logprob_source(B, reference_policy=True) == "recompute"  # a KL reference
    assert a.old_logprob_source(None, reference_policy=False) == "recompute"  # not fit
    assert Algorithm(mini_batch_size=B, one_pass=False).old_logprob_source(B, False) == "recompute"
    assert Algorithm(mini_batch_size=B, ppo_epochs=2).old_logprob_source(B, False) == "recompute"
    assert Algorithm(mini_batch_size=B, old_logprobs="rollout").old_logprob_source(2 * B, False) == "rollout"


def test_several_critic_steps_per_actor_step(tok):
    """critic_updates_per_step=2: two critic steps on the mini-batch, both against V_old
    and the same targets, then one actor step; the second step's gradient is that of the
    value loss at the once-stepped critic (checked against a manual SGD step)."""
    module = module_with(tok, 2, critic_updates_per_step=2)
    r = rollout(module.policy.config.vocab_size)
    reference = module_with(tok, 2)  # same seed: same initial critic
    ref_r = rollout(module.policy.config.vocab_size)
    old, values = old_estimates(module, r)
    lr = 0.5
    steps, stats, _ = run_updates(module, r, old, values, lr=lr)
    assert [name for name, _ in steps] == ["critic", "critic", "actor"]
    assert len(stats) and "critic/vf_loss" in stats

    # The reference: V_old and targets from the initial critic, two manual SGD steps.
    critic, mask = reference.critic, ref_r.response_mask
    with torch.no_grad():
        v_old = critic_values(critic, ref_r.trimmed())
        ref_values = torch.zeros(mask.shape)
        ref_values[:, : v_old.shape[1]] = v_old
        torch.testing.assert_close(values[mask], ref_values[mask], atol=1e-5, rtol=1e-5)
        targets = critic_targets(ref_r, ref_values, reference.algo, value_pretraining=False)
    for k in range(2):
        critic.zero_grad(set_to_none=True)
        loss, _ = core.value_loss(critic_values(critic, ref_r), ref_values, targets, mask, mask.sum(), 0.2)
        loss.backward()
        for n, p in critic.named_parameters():
            torch.testing.assert_close(steps[k][1][n], p.grad, atol=1e-6, rtol=1e-4)
        with torch.no_grad():
            for p in critic.parameters():
                p -= lr * p.grad


def test_critic_updates_per_step_must_be_positive():
    with pytest.raises(ValueError, match="critic_updates_per_step"):
        Algorithm(critic_updates_per_step=0)


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_the_actor_update_takes_the_entropy_only_for_a_bonus(tok, monkeypatch, coef):
    """Without an entropy bonus the update's forwards skip the entropy (a pass over the whole
    vocabulary) and `actor/entropy` is pi_old's, token-weighted (verl's); with one, the entropy
    keeps its graph and enters the loss."""
    import vapo_lightning.updates as updates

    module = module_with(tok, 2, entropy_coef=coef)
    r = rollout(module.policy.config.vocab_size)
    old, values = old_estimates(module, r)
    asked = []
    real = updates.token_logprobs
    monkeypatch.setattr(updates, "token_logprobs", lambda *a, **k: (asked.append(k), real(*a, **k))[1])
    _, stats, _ = run_updates(module, r, old, values)
    assert {(k["entropy"], k["entropy_grad"]) for k in asked} == {(coef > 0, coef > 0)}
    want = float(core.masked_mean(old.entropy, r.response_mask))
    assert stats["actor/entropy"] == pytest.approx([want], rel=1e-5)


def test_an_unscored_rollout_or_gae_without_values_fails_naming_what_is_missing():
    r, algo = rollout(32), Algorithm()
    values = torch.zeros(r.response_mask.shape)
    with pytest.raises(ValueError, match="needs V_old"):
        compute_advantages(r, None, algo, False, lambda x: x)
    r.scores = None
    with pytest.raises(ValueError, match="the rollout has no scores"):
        compute_advantages(r, values, algo, False, lambda x: x)
