"""Loads a saved checkpoint under `--trainer.strategy=fsdp` and records what each rank holds,
for the rank-0-load test in test_distributed.py.

    python -m tests.distributed.load_worker OUT_DIR CHECKPOINT_DIR DEVICES

`VAPOModule.configure_model` builds the policy (from CHECKPOINT_DIR, tokenizer included) and
the critic (the policy's backbone, a fresh value head); `parallelize` shards both and
broadcasts rank 0's weights. Training stops before the first step (`max_steps=0`): at
`on_fit_start` every rank writes `rank{R}.pt` with its gathered full state dicts, its buffers,
greedy tokens from one sharded `generate`, the critic's values, and what it held before
sharding: how many `from_pretrained` calls it made and how many parameter elements it had off
the meta device. Last, greedy responses from the project's sampler (`rollout.generate`, one
sequence per call) with a different number of prompts per rank, as DAPO's later dynamic-sampling
rounds have: rank 0 two prompts, rank 1 one, so rank 1 must make a dummy call to keep the
sharded forwards in lock step (without it, rank 0 waits forever in its second call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

import vapo_lightning.distributed as vapo_distributed
from tests.helpers import make_rows, write_jsonl
from vapo_lightning.config import Algorithm, Generation
from vapo_lightning.data import PromptDataModule
from vapo_lightning.distributed import VAPOStrategy
from vapo_lightning.engines.native import generate
from vapo_lightning.models import ModelSpec
from vapo_lightning.module import VAPOModule

PROMPTS = [[5, 17, 42, 9, 88], [120, 7, 33]]  # left-padded to one batch
NEW_TOKENS = 8


# What this rank did while building and sharding, filled by the wrappers of `record_building`.
FROM_PRETRAINED_CALLS: list[str] = []  # the class of each `from_pretrained` call
NUMEL_BEFORE_SHARDING: list[int] = []  # per sharded model: elements of real (non-meta) parameters


def record_building() -> None:
    load = PreTrainedModel.from_pretrained.__func__

    def counted_from_pretrained(cls, *args, **kwargs):
        FROM_PRETRAINED_CALLS.append(cls.__name__)
        return load(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counted_from_pretrained)
    shard = vapo_distributed.shard

    def recorded_shard(model, *args, **kwargs):
        real = sum(p.numel() for p in model.parameters() if not p.is_meta)
        NUMEL_BEFORE_SHARDING.append(real)
        return shard(model, *args, **kwargs)

    vapo_distributed.shard = recorded_shard


def uneven_config(policy, tok) -> Generation:
    """Greedy, one sequence per call, stopping at the second token greedy decoding gives the
    first prompt: rank 1's calls (that prompt, then a dummy on it) end after two tokens while
    rank 0's call on the second prompt goes on, so the ranks also decode in lock step across
    calls of different lengths."""
    probe = Generation(n=1, max_new_tokens=2, temperature=0.0)
    second = generate(policy, PROMPTS[:1], probe, tok.pad_token_id, tok.eos_token_id)
    return Generation(
        n=1, max_new_tokens=NEW_TOKENS, temperature=0.0, max_batch_size=1, stop_token_ids=[int(second.responses[0, 1])]
    )


def uneven_prompts(rank: int) -> list[list[int]]:
    return PROMPTS if rank == 0 else PROMPTS[:1]


def greedy_tokens(policy: torch.nn.Module, pad_token_id: int) -> torch.Tensor:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        return policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)


def is_sharded(model: torch.nn.Module) -> bool:
    """FSDP2 holds a sharded parameter as a DTensor and swaps in plain full tensors while the
    weights are gathered."""
    return all(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def count_all_gathers():
    """Counts FSDP2's all-gathers (one per unit it gathers) while the block runs."""
    calls, original = [0], dist.all_gather_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counted
    try:
        yield calls
    finally:
        dist.all_gather_single = original


class Inspect(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: L.Trainer, module: VAPOModule) -> None:
        gathered = StateDictOptions(full_state_dict=True)  # full tensors on every rank
        policy, critic = module.policy, module.critic
        with torch.no_grad():
            values = critic(input_ids=torch.tensor([PROMPTS[0]])).logits
        local = sum(p.to_local().numel() for m in (policy, critic) for p in m.parameters())
        record = {
            "policy": get_model_state_dict(policy, options=gathered),
            "critic": get_model_state_dict(critic, options=gathered),
            "buffers": {f"policy.{k}": b for k, b in policy.named_buffers()}
            | {f"critic.{k}": b for k, b in critic.named_buffers()},
            "tokens": greedy_tokens(policy, module.tokenizer.pad_token_id),
            "values": values,
            "tied": policy.lm_head.weight is policy.get_input_embeddings().weight,
            "from_pretrained_calls": FROM_PRETRAINED_CALLS,
            "numel_before_sharding": NUMEL_BEFORE_SHARDING,
            "local_numel_after_sharding": local,
        }
        tok = module.tokenizer
        cfg = uneven_config(policy, tok)
        for gather in (False, True):  # per layer per decoding step / once per rollout
            with count_all_gathers() as calls:
                uneven = generate(
                    policy,
                    uneven_prompts(trainer.global_rank),
                    dataclasses.replace(cfg, gather_weights=gather),
                    tok.pad_token_id,
                    tok.eos_token_id,
                )
            record[f"uneven_responses_gather_{gather}"] = uneven.responses
            record[f"all_gathers_gather_{gather}"] = calls[0]
        record["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in policy.modules())
        record["sharded_after"] = is_sharded(policy)
        # A forward that fails inside the gathered block (both ranks, the same forward): the
        # weights are freed, FSDP's iteration state cleared, and the next rollout is the same.
        mlp = policy.model.layers[1].mlp

        def boom(*args, **kwargs):
            raise RuntimeError("boom")

        mlp.forward, failed = boom, False
        try:
            generate(policy, uneven_prompts(trainer.global_rank), cfg, tok.pad_token_id, tok.eos_token_id)
        except RuntimeError:
            failed = True
        finally:
            del mlp.forward
        record["failed_inside"] = failed
        record["sharded_after_error"] = is_sharded(policy)
        again = generate(policy, uneven_prompts(trainer.global_rank), cfg, tok.pad_token_id, tok.eos_token_id)
        record["responses_after_error"] = again.responses
        torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


def main(out: Path, checkpoint: str, devices: int) -> None:
    record_building()
    L.seed_everything(0)
    module = VAPOModule(
        policy=ModelSpec(name_or_path=checkpoint),
        algorithm=Algorithm(mini_batch_size=4, micro_batch_size=4),
        generation=Generation(n=2, max_new_tokens=16),  # within TINY_LLAMA's 128 positions
        val_before_train=False,
    )
    train = write_jsonl(out / "train.jsonl", make_rows(8))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=VAPOStrategy(mode="fsdp"),
        max_steps=0,
        callbacks=[Inspect(out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=PromptDataModule(train=str(train), prompts_per_step=2, chat_template=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
