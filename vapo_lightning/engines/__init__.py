"""Rollout engines: who samples the responses (`model.generation.engine`).

- `native`: `rollout.generate`, this package's decoding loop over the Hugging Face forward
  of the policy itself (CPU runs, tests, small models);
- `vllm`: `engines.vllm.VLLMEngine`, one vLLM engine per training process, holding a copy
  of the policy that is refreshed after every rollout step whose actor update changed it.

`RolloutEngines` is mixed into `VAPOModule`: it makes the engine on first use (after a
checkpoint was restored, so a resumed run's engine starts from the resumed weights), counts
the policy's versions (one per applied actor step) and loads the weights into the engine
when its copy is older than the policy.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vapo_lightning.config import Generation
from vapo_lightning.rewards.base import Sample
from vapo_lightning.rollout import Rollout, generate

__all__ = ["RolloutEngines"]


class RolloutEngines:
    """Mixed into VAPOModule: needs `policy`, `policy_spec`, `tokenizer`, `algo`, `gen`,
    `val_gen`, `tools`, `trainer`."""

    def _init_engines(self) -> None:
        self._vllm: Any = None
        self.policy_version = 0  # bumped by each applied actor step and by a restore
        self._engine_version = -1  # the policy version the vLLM engine holds
        self.longest_prompt = 0  # tokens; set in `setup` from the datamodule

    def check_generation(self, dm: Any) -> None:
        """Before any work: the longest prompt of the data plus max_new_tokens fits the
        policy's context (both engines), the vLLM engine can run this policy, rollout
        correction has an engine to correct for. One line each, with the numbers."""
        rows = [*getattr(dm, "train_rows", []), *getattr(dm, "val_rows", [])]
        self.longest_prompt = max((len(row["prompt_ids"]) for row in rows), default=0)
        config = self.policy.config if self.policy is not None else self.policy_spec.hf_config()
        limit = getattr(config, "max_position_embeddings", None)
        for name, gen in (("generation", self.gen), ("val_generation", self.val_gen)):
            if limit is not None and self.longest_prompt + gen.max_new_tokens > limit:
                raise ValueError(
                    f"model.{name}.max_new_tokens={gen.max_new_tokens}: with the longest prompt "
                    f"({self.longest_prompt} tokens) responses would reach "
                    f"{self.longest_prompt + gen.max_new_tokens} tokens, beyond the policy's "
                    f"context (max_position_embeddings={limit}); lower it to at most "
                    f"{limit - self.longest_prompt}"
                )
        if self.uses_vllm:
            from vapo_lightning.engines.vllm import check_setup

            new_tokens = max(self.gen.max_new_tokens, self.val_gen.max_new_tokens)
            check_setup(config, self.longest_prompt + new_tokens)
        if self.algo.rollout_is != "none" and self.gen.engine != "vllm":
            raise ValueError(
                f"model.algorithm.rollout_is={self.algo.rollout_is!r} corrects for an inference "
                "engine's sampling: it needs model.generation.engine=vllm"
            )

    @property
    def uses_vllm(self) -> bool:
        return "vllm" in (self.gen.engine, self.val_gen.engine)

    def sample(self, rows: list[dict], gen: Generation | None = None) -> Rollout:
        """n responses per prompt row from the engine `gen` names, with their `Sample`s."""
        gen = gen or self.gen
        tok = self.tokenizer
        prompts = [row["prompt_ids"] for row in rows]
        if gen.engine == "vllm":
            self.sync_engine()
            # Validation (a forked, seeded RNG) draws one seed per prompt: reproducible.
            seeds = None if self.training else torch.randint(2**31 - 1, (len(prompts),)).tolist()
            r = self._vllm.generate(
                prompts, gen, tok.pad_token_id, tok.eos_token_id, seeds=seeds, device=self.device,
                tools=self.tools, tokenizer=tok,
            )  # fmt: skip
        else:
            self.policy.eval()
            r = generate(
                self.policy, prompts, gen, tok.pad_token_id, tok.eos_token_id,
                tools=self.tools, tokenizer=tok,
            )  # fmt: skip
        texts = tok.batch_decode(r.responses, skip_special_tokens=True)
        r.samples = [
            Sample(
                prompt=rows[g]["prompt_text"],
                response=text,
                response_ids=ids[:n].tolist(),
                truncated=bool(trunc),
                ground_truth=rows[g].get("ground_truth"),
                data_source=rows[g].get("data_source", "default"),
                extra_info=rows[g].get("extra_info", {}),
            )
            for g, text, ids, n, trunc in zip(
                r.group_ids.tolist(),
                texts,
                r.responses.cpu(),
                r.response_extent.tolist(),  # (observations included)
                r.truncated.tolist(),
            )
        ]
        return r

    def sync_engine(self) -> bool:
        """Makes the vLLM engine (first call) or loads the policy's weights into it when they
        changed since its last load; a no-op otherwise and for the native engine. Collective
        under FSDP: every rank calls (their version counters agree). Returns whether it loaded."""
        if not self.uses_vllm:
            return False
        current = self._vllm is not None and self._engine_version == self.policy_version
        if current and not self._vllm.weights_stale:  # (a deep sleep discards them)
            return False
        if self._vllm is None:
            from vapo_lightning.engines.vllm import VLLMEngine

            new_tokens = max(self.gen.max_new_tokens, self.val_gen.max_new_tokens)
            options = (self.gen if self.gen.engine == "vllm" else self.val_gen).vllm
            self._vllm = VLLMEngine(
                self.policy,
                options,
                max_model_len=self.longest_prompt + new_tokens,
                dtype=engine_dtype(options.dtype, str(self.trainer.precision)),
                seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),  # per engine in VLLMEngine
                local_rank=self.trainer.local_rank,
                tokenizer=self.tokenizer if self.tools else None,  # stop strings for calls
            )
        else:
            self._vllm.load_weights(self.policy)
        self._engine_version = self.policy_version
        return True

    def close_engine(self) -> None:
        """Shuts the vLLM engine down (end of fit / validate); the next use starts a new one."""
        if self._vllm is not None:
            self._vllm.close()
            self._vllm, self._engine_version = None, -1

    def release_engine(self) -> None:
        """The models train next: a GPU engine gives its memory back (`VLLMOptions.sleep`),
        dropping its weights when the actor's update will replace them."""
        if self._vllm is not None:
            self._vllm.sleep(discard_weights=not self.actor_frozen)

    def on_validation_end(self) -> None:
        """Training goes on after validation: the engine sleeps, keeping its weights."""
        if self._vllm is not None:
            self._vllm.sleep()


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
