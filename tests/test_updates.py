"""The updates (`vapo_lightning.updates`): micro-batching is bookkeeping only (rows are grouped
by length to cut padding, and the old log-probs, values and both models' gradients equal those
of one row at a time); the one-pass path gives the two-pass gradients; several critic steps
per actor step."""

from __future__ import annotations

from collections import defaultdict

import lightning as L
import pytest
import torch

from tests.helpers import tiny_module
from vapo_lightning import core
from vapo_lightning.config import Algorithm
from vapo_lightning.metrics import PhaseTimer
from vapo_lightning.rollout import Rollout, critic_values, policy_logits

B, P, T = 8, 6, 10



def rollout(vocab: int) -> Rollout:
    """Prompts of 2-6 tokens (left-padded), responses of 1-10 tokens (right-padded)."""
    g = torch.Generator().manual_seed(0)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    resp_len = torch.randint(1, T + 1, (B,), generator=g)
    prompt_mask = torch.arange(P)[None] >= P - prompt_len[:, None]
    response_mask = torch.arange(T)[None] < resp_len[:, None]
    ids = torch.randint(3, vocab, (B, P + T), generator=g)
    attn = torch.cat([prompt_mask, response_mask], 1)
    ids = torch.where(attn, ids, torch.zeros_like(ids))
    scores = torch.randn(B, generator=g)
    return Rollout(
        input_ids=ids,
        attention_mask=attn.long(),
        response_mask=response_mask,
        group_ids=torch.arange(B) // 4,
        truncated=torch.zeros(B, dtype=torch.bool),
        scores=scores,
        correct=scores > 0,
    )


def module_with(tok, micro: int, **algorithm):
    L.seed_everything(0)
    algo = Algorithm(mini_batch_size=B, micro_batch_size=micro, **algorithm)
    module = tiny_module(tok, algorithm=algo)
    module.configure_model()
    module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    return module


