"""The native engine: this package's sampler (`engines.sampler`) over the trainer's own policy.

No copy of the weights: the policy it samples is the one the updates change, so there is
nothing to sync. `generate` is the single-turn path (KV cache grown in place, finished rows
leave the batch); `generate_turns` the multi-turn one, calling tools mid-response.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from vapo_lightning.config import Generation
from vapo_lightning.engines.base import RolloutEngine
from vapo_lightning.engines.sampler import (
    Sampled,
    StopText,
    calls_in_lock_step,
    gathered_weights,
    sample_responses,
    token_texts,
)
from vapo_lightning.lora import MergedCopy, is_lora
from vapo_lightning.rollout import Rollout, assemble, left_padded, sample_turns
from vapo_lightning.tools.base import Tool
from vapo_lightning.tools.turns import Segment

__all__ = ["NativeEngine", "generate", "generate_turns"]


class NativeEngine(RolloutEngine):
    """Samples the trainer's policy in place (CPU runs, tests, small models). A LoRA policy (not
    sharded) is sampled from a copy with its adapters merged in (`lora.MergedCopy`), refreshed
    after each change of the policy: through peft's unmerged layers each decoding step runs the
    adapters' two small matmuls beside every base one. Its log-probs of the sampled tokens cost
    a log-softmax per step: computed only when `logprobs` asks."""

    reports_logprobs = True

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, tools: list[Tool], logprobs: bool = False) -> None:
        super().__init__(policy, tokenizer, tools, logprobs)
        sharded = any(hasattr(p, "full_tensor") for p in policy.parameters())
        self.merged = MergedCopy(policy) if is_lora(policy) and not sharded else None

    def policy_changed(self) -> None:
        if self.merged is not None:
            self.merged.stale = True

    def sync(self) -> bool:
        return self.merged is not None and self.merged.refresh()

    def generate(self, prompt_ids: list[list[int]], gen: Generation, reproducible: bool = False) -> Rollout:
        self.policy.eval()
        model, tok = self.policy if self.merged is None else self.merged.model, self.tokenizer
        return generate(
            model,
            prompt_ids,
            gen,
            tok.pad_token_id,
            tok.eos_token_id,
            tools=self.tools,
            tokenizer=tok,
            logprobs=self.logprobs,
        )


@torch.no_grad()
def generate(
    policy: PreTrainedModel,
    prompt_ids: list[list[int]],
    cfg: Generation,
    pad_token_id: int,
    eos_token_id: int,
    n: int | None = None,
    tools: list[Tool] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    logprobs: bool = False,
) -> Rollout:
    """Samples `n` responses for each prompt (`engines.sampler.sample_responses`: KV cache grown in
    place, finished responses leave the batch); stops at EOS (or any of
    ``cfg.stop_token_ids``), ``cfg.max_batch_size`` sequences per call.

    temperature 0 means greedy. Tokens after the first stop token become padding. With
    `tools` (and their `tokenizer`), responses call them mid-way: `generate_turns`. With
    `logprobs`, each sampled token's log-prob under the sampler (`Rollout.rollout_logprobs`)
    and the entropy where it was drawn (`Rollout.entropy`, pi_old's; multi-turn: log-probs
    only).
    """
    if tools:
        return generate_turns(policy, prompt_ids, cfg, tokenizer, tools, n, logprobs)
    n = cfg.n if n is None else n
    if not prompt_ids:  # (sharded, the other ranks would wait for this one forever)
        raise ValueError("generate: no prompts (every rank must sample at least one)")
    device = next(policy.parameters()).device
    ids, attn = left_padded(prompt_ids, n, pad_token_id, device)
    stop = sorted({eos_token_id, *cfg.stop_token_ids})
    chunk = cfg.max_batch_size or len(ids)

    def sample(rows: slice, lock_step: bool) -> Sampled:
        out = sample_responses(
            policy,
            ids[rows],
            attn[rows],
            max_new_tokens=cfg.max_new_tokens,
            min_new_tokens=cfg.min_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_token_ids=stop,
            pad_token_id=pad_token_id,
            lock_step=lock_step,
            logprobs=logprobs,
        )
        return out if logprobs else Sampled(out, None, None)

    starts = range(0, len(ids), chunk)
    with gathered_weights(policy, cfg.gather_weights) as lock_step:
        # Sharded and not gathered: ranks with fewer prompts (DAPO's later rounds) make the
        # extra calls of the busiest rank on one row, discarded: every rank, the same forwards.
        extra = calls_in_lock_step(policy, len(starts)) - len(starts) if lock_step else 0
        parts = [sample(slice(i, i + chunk), lock_step) for i in starts]
        for _ in range(extra):
            sample(slice(0, 1), lock_step)
    T = max(p.tokens.shape[1] for p in parts)
    pad = lambda x, value: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)  # noqa: E731
    response = torch.cat([pad(p.tokens, pad_token_id) for p in parts])  # (B, T); chunks stop at different lengths
    r = assemble(ids, attn, response, stop, pad_token_id, n)
    if logprobs:  # pi_old as sampled: the log-prob of each token and the entropy where it was drawn
        r.rollout_logprobs = torch.cat([pad(p.logprobs, 0.0) for p in parts]) * r.response_mask
        r.entropy = torch.cat([pad(p.entropy, 0.0) for p in parts]) * r.response_mask
    return r


@torch.no_grad()
def generate_turns(
    policy: PreTrainedModel,
    prompt_ids: list[list[int]],
    cfg: Generation,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[Tool],
    n: int | None = None,
    logprobs: bool = False,
) -> Rollout:
    """`generate` with tool calls (`tools.turns.run_turns`) on this package's sampler.

    Each round samples the open responses from their whole context (prompt, model tokens and
    observations so far): the KV cache of a paused response is rebuilt by one prefill, not
    kept.
    """
    n = cfg.n if n is None else n
    if cfg.min_new_tokens:
        raise ValueError("model.generation.min_new_tokens must be 0 with model.tools")
    device = next(policy.parameters()).device
    stop = sorted({tokenizer.eos_token_id, *cfg.stop_token_ids})
    texts, markers = token_texts(tokenizer), [tool.call_end for tool in tools]

    def sample(contexts: list[list[int]], budgets: list[int], pause: list[bool], rows: list[int]) -> list[Segment]:
        segments, chunk = [], cfg.max_batch_size or len(contexts)
        for i in range(0, len(contexts), chunk):
            ids, attn = left_padded(contexts[i : i + chunk], 1, tokenizer.pad_token_id, device)
            stop_text = StopText(texts, markers, pause[i : i + chunk])
            out = sample_responses(
                policy,
                ids,
                attn,
                max_new_tokens=max(budgets[i : i + chunk]),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop_token_ids=stop,
                pad_token_id=tokenizer.pad_token_id,
                lock_step=False,
                stop_text=stop_text,
                logprobs=logprobs,
            )
            out, lps = (out.tokens, out.logprobs) if logprobs else (out, None)
            for k, row in enumerate(out.tolist()):
                ends = [j + 1 for j, token in enumerate(row) if token in stop][:1]
                end = stop_text.lengths.get(k, ends[0] if ends else len(row))
                segments.append(Segment(row[:end], lps[k, :end].tolist() if logprobs else None))
        return segments

    with gathered_weights(policy, cfg.gather_weights) as lock_step:
        if lock_step:  # ranks would make different numbers of forwards
            raise ValueError("model.tools with a sharded policy needs model.generation.gather_weights=true")
        return sample_turns(sample, prompt_ids, cfg, tokenizer, tools, n, device)
