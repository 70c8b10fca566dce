"""One VAPO rollout step on a fixed global batch, for the parity test in test_distributed.py.

    python -m tests.distributed.distributed_worker OUT_DIR TRAIN_JSONL TOKENIZER_DIR STRATEGY DEVICES [--local-normalisers]

STRATEGY is "single" (one process, no parallelism: the reference), "ddp" or "fsdp". The
global batch is 8 prompts × 4 responses whatever the number of ranks: each of W ranks takes
8 / W prompts (the data module's sharded sampler gives the W ranks together the prompts the
single process gets), and one mini-batch holds the rank's whole batch, so every run makes
exactly one critic and one actor step on the same 32 responses. Sampling is replaced by a
scripted rollout whose responses depend only on the prompt (lengths 1..12, some ending in
EOS, some truncated), so the runs see the same responses and, per rank, different token
counts: a normaliser that is not all-reduced changes the update. Rank 0 writes the full
weights of both models (`weights.pt`) and the logged metrics (`metrics.json`).
`--local-normalisers` breaks the all-reduce of the token counts, as a negative control.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch._dynamo.utils import counters

import vapo_lightning.engines.native as native
import vapo_lightning.module as vapo_module
from tests.helpers import TINY_LLAMA
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.data import PromptDataModule
from vapo_lightning.distributed import VAPOStrategy, full_state_dict
from vapo_lightning.models import ModelSpec
from vapo_lightning.rewards.base import RewardCallback
from vapo_lightning.rollout import Rollout

PROMPTS, N, MAX_NEW = 8, 4, 12


class EvenLength(RewardCallback):
    """Correct (+1) when the response has an even number of tokens, else -1."""

    correct_threshold = 0.0

    def score(self, samples):
        return [1.0 if len(s.response_ids) % 2 == 0 else -1.0 for s in samples]


def scripted_generate(
    policy, prompt_ids, cfg, pad_token_id, eos_token_id, n=None, tools=None, tokenizer=None, logprobs=False
):
    """Stands in for `engines.native.generate` (no tools, no log-probs): the same layout,
    responses a function of the prompt."""
    assert not tools and not logprobs
    n = cfg.n if n is None else n
    P, T = max(len(p) for p in prompt_ids), cfg.max_new_tokens
    ids = torch.full((len(prompt_ids) * n, P + T), pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(ids), T), dtype=torch.bool)
    for i, p in enumerate(prompt_ids):
        for k in range(n):
            row, length = i * n + k, 1 + (7 * sum(p) + 5 * k) % T
            response = [4 + (p[-1] + 3 * j + 11 * k) % 200 for j in range(length)]
            if length < T:
                response[-1] = eos_token_id
            ids[row, P - len(p) : P] = torch.tensor(p)
            ids[row, P : P + length] = torch.tensor(response)
            attn[row, P - len(p) : P + length] = 1
            mask[row, :length] = True
    return Rollout(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask,
        group_ids=torch.arange(len(prompt_ids)).repeat_interleave(n),
        truncated=mask[:, -1] & (ids[:, -1] != eos_token_id),
    )


def main(out: Path, train: str, tokenizer: str, strategy: str, devices: int, broken: bool, compiled: bool) -> None:
    native.generate = scripted_generate  # the native engine's sampler (a missed patch fails parity)
    if broken:  # negative control: per-rank normalisers, as if nothing were all-reduced
        vapo_module.VAPOModule.global_sum = lambda self, x: x.float()
    L.seed_everything(0)
    per_rank = PROMPTS // devices
    config = {**TINY_LLAMA, "classifier_dropout": 0.0}  # the critic head's dropout off
    module = vapo_module.VAPOModule(
        policy=ModelSpec(config=config, tokenizer=tokenizer),
        algorithm=Algorithm(mini_batch_size=per_rank * N, micro_batch_size=4),
        generation=Generation(n=N, max_new_tokens=MAX_NEW),
        optim=Optim(actor_lr=1e-3, critic_lr=1e-3, warmup_steps=0),
        val_before_train=False,
        torch_compile=compiled,
    )
    data = PromptDataModule(train=train, prompts_per_step=per_rank, chat_template=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="auto" if strategy == "single" else VAPOStrategy(mode=strategy),
        max_steps=1,
        callbacks=[EvenLength()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    weights = {
        **{f"policy.{k}": v for k, v in full_state_dict(module.policy).items()},
        **{f"critic.{k}": v for k, v in full_state_dict(module.critic).items()},
    }
    if trainer.is_global_zero:
        torch.save(weights, Path(out) / "weights.pt")
        metrics = {k: float(v) for k, v in trainer.logged_metrics.items()}
        metrics["dynamo_graphs"] = counters["stats"]["unique_graphs"]  # torch_compile
        (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))


if __name__ == "__main__":
    flags = sys.argv[6:]
    main(*sys.argv[1:5], int(sys.argv[5]), "--local-normalisers" in flags, "--compile" in flags)
