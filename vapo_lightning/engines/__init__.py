"""Rollout engines: who samples the responses (`model.generation.engine`).

- `native`: `engines.native.NativeEngine`, this package's decoding loop over the Hugging Face
  forward of the policy itself (CPU runs, tests, small models);
- `vllm`: `engines.vllm.VLLMEngine`, one vLLM engine per training process, holding a copy
  of the policy that it reloads after every rollout step whose actor update changed it.

Both have the surface of `engines.base.RolloutEngine`; `make_engine` makes the one a
`Generation` names. Another engine is one file and one line in `ENGINES`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from vapo_lightning.config import Algorithm, Generation, SetupError
from vapo_lightning.engines.base import RolloutEngine
from vapo_lightning.tools.base import Tool

__all__ = ["ENGINES", "RolloutEngine", "check_generation", "engine_class", "engine_dtype", "make_engine"]

# name -> "module:class", imported on first use (vLLM is an optional dependency)
ENGINES = {
    "native": "vapo_lightning.engines.native:NativeEngine",
    "vllm": "vapo_lightning.engines.vllm:VLLMEngine",
}


def engine_class(name: str) -> type[RolloutEngine]:
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(
    gen: Generation,
    policy: torch.nn.Module,
    tokenizer: Any,
    tools: list[Tool],
    *,
    max_model_len: int,
    precision: str,
    local_rank: int,
    logprobs: bool = False,
) -> RolloutEngine:
    """The engine `gen.engine` names, sampling `policy` (whose weights it holds from now on);
    `logprobs`: its rollouts carry each sampled token's log-prob (`Rollout.rollout_logprobs`)."""
    return engine_class(gen.engine).from_generation(
        gen,
        policy,
        tokenizer,
        tools,
        max_model_len=max_model_len,
        precision=precision,
        local_rank=local_rank,
        logprobs=logprobs,
    )


def check_generation(config: Any, longest_prompt: int, gen: Generation, val_gen: Generation, algo: Algorithm) -> None:
    """Before any work: the longest prompt of the data plus max_new_tokens fits the policy's
    context (`config`), each engine can run this policy, rollout correction and pi_old from
    the rollout have an engine log-prob to read. One line each, with the numbers."""
    limit = getattr(config, "max_position_embeddings", None)
    max_model_len = longest_prompt + max(gen.max_new_tokens, val_gen.max_new_tokens)
    for name, g in (("generation", gen), ("val_generation", val_gen)):
        if limit is not None and longest_prompt + g.max_new_tokens > limit:
            raise SetupError(
                f"model.{name}.max_new_tokens={g.max_new_tokens}: with the longest prompt "
                f"({longest_prompt} tokens) responses would reach {longest_prompt + g.max_new_tokens} "
                f"tokens, beyond the policy's context (max_position_embeddings={limit}); lower it "
                f"to at most {limit - longest_prompt}"
            )
        engine_class(g.engine).check_setup(config, max_model_len)
    if algo.reads_rollout_logprobs and not engine_class(gen.engine).reports_logprobs:
        what = f"rollout_is={algo.rollout_is!r}" if algo.rollout_is != "none" else "old_logprobs='rollout'"
        raise SetupError(
            f"model.algorithm.{what} reads the engine's log-probs of its samples: "
            f"model.generation.engine={gen.engine} reports none (native and vllm do)"
        )


def engine_dtype(dtype: str, precision: str) -> torch.dtype:
    """The engine's weights dtype: `VLLMOptions.dtype`, or with 'auto' the dtype the
    trainer's forwards compute in (bf16-mixed / bf16-true: bfloat16; 16-mixed: float16)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32
