"""Hand-built rollouts and the update phases run on them, recording every optimiser step's
gradients: what the tests of the updates, the packed forwards and the tools compare."""

from __future__ import annotations

import lightning as L
import torch

from tests.helpers import tiny_module
from vapo_lightning.advantages import compute_advantages
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout
from vapo_lightning.updates import (
    Forwards,
    OldPolicy,
    RankOps,
    compute_values,
    mini_batches,
    old_policy,
    update_actor,
    update_critic,
)

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
        rollout_logprobs=-2 * torch.rand(B, T, generator=g) * response_mask,  # (read with rollout_is only)
    )


def module_with(tok, micro: int, **algorithm):
    L.seed_everything(0)
    algo = Algorithm(mini_batch_size=B, micro_batch_size=micro, **algorithm)
    module = tiny_module(tok, algorithm=algo)
    module.configure_model()
    return module


def old_estimates(module, r: Rollout, source: str = "recompute") -> tuple[OldPolicy, torch.Tensor]:
    """pi_old from `source` and V_old (a no-grad pass of the critic)."""
    fw = Forwards(module.algo.micro_batch_size)
    return old_policy(source, module.policy, None, r, fw, 1.0), compute_values(module.critic, r, fw)


class Recorder:
    """An optimiser that records each step's gradients (and with `lr`, steps plain SGD)."""

    def __init__(self, name: str, model: torch.nn.Module, steps: list, lr: float = 0.0) -> None:
        self.name, self.model, self.steps, self.lr = name, model, steps, lr

    def step(self) -> None:
        self.steps.append((self.name, {n: p.grad.clone() for n, p in self.model.named_parameters()}))
        with torch.no_grad():
            for p in self.model.parameters():
                p -= self.lr * p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


NO_CLIP = float("inf")  # clip_grad_norm_ leaves the gradients as they are


def run_updates(
    module, r: Rollout, old: OldPolicy, values: torch.Tensor, frozen: bool = False, lr: float = 0.0
) -> tuple[list, dict, OldPolicy]:
    """`training_step`'s phases after pi_old and V_old on `r` (advantages, critic, actor),
    recording each optimiser step's gradients; and pi_old as the actor update read it."""
    steps, a, ops = [], module.algo, RankOps()
    batches = mini_batches(len(r), a.mini_batch_size, a.ppo_epochs)
    adv = compute_advantages(r, values, a, frozen, ops.global_sum)
    stats = dict(
        update_critic(
            module.critic,
            Recorder("critic", module.critic, steps, lr),
            r,
            values,
            adv.returns,
            batches,
            a,
            NO_CLIP,
            ops,
        )
    )
    if not frozen:
        actor_stats, old = update_actor(
            module.policy,
            Recorder("actor", module.policy, steps, lr),
            r,
            old,
            adv.advantages,
            batches,
            a,
            1.0,
            NO_CLIP,
            ops,
        )
        stats |= actor_stats
    return steps, stats, old


def rollout_with_observations(vocab: int):
    """`rollout`'s batch, with tool observations: holes in `response_mask` (context the
    models read, never actions) inside responses, one ending in one."""
    r = rollout(vocab)
    mask = r.response_mask.clone()
    mask[:, 2:4] &= torch.tensor([True, False, True, False, False, True, False, False])[:, None]
    mask[6, 5:] = False  # a response whose last tokens are an observation
    mask[:, 0] = True
    r.response_mask = mask & (r.attention_mask[:, r.prompt_length :] > 0)
    assert (~r.response_mask & (r.attention_mask[:, r.prompt_length :] > 0)).any()
    return r


G, N = 3, 4  # grouped_rollout: prompts, and responses per prompt (prompt and response widths P, T)


def grouped_rollout(vocab: int, same_prompt: bool = True, n: int = N, common: int = 0) -> Rollout:
    """G prompts of 2-6 tokens (left-padded; with `common`, more than it, all starting with the
    same `common` tokens), each answered `n` times with 1-10 tokens."""
    g = torch.Generator().manual_seed(1)
    B = G * n
    prompt_len = torch.randint(2, P + 1, (G,), generator=g).clamp(min=common + 1)
    resp_len = torch.randint(1, T + 1, (B,), generator=g)
    prompts = torch.randint(3, vocab, (G, P), generator=g)
    if common:
        start = torch.randint(3, vocab, (common,), generator=g)
        for i, length in enumerate(prompt_len.tolist()):
            prompts[i, P - length : P - length + common] = start
            prompts[i, P - length + common] = 3 + i  # the prompts differ right after it
    prompts, prompt_len = prompts.repeat_interleave(n, 0), prompt_len.repeat_interleave(n)
    if not same_prompt:
        prompts[1, -1] = (prompts[0, -1] + 1) % vocab  # row 1 answers a different prompt
    prompt_mask = torch.arange(P)[None] >= P - prompt_len[:, None]
    response_mask = torch.arange(T)[None] < resp_len[:, None]
    ids = torch.cat([prompts, torch.randint(3, vocab, (B, T), generator=g)], 1)
    attn = torch.cat([prompt_mask, response_mask], 1)
    scores = torch.randn(B, generator=g)
    return Rollout(
        input_ids=torch.where(attn, ids, torch.zeros_like(ids)),
        attention_mask=attn.long(),
        response_mask=response_mask,
        group_ids=torch.arange(B) // n,
        truncated=torch.zeros(B, dtype=torch.bool),
        scores=scores,
        correct=scores > 0,
    )
