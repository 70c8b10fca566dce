"""A memory plan per GPU, before a run starts: what each phase of a rollout step holds at
its worst (every answer at `max_new_tokens`), for the config and the world size.

An estimate from counts, not a measurement: bytes per parameter of each state, bytes per
token of activations and logits. The terms:

- training state, always resident: fp32 weights and AdamW's two fp32 moments, 12 bytes a
  trained parameter (a frozen one, a LoRA base: its own dtype's, 2 in bf16; a reference
  policy: 4), divided over the ranks under fsdp;
- gradients, during the update of their model: 4 bytes a parameter (/ W under fsdp, which
  reduce-scatters every micro-batch);
- activations of one micro-batch's forward and backward: 34·hidden bytes a token a layer in
  bf16 (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Eq. 2, without the attention-score term a fused attention kernel does not store);
  with activation checkpointing, 2·hidden a token a layer plus one layer's 34·hidden;
- the actor's log-probs: the logits and their gradient, 2 × 2 bytes a token a vocabulary
  entry (bf16); or, where they come from the LM head's input (`head_logprobs`), three fp32
  (chunk, vocabulary) temporaries and the head weight's fp32 gradient sum (vocabulary × hidden);
- rollout: the vLLM engine's share of the device (`gpu_memory_utilization`), or the native
  engine's bf16 weights and KV cache: 2 (K, V) × layers × kv heads × head size × 2 bytes a
  token of every sequence at once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GiB", "ModelShape", "Plan", "check_memory", "logprob_bytes", "memory_plan"]

GiB = 2**30


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    hidden: int
    vocab: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    trained: float | None = None  # parameters that learn (LoRA: the adapters); None: all
    head_rows: int = 0  # positions per chunk where log-probs come from the head's input; 0: logits
    frozen_bytes: float = 4  # a frozen parameter's (a LoRA base's: its dtype's, 2 in bf16)

    @property
    def state_bytes(self) -> float:  # fp32 weights (+ AdamW's moments where they learn)
        trained = self.params if self.trained is None else self.trained
        return 12 * trained + self.frozen_bytes * (self.params - trained)

    @property
    def gradient_bytes(self) -> float:
        return 4 * (self.params if self.trained is None else self.trained)

    @classmethod
    def of(cls, model, device=None) -> ModelShape:
        """The shape of a built (possibly sharded) Hugging Face model; `device`: where its
        log-probs are taken (the chunk of `head_logprobs.rows_per_chunk` there)."""
        import torch

        from vapo_lightning import head_logprobs

        cfg = model.config
        vocab = getattr(cfg, "vocab_size", 0)
        chunked = vocab and head_logprobs.plain_head(model) is not None
        heads = getattr(cfg, "num_attention_heads", 1)
        return cls(
            params=sum(p.numel() for p in model.parameters()),
            trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
            frozen_bytes=max((p.element_size() for p in model.parameters() if not p.requires_grad), default=4),
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            vocab=vocab,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            head_rows=head_logprobs.rows_per_chunk(vocab, torch.device(device or "cuda")) if chunked else 0,
        )


@dataclass(frozen=True)
class Plan:
    """Bytes per GPU of each phase at its worst."""

    rollout: float
    critic_update: float
    actor_update: float

    def worst(self) -> float:
        return max(self.rollout, self.critic_update, self.actor_update)

    def line(self, device_bytes: float | None = None) -> str:
        of = f" of {device_bytes / GiB:.1f} GiB" if device_bytes else ""
        return (
            f"memory plan per GPU, worst case{of}: rollout {self.rollout / GiB:.1f} GiB, critic update "
            f"{self.critic_update / GiB:.1f} GiB, actor update {self.actor_update / GiB:.1f} GiB"
        )


def activations(shape: ModelShape, tokens: float, checkpointing: bool) -> float:
    """Bytes a forward keeps for its backward over `tokens` tokens (bf16)."""
    per_layer = 34 * shape.hidden * tokens
    if checkpointing:
        return 2 * shape.hidden * tokens * shape.layers + per_layer
    return per_layer * shape.layers


def logprob_bytes(shape: ModelShape, tokens: float) -> float:
    """Bytes the actor's log-probs and entropies of `tokens` tokens hold beyond the
    activations: the bf16 (tokens, V) logits and their gradient, or, from the head's input, a
    chunk's (rows, V) logits, probabilities and their gradient in fp32 and W's fp32 gradient."""
    if shape.head_rows:
        return 3 * 4 * min(tokens, shape.head_rows) * shape.vocab + 4 * shape.vocab * shape.hidden
    return 4 * tokens * shape.vocab


def memory_plan(
    policy: ModelShape,
    critic: ModelShape | None,
    *,
    world: int,
    sharded: bool,
    reference: bool,
    prompt: int,
    max_new_tokens: int,
    responses: int,
    micro_batch: int,
    max_tokens: int | None,
    checkpointing: bool,
    engine: str,
    device_bytes: float,
    gpu_memory_utilization: float,
    offload: tuple[str, ...] = (),
) -> Plan:
    """The plan for one rank: `responses` sampled a step, micro-batches of `micro_batch`
    responses or of `max_tokens` tokens, every sequence `prompt + max_new_tokens` long; the
    models in `offload` keep their states in host memory (counted as none here)."""
    share = world if sharded else 1
    resident = {
        "policy": policy.state_bytes,
        "critic": critic.state_bytes if critic else 0,
        "reference": 4 * policy.params if reference else 0,
    }
    states = sum(v for k, v in resident.items() if k not in offload) / share
    seq = prompt + max_new_tokens
    # a micro-batch filled to its budget (a sequence over it alone), or micro_batch sequences
    tokens = max(max_tokens, seq) if max_tokens else micro_batch * seq
    if engine == "vllm":
        rollout = states + gpu_memory_utilization * device_bytes
    else:
        kv = 2 * policy.layers * policy.kv_heads * policy.head_dim * 2 * responses * seq
        rollout = states + 2 * policy.params + kv  # the gathered bf16 weights sample
    actor = (
        states
        + policy.gradient_bytes / share
        + activations(policy, tokens, checkpointing)
        + logprob_bytes(policy, tokens)
    )
    critic_update = states + (
        critic.gradient_bytes / share + activations(critic, tokens, checkpointing) if critic else 0
    )
    return Plan(rollout, critic_update, actor)


def check_memory(module) -> None:
    """Prints a `VAPOModule`'s memory plan per GPU (rank 0) and refuses, in one line, a run
    whose worst phase would not fit the device."""
    import torch

    from vapo_lightning.config import SetupError
    from vapo_lightning.lora import is_lora

    trainer = module.trainer
    strategy, dm = trainer.strategy, trainer.datamodule
    total = torch.cuda.get_device_properties(module.device).total_memory
    plan = memory_plan(
        ModelShape.of(module.policy, module.device),
        ModelShape.of(module.critic) if module.critic is not None else None,
        world=trainer.world_size,
        sharded=getattr(strategy, "mode", None) == "fsdp",
        reference=module.ref_policy is not None and not is_lora(module.policy),
        prompt=module.longest_prompt,
        max_new_tokens=module.gen.max_new_tokens,
        responses=dm.prompts_per_step * module.gen.n,
        micro_batch=module.algo.micro_batch_size,
        max_tokens=module.algo.max_tokens_per_micro_batch,
        checkpointing=bool(getattr(strategy, "activation_checkpointing", False)),
        engine=module.gen.engine,
        device_bytes=total,
        gpu_memory_utilization=module.gen.vllm.gpu_memory_utilization,
        offload=tuple(getattr(strategy, "offload", ())),
    )
    if trainer.is_global_zero:
        print(plan.line(total), flush=True)
    if plan.worst() > total:
        raise SetupError(
            f"{plan.line(total)}: over the device. Lower model.algorithm.micro_batch_size "
            "(or set max_tokens_per_micro_batch), model.generation.max_new_tokens or "
            "vllm.gpu_memory_utilization, shard with --trainer.strategy=fsdp on more GPUs, "
            "or turn on activation checkpointing (docs/distributed.md#memory-plan)"
        )
