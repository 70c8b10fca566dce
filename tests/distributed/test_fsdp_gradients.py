"""Under FSDP2 no rank holds more than its shard of the gradient between the micro-batches of
one update (2 gloo ranks): the gradient is reduce-scattered after every micro-batch, as verl,
NeMo-RL and torchtitan do. Accumulating it unsharded (`VAPOStrategy(accumulate_unsharded=
True)`) holds the whole model's fp32 gradient on every rank, the negative control. And every
scalar the module reduces lands on the module's device (NCCL reduces no CPU tensor)."""

from __future__ import annotations

import json
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import TINY_LLAMA, tiny_module

WIDE = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}


def held_gradient_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes this rank holds: FSDP's unsharded accumulations and the sharded grads."""
    held = 0
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        for fp in group.fsdp_params if group is not None else ():
            g = getattr(fp, "unsharded_accumulated_grad", None)
            held += 0 if g is None else g.numel() * g.element_size()
            up = getattr(fp, "_unsharded_param", None)
            held += 0 if up is None or up.grad is None else up.grad.numel() * up.grad.element_size()
            if fp.sharded_param.grad is not None:
                local = fp.sharded_param.grad.to_local()
                held += local.numel() * local.element_size()
    return held


def rollout(vocab: int, B: int = 8, P: int = 5, T: int = 12):
    """A rollout of B responses and its advantages (B, T)."""
    from vapo_lightning.rollout import Rollout

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    response_mask = torch.arange(T)[None] < lengths[:, None]
    attn = torch.cat([torch.ones(B, P, dtype=torch.bool), response_mask], 1)
    ids = torch.where(attn, torch.randint(3, vocab, (B, P + T), generator=g), 0)
    scores = torch.randn(B, generator=g)
    r = Rollout(
        input_ids=ids,
        attention_mask=attn.long(),
        response_mask=response_mask,
        group_ids=torch.arange(B) // 4,
        truncated=torch.zeros(B, dtype=torch.bool),
        scores=scores,
        correct=scores > 0,
    )
    return r, torch.randn(B, T, generator=g) * response_mask


def _rank(rank: int, init: str, out: str, tokenizer: str, unsharded: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from vapo_lightning.config import Algorithm
    from vapo_lightning.distributed import shard
    from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
    from vapo_lightning.updates import OldPolicy, RankOps, update_actor

    torch.manual_seed(0)
    policy = build_policy(ModelSpec(config=WIDE, tokenizer=tokenizer), load_tokenizer(tokenizer))
    numel = sum(p.numel() for p in policy.parameters())
    largest_layer = max(sum(p.numel() for p in layer.parameters()) for layer in policy.model.layers)
    root = numel - largest_layer * len(policy.model.layers)  # the root unit: embeddings, norm, head
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    shard(policy, mesh, MixedPrecisionPolicy())
    r, advantages = rollout(policy.config.vocab_size)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    seen: list[int] = []

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        seen.append(held_gradient_bytes(policy))

    def global_sum(x: torch.Tensor) -> torch.Tensor:
        x = x.clone().float()
        dist.all_reduce(x)
        return x

    ops = RankOps(backward, global_sum, 2, accumulate_unsharded=unsharded)
    algo = Algorithm(mini_batch_size=8, micro_batch_size=2)  # 4 micro-batches per update
    update_actor(policy, opt, r, OldPolicy(None, None, None), advantages, [torch.arange(8)], algo, 1.0, 1.0, ops)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"held": seen, "numel": numel, "largest": max(largest_layer, root)}, f)
    dist.destroy_process_group()


def run_two_ranks(tok, unsharded: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'init')}", os.path.join(tmp, "held.json")
        mp.start_processes(_rank, args=(init, out, str(tok), unsharded), nprocs=2, start_method="spawn")
        with open(out) as f:
            return json.load(f)


@pytest.mark.slow
def test_fsdp_holds_one_shard_of_the_gradient_between_micro_batches(tok):
    got = run_two_ranks(tok, unsharded=False)
    shard_bytes, unit = got["numel"] * 4 / 2, got["largest"] * 4
    assert len(got["held"]) == 4  # one reading after each micro-batch's backward
    for held in got["held"]:
        assert held <= shard_bytes + unit, (held, shard_bytes)
    # The negative control: accumulated unsharded, a rank holds the whole fp32 gradient.
    got = run_two_ranks(tok, unsharded=True)
    for held in got["held"][:-1]:  # (the last micro-batch reduce-scatters)
        assert held >= got["numel"] * 4 * 0.99 > shard_bytes + unit


class RecordingStrategy:
    """A world of two identical ranks: `reduce` records the device of what it is given."""

    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def reduce(self, x: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.devices.append(x.device)
        return x * 2


def test_every_scalar_the_module_reduces_is_on_its_device(tok):
    module = tiny_module(tok)
    module._device = torch.device("meta")  # a device no CPU tensor is on
    strategy = RecordingStrategy()
    module._trainer = SimpleNamespace(world_size=2, strategy=strategy)
    for x in (1.0, torch.tensor(3), torch.tensor([1.0, 2.0])):  # DAPO's flag, a count, moments
        out = module.global_sum(x)
        assert out.device.type == "meta" and out.dtype == torch.float32
    assert [d.type for d in strategy.devices] == ["meta"] * 3


def test_offload_reaches_every_fsdp_unit_of_the_chosen_models(monkeypatch):
    """`VAPOStrategy(offload=[...])`: FSDP2's CPUOffloadPolicy on every unit of the models
    named (it runs on GPUs only: here the call is recorded, not made)."""
    import torch.distributed.fsdp as fsdp

    from vapo_lightning.distributed import VAPOStrategy, shard
    from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append(kw["offload_policy"]))
    tok = load_tokenizer("vapo_lightning/assets/quickstart_sft")
    policy = build_policy(ModelSpec(config=WIDE, tokenizer="vapo_lightning/assets/quickstart_sft"), tok)
    shard(policy, None, None, offload=True)
    assert len(calls) == 4 + 1 and all(type(c) is fsdp.CPUOffloadPolicy for c in calls)  # 4 layers, the root
    calls.clear()
    shard(policy, None, None)
    assert calls and not any(isinstance(c, fsdp.CPUOffloadPolicy) for c in calls)
    assert VAPOStrategy(offload=["critic", "reference"]).offload == ("critic", "reference")
    with pytest.raises(ValueError, match="offload"):
        VAPOStrategy(offload=["optimiser"])
    with pytest.raises(ValueError, match="offload"):
        VAPOStrategy(mode="ddp", offload=["critic"])


def test_precisions_that_do_not_train_right_are_refused_under_data_parallelism():
    from vapo_lightning.config import SetupError
    from vapo_lightning.distributed import check_precision

    for ok in ("bf16-mixed", "32-true", "32"):
        check_precision(ok)
    for bad in ("bf16-true", "16-mixed"):
        with pytest.raises(SetupError, match=f"trainer.precision={bad}"):
            check_precision(bad)
