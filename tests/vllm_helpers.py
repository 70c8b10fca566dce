"""What the vLLM engine's tests and the real model's share: the engine's options on a CPU, the
native sampler's rollouts, a real update of the policy, and the gap between the engine's
log-probs and the trainer's."""

from __future__ import annotations

import torch

from vapo_lightning import core
from vapo_lightning.config import Generation, VLLMOptions
from vapo_lightning.engines.native import generate
from vapo_lightning.rollout import policy_logits

OPTIONS = VLLMOptions(gpu_memory_utilization=0.05, kv_cache_gib=1, max_num_seqs=64)


def responses(r):
    return [row[m].tolist() for row, m in zip(r.responses, r.response_mask)]


def native(policy, prompts, tok, cfg):
    return generate(policy, prompts, cfg, tok.pad_token_id, tok.eos_token_id)


def trainer_logprobs(policy, r, temperature=1.0):
    with torch.no_grad():
        return core.logprobs_from_logits(policy_logits(policy, r), r.responses, temperature)


def real_update(policy, prompts, tok):
    """One AdamW step of the NLL of sampled answers: every weight moves."""
    r = native(policy, prompts, tok, Generation(n=2, max_new_tokens=24, temperature=1.0))
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    policy.train()
    logits = policy_logits(policy, r)
    loss = -core.masked_mean(core.logprobs_from_logits(logits, r.responses), r.response_mask)
    loss.backward()
    opt.step()
    policy.eval()


def max_logprob_gap(engine, policy, prompts, tok) -> float:
    cfg = Generation(n=2, max_new_tokens=24, temperature=1.0)
    r = engine.generate_tokens(prompts, cfg, seeds=list(range(len(prompts))))
    gap = (r.rollout_logprobs - trainer_logprobs(policy, r)).abs()
    return float(gap[r.response_mask].max())
