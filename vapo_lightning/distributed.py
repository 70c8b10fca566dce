"""Data-parallel training of the policy and the critic: `--trainer.strategy=ddp|fsdp`.

Both names resolve to `VAPOStrategy`, Lightning's `ModelParallelStrategy` over one
data-parallel mesh of every rank (all nodes × devices; gloo on CPU, NCCL on GPUs). The
strategy only sets up processes, the mesh and DCP checkpoints; `parallelize`, called at the
end of `VAPOModule.configure_model`, applies PyTorch's own engines to each model separately:

- fsdp: FSDP2 `fully_shard` on every decoder layer, then on the root, of the policy, the
  critic and the frozen reference policy. bf16 (`--trainer.precision=bf16-mixed`) becomes
  FSDP2's `MixedPrecisionPolicy` (bf16 compute, fp32 gradient reduction, fp32 master weights).
  Only global rank 0 holds full weights on the host (loaded with `from_pretrained`, or
  initialised from a config); the other ranks build the architecture on the meta device
  (`builds_on_meta`), and after sharding rank 0's full state dict is broadcast into every
  rank's shards (`shard_from_rank0`), as verl and torchtitan load.
- ddp: composable `replicate` (DistributedDataParallel) on the policy and on the critic, each
  on its own, so the critic's backward never waits for policy gradients: no
  `find_unused_parameters`. The frozen reference policy is broadcast from rank 0.

Gradients are averaged over ranks by both engines; the updates multiply each loss by the
world size because their normalisers are already global token counts (VAPO §4.2), so the
gradient equals the single-process gradient of the same global batch.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from torch import nn

from vapo_lightning.config import SetupError
from vapo_lightning.lora import is_lora, merged_weights

__all__ = [
    "VAPOStrategy",
    "builds_on_meta",
    "full_state_dict",
    "parallelize",
    "resolve_strategy",
    "save_pretrained",
    "shard_from_rank0",
    "shards_checkpoints",
]

MODES = ("ddp", "fsdp")


def destroy_process_groups() -> None:
    """Destroys every process group while the interpreter is alive, at exit.

    Lightning does it for NCCL only. A gloo group left to the interpreter's finalisation may
    abort the finished run ("terminate called without an active exception", exit -6;
    pytorch/pytorch#190489). `destroy_process_group` alone does not free the groups: each
    `DeviceMesh` keeps its groups in `_pg_registry`, and DTensor's sharding-propagation and
    redistribution caches keep the meshes alive, so the groups' threads would still run into
    finalisation. The meshes let go of them here, and the groups are freed before exit.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    dist.destroy_process_group()
    from torch.distributed.device_mesh import DeviceMesh

    for mesh in (obj for obj in gc.get_objects() if isinstance(obj, DeviceMesh)):
        getattr(mesh, "_pg_registry", {}).clear()
    gc.collect()


class VAPOStrategy(ModelParallelStrategy):
    """Data parallelism for VAPO: `ddp` replicates, `fsdp` fully shards (FSDP2) each model.

    Args:
        mode: "ddp" (replicate each model) or "fsdp" (shard each model's parameters,
            gradients and optimiser states over all ranks).
        activation_checkpointing: recompute each decoder layer's activations in the
            backward pass (policy and critic), for long responses on GPUs.
        reshard_after_forward: fsdp: free the gathered parameters after each layer's
            forward (less memory; gathered again in backward and in every decoding step).
        save_distributed_checkpoint: fsdp: each rank writes its shard into a DCP folder
            (resume with `--ckpt_path last`); False: one full file assembled on rank 0. ddp
            always writes one file from rank 0, as Lightning's DDP does: every rank holds the
            whole models, and Lightning's model-parallel loading reads only sharded ones.
        offload: fsdp: the models whose shards, gradients and optimiser states live in host
            memory between their uses ("policy", "critic", "reference"; FSDP2's
            `CPUOffloadPolicy`, as verl's `offload_policy` and NeMo-RL's `cpu_offload`): the
            device keeps only what a forward or an update is using, at the cost of host-device
            copies and an optimiser step on the CPU. GPUs only.
        keep_saves: fsdp: complete saves kept per checkpoint name (the newest and the ones
            before it, for a save that turns out bad); older ones are deleted.
        accumulate_unsharded: fsdp: accumulate a mini-batch's gradient unsharded and
            reduce-scatter it once, on its last micro-batch: fewer reduce-scatters, but every
            rank holds the whole model's gradient in fp32 (4 bytes per parameter, not 4 / W:
            28 GB at 7 B parameters) from the first micro-batch on. Off (the default, as in
            verl, NeMo-RL and torchtitan): a reduce-scatter after every micro-batch, each
            rank holding its shard. ddp always reduces once per mini-batch (its gradient is
            whole on every rank anyway).
    """

    def __init__(
        self,
        mode: Literal["ddp", "fsdp"] = "fsdp",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        accumulate_unsharded: bool = False,
        keep_saves: int = 2,
        offload: tuple[str, ...] | list[str] = (),
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"VAPOStrategy.mode must be one of {MODES}, got {mode!r}")
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.mode = mode
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.accumulate_unsharded = accumulate_unsharded
        if keep_saves < 1:
            raise ValueError("VAPOStrategy.keep_saves must be >= 1")
        self.keep_saves = keep_saves
        unknown = set(offload) - {"policy", "critic", "reference"}
        if unknown or (offload and mode != "fsdp"):
            raise ValueError(
                f"VAPOStrategy.offload: models among 'policy', 'critic', 'reference', under "
                f"mode='fsdp' (got {list(offload)}, mode={mode!r})"
            )
        self.offload = tuple(offload)

    def setup_environment(self) -> None:
        # One data-parallel dimension over every rank of every node; no tensor parallelism.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        atexit.unregister(destroy_process_groups)  # registered once
        atexit.register(destroy_process_groups)

    @property
    def dp_mesh(self) -> Any:
        return self.device_mesh["data_parallel"]

    # ddp: checkpoints as Lightning's base strategy writes and reads them (one file, rank 0).

    @property
    def lightning_restore_optimizer(self) -> bool:  # (fsdp: restored in load_checkpoint)
        return self.mode == "ddp"

    def lightning_module_state_dict(self) -> dict[str, Any]:
        ddp = self.mode == "ddp"
        return Strategy.lightning_module_state_dict(self) if ddp else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        ddp = self.mode == "ddp"
        return Strategy.optimizer_state(self, optimizer) if ddp else super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.mode != "ddp" and not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.mode != "ddp":
            return self._save_sharded(checkpoint, Path(self.broadcast(filepath)))
        path = Path(self.broadcast(filepath))
        if self.is_global_zero and (path.is_dir() or path.is_symlink()):  # an fsdp run's save of that name
            remove_save(path)
        Strategy.save_checkpoint(self, checkpoint, path, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and (Path(filepath).is_symlink() or Path(filepath).is_dir()):
            remove_save(Path(filepath))
        else:
            super().remove_checkpoint(filepath)

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path) -> None:
        """A sharded save that never tears: every rank writes its shard into a new folder
        (`<name>.saves/<k>`), the ranks agree that all of them finished, and only then does
        rank 0 point `path` (a symbolic link) at it, in one atomic rename; the previous save
        stays whole until then and `keep_saves` are kept. A save that failed on any rank
        leaves `path` where it was, and every rank raises (verl's `global_step_N` folders
        and their pointer file, NeMo-RL's `tmp_step_N` rename)."""
        saves = path.with_name(f"{path.name}.saves")
        if self.is_global_zero:
            saves.mkdir(parents=True, exist_ok=True)
            if path.is_dir() and not path.is_symlink():  # a folder of an earlier version: kept
                path.rename(saves / "0")
            done = sorted((int(p.name) for p in saves.iterdir() if p.name.isdigit()), reverse=True)
            k = (done[0] + 1) if done else 1
        target = saves / str(self.broadcast(k if self.is_global_zero else None))
        error = None
        try:
            super().save_checkpoint(checkpoint, target, None)
        except BaseException as err:  # (DCP's CheckpointException is a BaseException) re-raised below
            error = err
        failed = self.reduce(torch.tensor(float(error is not None), device=self.root_device), reduce_op="sum")
        if float(failed) > 0:
            if self.is_global_zero:
                shutil.rmtree(target, ignore_errors=True)
            raise RuntimeError(
                f"checkpoint {path}: {int(failed)} rank(s) failed to save; the previous save is kept"
            ) from error
        if self.is_global_zero:
            link = path.with_name(f".{path.name}.link")
            link.unlink(missing_ok=True)
            link.symlink_to(Path(saves.name) / target.name)
            os.replace(link, path)  # the switch: atomic
            for old in sorted((p for p in saves.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))[
                : -self.keep_saves
            ]:
                shutil.rmtree(old)
        self.barrier("vapo_sharded_save")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.mode != "ddp":
            return super().load_checkpoint(checkpoint_path, weights_only)
        if Path(checkpoint_path).is_dir():
            raise ValueError(
                f"{checkpoint_path} is a sharded (fsdp) checkpoint folder: resume it with --trainer.strategy=fsdp"
            )
        return Strategy.load_checkpoint(self, checkpoint_path, weights_only)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self.mode == "ddp":
            Strategy.load_model_state_dict(self, checkpoint, strict)  # (fsdp: done in load_checkpoint)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self.mode == "ddp":
            Strategy.load_optimizer_state_dict(self, checkpoint)


StrategyRegistry.register("vapo_ddp", VAPOStrategy, "VAPO: replicate each model", mode="ddp")
StrategyRegistry.register("vapo_fsdp", VAPOStrategy, "VAPO: FSDP2 on each model", mode="fsdp")


def resolve_strategy(strategy: Any) -> Any:
    """The CLI's `--trainer.strategy=ddp|fsdp` -> `VAPOStrategy`; anything else unchanged."""
    if isinstance(strategy, str) and strategy in MODES:
        return VAPOStrategy(mode=strategy)
    return strategy


def _strategy(module: Any) -> VAPOStrategy | None:
    strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    return strategy if isinstance(strategy, VAPOStrategy) else None


def builds_on_meta(module: Any) -> bool:
    """Whether `configure_model` builds the models on the meta device on this rank: under fsdp
    on every rank but global rank 0, whose weights `parallelize` broadcasts into the shards."""
    strategy = _strategy(module)
    return strategy is not None and strategy.mode == "fsdp" and strategy.global_rank > 0


def shards_checkpoints(module: Any) -> bool:
    """Whether checkpoints hold every key of the models (fsdp: Lightning loads each key of the
    sharded model from the checkpoint, strictly), so a LoRA run keeps its base in them."""
    strategy = _strategy(module)
    return strategy is not None and strategy.mode == "fsdp"


def parallelize(module: Any) -> None:
    """Applies the strategy's engine to `module.policy`, `.critic` and `.ref_policy`.

    Called at the end of `configure_model`; a no-op without a `VAPOStrategy` and when already
    applied (configure_model runs again on every fit / validate).
    """
    strategy = _strategy(module)
    if strategy is None or getattr(module, "_parallelized", False):
        return
    check_precision(str(module.trainer.precision))
    trainable = [m for m in (module.policy, module.critic) if m is not None]
    ref = module.ref_policy if isinstance(module.ref_policy, nn.Module) else None  # (LoRA: the policy)
    if strategy.activation_checkpointing:
        for m in trainable:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if strategy.mode == "fsdp":
        mp = _mixed_precision(str(module.trainer.precision))
        named = {"policy": module.policy, "critic": module.critic, "reference": ref}
        for name, m in named.items():
            if m is not None:
                shard_from_rank0(
                    m,
                    strategy.dp_mesh,
                    mp,
                    strategy.reshard_after_forward,
                    strategy.root_device,
                    offload=name in strategy.offload,
                )
    else:
        from torch.distributed._composable import replicate

        device = strategy.root_device
        for m in trainable:
            m.to(device)
            replicate(m, **({"device_id": device} if device.type == "cuda" else {}))
            # DDP now, on the device, from the model's own parameters: `replicate` builds it
            # at the first forward, which may run with the LM head swapped out (log-probs
            # from the head's input before any sampling forward, as with vLLM), leaving the
            # head's gradient unreduced.
            replicate.state(m).lazy_init()
        if ref is not None:  # frozen: no gradients to reduce, same weights
            ref.to(device)
            for t in [*ref.parameters(), *ref.buffers()]:
                dist.broadcast(t.data, src=0)
    module._parallelized = True


def check_precision(precision: str) -> None:
    """The precisions data parallelism trains right with: fp32 weights and AdamW states with
    bf16 compute (`bf16-mixed`), or fp32. `bf16-true` keeps bf16 master weights, which do not
    move at RL's learning rates (a 1e-6 step is below bf16's resolution near 1); `16-mixed`'s
    gradient scaler does not reach the manual optimisation's clipping."""
    if precision in ("bf16-true", "bf16", "16-mixed", "16", "16-true", "fp16"):
        raise SetupError(
            f"trainer.precision={precision}: under --trainer.strategy=ddp|fsdp train with "
            "bf16-mixed (bf16 compute, fp32 weights and optimiser states) or 32-true"
        )


def remove_save(path: Path) -> None:
    """A checkpoint that `_save_sharded` wrote (the link and its saves) or a plain folder."""
    if path.is_symlink():
        path.unlink()
        shutil.rmtree(path.with_name(f"{path.name}.saves"), ignore_errors=True)
    else:
        shutil.rmtree(path)


def _mixed_precision(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision.startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision.startswith("16"):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model (its `_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TypeError(f"{type(model).__name__}: no decoder layers found to shard (_no_split_modules={names})")
    return layers


def shard(model: nn.Module, mesh: Any, mp: Any, reshard_after_forward: bool = True, offload: bool = False) -> None:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, norm, head).

    Marks the model FSDP-managed for Hugging Face `generate`, which then keeps every rank
    decoding (`synced_gpus`) until all ranks have finished, as each step gathers weights (our
    sampler gathers them once per rollout instead: `generation.gathered_weights`).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()  # (OffloadPolicy(): none)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    model._is_fsdp_managed_module = True
    model.reshard_after_forward = reshard_after_forward  # restored by `gathered_weights`


def shard_from_rank0(
    model: nn.Module,
    mesh: Any,
    mp: Any,
    reshard_after_forward: bool,
    device: torch.device,
    offload: bool = False,
) -> None:
    """`shard`, then global rank 0's full weights broadcast into every rank's shards.

    Rank 0 must hold real weights; the other ranks may hold the same architecture on the meta
    device (`builds_on_meta`): they then allocate only their shards, and receive one full
    tensor at a time during the broadcast. Collective: every rank calls it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    named = itertools.chain(model.named_parameters(), model.named_buffers())
    on_meta = [name for name, t in named if t.is_meta]
    rank0 = dist.get_rank() == 0
    if rank0 and on_meta:
        raise RuntimeError(
            f"rank 0 must hold the weights it broadcasts, but {len(on_meta)} tensors of "
            f"{type(model).__name__} are on the meta device (first: {on_meta[0]})"
        )
    # Rank 0's full tensors, referenced (not copied) so that they outlive the sharding below;
    # freed on return (the shards are copies).
    full = model.state_dict() if rank0 else {}
    shard(model, mesh, mp, reshard_after_forward, offload)
    if on_meta:
        model.to_empty(device=device)  # this rank's shards and buffers, not yet filled
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)  # strict: the same keys on every rank
    # Buffers outside the state dict (non-persistent, e.g. rotary `inv_freq`) were computed
    # from the config on rank 0 only; FSDP2 does not shard buffers: every rank takes rank 0's.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU, on rank 0; an empty dict on other ranks.
    Collective under fsdp: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not (dist.is_available() and dist.is_initialized()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def merged_state_dict(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """A LoRA model's weights with the adapters merged in, full tensors on CPU where `keep`
    (rank 0), an empty dict elsewhere. Collective under fsdp: every rank must call it."""
    state = {}
    for name, tensor in merged_weights(model):
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if keep:
            state[name] = tensor.detach().cpu()
    return state


def save_pretrained(model: Any, tokenizer: Any, directory: str | Path, is_global_zero: bool) -> None:
    """`save_pretrained` of a possibly sharded / replicated model, written by rank 0.
    Every rank must call it (the weights are gathered collectively)."""
    if is_lora(model):  # the adapters merged in, saved as the base's own architecture
        state, model = merged_state_dict(model, keep=is_global_zero), model.get_base_model()
    else:
        state = full_state_dict(model)
    if not is_global_zero:
        return
    directory = Path(directory)
    model.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
    # `replicate` renames the class DDP<Name>; transformers strips only an FSDP prefix.
    config = directory / "config.json"
    cfg = json.loads(config.read_text())
    cfg["architectures"] = [a.removeprefix("DDP") for a in cfg.get("architectures") or []]
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
