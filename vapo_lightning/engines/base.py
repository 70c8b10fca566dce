"""What every rollout engine offers the trainer, and nothing more.

An engine samples a batch of prompt rows into a `Rollout` (with the `Sample`s the rewards
read), loads the policy's weights when they changed since its last load, gives memory back
while the models train, and closes. `native` (`engines.native`: this package's sampler over
the policy itself) and `vllm` (`engines.vllm`: a vLLM copy of the policy) implement it;
another engine is one more file and one line in `engines.ENGINES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from vapo_lightning.config import Generation
from vapo_lightning.rewards.base import Sample
from vapo_lightning.rollout import Rollout
from vapo_lightning.tools.base import Tool

__all__ = ["RolloutEngine", "samples_of"]


class RolloutEngine(ABC):
    """Samples rollouts of the trainer's policy.

    Args:
        policy: the trainer's policy: sampled directly, or copied in by `sync`.
        tokenizer: the policy's (pad / EOS ids, the texts the rewards read).
        tools: tools the responses may call mid-way (`vapo_lightning.tools`).
        logprobs: whether `generate` must fill `Rollout.rollout_logprobs` (the trainer asks
            when the algorithm reads them); an engine that reports them at no cost may always.
    """

    reports_logprobs: ClassVar[bool] = False  # each sampled token's log-prob under the engine

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, tools: list[Tool], logprobs: bool = False) -> None:
        self.policy, self.tokenizer, self.tools = policy, tokenizer, list(tools)
        self.logprobs = logprobs

    @classmethod
    def from_generation(
        cls,
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
        """The engine for `gen` (its own options there), in a process training at `precision`
        on device `local_rank`, holding prompt + response of up to `max_model_len` tokens;
        `logprobs`: the sampled tokens' log-probs are read."""
        return cls(policy, tokenizer, tools, logprobs=logprobs)

    @classmethod
    def check_setup(cls, config: Any, max_model_len: int) -> None:
        """Refuses, in one line and before any work, a policy or length it cannot run."""
        return None

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], gen: Generation, reproducible: bool = False) -> Rollout:
        """n = `gen.n` responses per prompt, as token ids. `reproducible`: validation, whose
        draws must not depend on the engine's own stream (the trainer seeds torch's)."""

    def sample(self, rows: list[dict], gen: Generation, reproducible: bool = False) -> Rollout:
        """`generate` on the rows' `prompt_ids`, with a `Sample` per response for the rewards."""
        r = self.generate([row["prompt_ids"] for row in rows], gen, reproducible)
        r.samples = samples_of(r, rows, self.tokenizer)
        return r

    def policy_changed(self) -> None:  # noqa: B027 (a no-op unless overridden)
        """The policy's weights changed (an applied actor step, a restored checkpoint)."""

    def sync(self) -> bool:
        """Loads the policy's weights if they changed since the last load (an engine holding
        a copy); collective under FSDP, every rank calls. Returns whether it loaded."""
        return False

    def release(self, keep_weights: bool) -> None:  # noqa: B027 (a no-op unless overridden)
        """The models train next: memory the engine holds may go back to them. `keep_weights`
        when the update will not change the policy (value pretraining)."""

    def close(self) -> None:  # noqa: B027 (a no-op unless overridden)
        """Frees what the engine holds; the trainer makes a new one on next use."""


def samples_of(r: Rollout, rows: list[dict], tokenizer: Any) -> list[Sample]:
    """What the rewards read of each response: its text (special tokens removed), its ids up
    to the end of its last token or observation, and its prompt row's fields."""
    texts = tokenizer.batch_decode(r.responses, skip_special_tokens=True)
    return [
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