@pytest.mark.parametrize("micro", [1, 2, 8])
def test_old_logprobs_and_values_equal_one_row_at_a_time(tok, micro):
    module = module_with(tok, micro)
    r = rollout(module.policy.config.vocab_size)
    module.compute_old_logprobs(r)
    module.compute_values(r)
    with torch.no_grad():
        for i in range(B):
            row = r.select([i]).trimmed()
            n = row.response_mask.shape[1]
            lp = core.logprobs_from_logits(policy_logits(module.policy, row), row.responses)
            torch.testing.assert_close(r.old_logprobs[i, :n], lp[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r.values[i, :n], critic_values(module.critic, row)[0], atol=1e-5, rtol=1e-5)


def test_micro_batches_group_rows_by_length(tok):
    module = module_with(tok, 2)
    r = rollout(module.policy.config.vocab_size)
    groups = [idx for idx, _ in module.micro_batches(r)]
    assert sorted(torch.cat(groups).tolist()) == list(range(B))
    widths = [micro.input_ids.shape[1] for _, micro in module.micro_batches(r)]
    total = r.attention_mask.sum(-1)
    assert [int(total[idx].max()) for idx in groups] == sorted(int(total[idx].max()) for idx in groups)
    assert sum(widths) < len(groups) * r.input_ids.shape[1]  # padding was cut


def capture_gradients(module) -> dict[str, torch.Tensor]:
    """Plain backward, and each optimizer step replaced by a copy of the gradients."""
    grads = {}

    def capture(opt, model, name, stats):
        for n, p in model.named_parameters():
            grads[f"{name}.{n}"] = p.grad.clone()
        model.zero_grad(set_to_none=True)

    module.manual_backward = lambda loss: loss.backward()
    module.clip_and_step = capture
    return grads


def gradients(tok, micro: int, keep: bool = False, frozen: bool = False, **algorithm):
    """Both models' gradients of one two-pass update (no-grad old log-probs and values
    first) on the same rollout, captured before the step; with keep, the rollout too."""
    module = module_with(tok, micro, **algorithm)
    module.actor_frozen = frozen
    r = rollout(module.policy.config.vocab_size)
    module.compute_old_logprobs(r)
    module.compute_values(r)
    module.compute_advantages(r)
    grads = capture_gradients(module)
    module.critic_update(r, torch.arange(B), None, defaultdict(list))
    if not frozen:
        module.actor_update(r, torch.arange(B), None, defaultdict(list))
    return (grads, r) if keep else grads


def test_gradients_do_not_depend_on_the_micro_batch_split(tok):
    whole, single, pairs = gradients(tok, 8), gradients(tok, 1), gradients(tok, 2)
    assert whole.keys() == single.keys() and any(g.abs().sum() > 0 for g in whole.values())
    for k in whole:
        torch.testing.assert_close(single[k], whole[k], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(pairs[k], whole[k], atol=1e-6, rtol=1e-4)


class NoScheduler:
    def step(self) -> None:
        pass


# Critic targets that depend on V_old (lambda < 1) as well as the Monte-Carlo default.
ONE_PASS_CASES = {
    "vapo": {},
    "coupled GAE": {"decoupled_gae": False},
    "lam_critic 0.9": {"lam_critic": 0.9},
    "no value clip": {"value_clip": None},
    "value pretraining": {"frozen": True},
}


@pytest.mark.parametrize("case", list(ONE_PASS_CASES))
def test_one_pass_update_equals_the_two_pass_update(tok, case):
    """One epoch over one mini-batch: the updates' own forwards stand in for the no-grad
    old-log-prob and value passes; gradients, values, advantages and targets are unchanged."""
    settings = dict(ONE_PASS_CASES[case])
    frozen = settings.pop("frozen", False)
    module = module_with(tok, 2, **settings)
    module.actor_frozen = frozen
    r = rollout(module.policy.config.vocab_size)
    assert module.is_one_pass(r)
    module.optimizers = lambda: [None, None]
    module.lr_schedulers = lambda: [NoScheduler(), NoScheduler()]
    grads = capture_gradients(module)
    stats = module.update(r, PhaseTimer())
    want, two = gradients(tok, 2, keep=True, frozen=frozen, **settings)
    assert grads.keys() == want.keys() and any(k.startswith("actor") for k in want) != frozen
    for k in want:
        torch.testing.assert_close(grads[k], want[k], atol=1e-6, rtol=1e-4)
    mask = r.response_mask
    for field in ["old_logprobs", "entropy", "values", "returns", "advantages"]:
        torch.testing.assert_close(getattr(r, field)[mask], getattr(two, field)[mask], atol=1e-5, rtol=1e-5)
    assert stats["critic/vf_clipfrac"] == 0 and stats.get("actor/pg_clipfrac", 0) == 0
    assert not module.is_one_pass(r.select(torch.arange(B).repeat(2)))  # two mini-batches


@pytest.mark.parametrize("one_pass", [True, False])
def test_several_critic_steps_per_actor_step(tok, one_pass):
    """critic_updates_per_step=2: two critic steps on the mini-batch, both against V_old
    and the same targets, then one actor step; the second step's gradient is that of the
    value loss at the once-stepped critic (checked against a manual SGD step)."""
    module = module_with(tok, 2, critic_updates_per_step=2)
    r = rollout(module.policy.config.vocab_size)
    reference = module_with(tok, 2)  # same seed: same initial critic
    ref_r = rollout(module.policy.config.vocab_size)
    if not one_pass:
        for m, x in [(module, r), (reference, ref_r)]:
            m.compute_old_logprobs(x)
            m.compute_values(x)
            m.compute_advantages(x)
    assert module.is_one_pass(r)
    lr, steps = 0.5, []

    def sgd(opt, model, name, stats):  # a plain SGD step, recording each model's gradients
        steps.append((name, {n: p.grad.clone() for n, p in model.named_parameters()}))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        model.zero_grad(set_to_none=True)

    module.manual_backward = lambda loss: loss.backward()
    module.clip_and_step = sgd
    module.optimizers = lambda: [None, None]
    module.lr_schedulers = lambda: [NoScheduler(), NoScheduler()]
    values_before = None if one_pass else r.values.clone()
    stats = module.update(r, PhaseTimer())
    assert [name for name, _ in steps] == ["critic", "critic", "actor"]
    assert len(stats) and "critic/vf_loss" in stats

    # The reference: V_old and targets from the initial critic, two manual SGD steps.
    critic, mask = reference.critic, ref_r.response_mask
    with torch.no_grad():
        v_old = critic_values(critic, ref_r.trimmed())
        ref_r.values = torch.zeros(mask.shape)
        ref_r.values[:, : v_old.shape[1]] = v_old
        if values_before is not None:
            torch.testing.assert_close(values_before[mask], ref_r.values[mask], atol=1e-5, rtol=1e-5)
        targets = reference.critic_targets(ref_r)
    for k in range(2):
        critic.zero_grad(set_to_none=True)
        loss, _ = core.value_loss(critic_values(critic, ref_r), ref_r.values, targets, mask, mask.sum(), 0.2)
        loss.backward()
        for n, p in critic.named_parameters():
            torch.testing.assert_close(steps[k][1][n], p.grad, atol=1e-6, rtol=1e-4)
        with torch.no_grad():
            for p in critic.parameters():
                p -= lr * p.grad
    torch.testing.assert_close(r.values[mask], ref_r.values[mask], atol=1e-5, rtol=1e-5)


def test_critic_updates_per_step_must_be_positive():
    with pytest.raises(ValueError, match="critic_updates_per_step"):
        Algorithm(critic_updates_per_step=0)
