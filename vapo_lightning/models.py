"""Policy and critic: Hugging Face models in, Hugging Face models out.

The policy is any `AutoModelForCausalLM`; the critic is a separate transformer with a scalar
value head (`AutoModelForTokenClassification` with one label, as verl and OpenRLHF do), so
both load from a local path or a hub id and save with `save_pretrained`. A critic is
initialised from the policy's weights (backbone copied, fresh head) or from its own path
(e.g. a reward model or a critic saved by value pretraining, VAPO §4.1).

`meta=True` builds the same architecture on the meta device without reading or initialising
any weight: under fsdp every rank but rank 0 does so, and `distributed.shard_from_rank0` fills
their shards with rank 0's weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from vapo_lightning.attention import SDPA, STANDARD_SDPA
from vapo_lightning.lora import LoRA, is_lora, keep_base_in, with_adapters

__all__ = [
    "ModelSpec",
    "add_adapters",
    "build_critic",
    "build_policy",
    "check_critic_tokenizer",
    "load_tokenizer",
    "looks_like_a_model_source",
    "weights_from_source",
]


@dataclass
class ModelSpec:
    """Where a model comes from: a path / hub id, or a config to initialise randomly; and how
    it trains (in full, or LoRA adapters on its frozen weights). A critic spec with neither
    source is the policy's backbone, as no critic spec is."""

    name_or_path: str | None = None
    """Local directory or hub id loaded with `from_pretrained`."""
    config: dict[str, Any] | None = None
    """Build from this config instead (random init), e.g. {"model_type": "llama", ...}."""
    tokenizer: str | None = None
    """Tokenizer path or hub id; defaults to `name_or_path`."""
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    """The attention kernel, as Hugging Face names it ("sdpa", "eager", "flash_attention_2",
    ...); None: the model's default, and on the CPU this package's span attention for
    shared-prompt packs (`attention.SDPA`). A kernel that takes no 4-D mask (flash) runs
    every response in its own row (`packing.takes_masks`)."""
    """Trade compute for activation memory during the updates."""
    lora: LoRA | None = None
    """Train LoRA adapters (peft) instead of every weight (`vapo_lightning.lora`); None: full
    fine-tuning. Without a `model.critic` the critic takes the policy's; a critic spec of its
    own sets its own (unset: the critic trains in full)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # (a checkpoint's hyper-parameters)
            self.lora = LoRA(**self.lora)
        if self.name_or_path is not None and self.config is not None:
            raise ValueError("ModelSpec: give one of name_or_path or config, not both")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("ModelSpec.config needs a 'model_type' (e.g. 'llama')")

    def hf_config(self) -> PretrainedConfig:
        if self.config is not None:
            cfg = dict(self.config)
            return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        _check_source(self.name_or_path, "model")
        return AutoConfig.from_pretrained(self.name_or_path)


def looks_like_a_model_source(path: str) -> bool:
    """An existing local folder or file, or something that can be a hub id (``name`` or
    ``org/name``, not a relative or absolute path)."""
    if os.path.exists(os.path.expanduser(path)):
        return True
    return not path.startswith((".", "/", "~")) and path.count("/") <= 1 and "\\" not in path


def _check_source(path: str, what: str) -> None:
    if not looks_like_a_model_source(path):
        raise FileNotFoundError(f"{what} {path!r}: no such folder (and not a hub id like 'org/name')")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Loads a tokenizer for generation: left padding, a pad token (EOS if none)."""
    _check_source(path, "tokenizer")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {path!r} has no EOS token: generation could never stop")
    return tok


def _align_special_tokens(cfg: PretrainedConfig, tok: PreTrainedTokenizerBase) -> None:
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    if tok.bos_token_id is not None:
        cfg.bos_token_id = tok.bos_token_id


def build_policy(spec: ModelSpec, tok: PreTrainedTokenizerBase, meta: bool = False) -> PreTrainedModel:
    """The actor: a causal LM from `spec` (weights, or random init from a config).

    meta: the architecture only, on the meta device (config and generation config as
    `from_pretrained` would set them, no weights read); its weights come from rank 0.
    """
    if spec.name_or_path is None and spec.config is None:
        raise ValueError("model.policy: give name_or_path (a folder or hub id) or config")
    if spec.config is not None:
        cfg = spec.hf_config()
        if "vocab_size" not in spec.config:  # a config's default (e.g. Llama's 32000) is not ours
            cfg.vocab_size = len(tok)
        _align_special_tokens(cfg, tok)
        with _meta_device(meta):
            model = AutoModelForCausalLM.from_config(cfg, **_attention(spec))
    elif meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32, **_attention(spec))
        model.generation_config = _saved_generation_config(spec.name_or_path, model)
        model.eval()  # as from_pretrained leaves it
    else:
        _check_source(spec.name_or_path, "policy")
        model = AutoModelForCausalLM.from_pretrained(spec.name_or_path, dtype=torch.float32, **_attention(spec))
    if len(tok) > model.get_input_embeddings().num_embeddings:
        raise ValueError(
            f"tokenizer has {len(tok)} tokens, model embeds only {model.get_input_embeddings().num_embeddings}"
        )
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return _finish(model, spec.gradient_checkpointing, own_attention=spec.attn_implementation is not None)


def _attention(spec: ModelSpec | None) -> dict[str, str]:
    """`attn_implementation` for `from_pretrained` / `from_config`, where the spec names one."""
    return {"attn_implementation": spec.attn_implementation} if spec is not None and spec.attn_implementation else {}


def check_critic_tokenizer(spec: ModelSpec, tok: PreTrainedTokenizerBase) -> None:
    """The critic reads the policy's token ids, so its own tokenizer (if its source has one)
    must be the policy's: the same vocabulary and the same special tokens."""
    source = spec.tokenizer or spec.name_or_path
    try:
        theirs = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):  # a bare model folder: nothing to compare
        return
    mine_vocab, their_vocab = tok.get_vocab(), theirs.get_vocab()
    differ = sum(their_vocab.get(t) != i for t, i in mine_vocab.items())
    differ += len(their_vocab.keys() - mine_vocab.keys())
    specials = [(n, getattr(tok, n), getattr(theirs, n)) for n in ("eos_token", "bos_token")]
    specials = [f"{n} {a!r} vs {b!r}" for n, a, b in specials if a != b]
    if differ or specials:
        policy = getattr(tok, "name_or_path", "?")
        detail = ", ".join([f"{differ} of {len(mine_vocab)} token ids differ", *specials])
        raise ValueError(
            f"model.critic: its tokenizer ({source}) is not the policy's ({policy}): {detail}. "
            "The critic reads the policy's token ids: use a critic trained with the policy's "
            "tokenizer, or leave model.critic out to start it from the policy."
        )


VALUE_HEADS = ("score", "classifier")  # AutoModelForTokenClassification's head, by family


@contextlib.contextmanager
def _without_load_report():
    """transformers' table of missing keys, which for a critic loaded from a language model
    lists the value head that is expected to be new."""
    report = logging.getLogger("transformers.modeling_utils")
    only_report = _NotTheLoadReport()  # (a quieter level would turn on transformers' TP checks)
    report.addFilter(only_report)
    try:
        yield
    finally:
        report.removeFilter(only_report)


class _NotTheLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _say_what_loaded(source: str, info: dict[str, list[str]]) -> bool:
    """One line on a critic loaded from `source`: a fresh value head is expected (a language
    model or backbone has none) and said once; any other missing weight is warned about. True
    when the head is fresh."""
    missing = list(info.get("missing_keys", []))
    head = [k for k in missing if k.split(".")[0] in VALUE_HEADS]
    other = [k for k in missing if k not in head]
    if head:
        rank_zero_info(f"model.critic: {source}'s backbone with a fresh value head ({', '.join(sorted(head))})")
    if other:
        rank_zero_warn(
            f"model.critic: {len(other)} weights missing from {source} were initialised "
            f"at random: {', '.join(sorted(other)[:8])}{' ...' if len(other) > 8 else ''}"
        )
    return bool(head)


def build_critic(
    spec: ModelSpec | None,
    policy: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    meta: bool = False,
) -> PreTrainedModel:
    """The critic: a transformer backbone + scalar value head, output (B, L, 1).

    spec None (or without a source): the policy's architecture and backbone weights with a
    fresh head. Otherwise loaded from `spec.name_or_path` (a critic or reward model with the
    same tokenizer) or built from `spec.config`. Call it before the policy gets adapters.
    meta: the architecture only, on the meta device (policy may be a meta model too).
    """
    if spec is not None and spec.name_or_path is not None:
        _check_source(spec.name_or_path, "critic")
        check_critic_tokenizer(spec, tok)
        cfg = AutoConfig.from_pretrained(spec.name_or_path)
        cfg.num_labels, cfg.classifier_dropout = 1, 0.0  # one value; no dropout noise in the head
        if meta:
            with torch.device("meta"):
                model = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
            model.eval()  # as from_pretrained leaves it
            fresh_head = False  # rank 0 decides, and initialises it
        else:
            with _without_load_report():  # said in one line below
                model, info = AutoModelForTokenClassification.from_pretrained(
                    spec.name_or_path, config=cfg, dtype=torch.float32, output_loading_info=True, **_attention(spec)
                )
            fresh_head = _say_what_loaded(spec.name_or_path, info)
    else:
        from_policy = spec is None or spec.config is None
        cfg = copy.deepcopy(policy.config if from_policy else spec.hf_config())
        cfg.num_labels = 1  # transformers v5: set on the config, not as a from_config kwarg
        cfg.classifier_dropout = 0.0  # HF's head defaults to 0.1: noise in every value update
        cfg.architectures = None
        _align_special_tokens(cfg, tok)
        with _meta_device(meta):
            model = AutoModelForTokenClassification.from_config(cfg, **_attention(spec))
        if from_policy and not meta:  # the backbone from the policy (VAPO §4.1's open choice)
            backbone = policy.get_decoder() if hasattr(policy, "get_decoder") else policy.base_model
            missing = getattr(model, model.base_model_prefix).load_state_dict(backbone.state_dict())
            assert not missing.missing_keys, missing
        fresh_head = not meta
    if fresh_head:  # a new head (not a reward model's or a saved critic's): values start near 0
        head = _value_head(model)
        nn.init.normal_(head.weight, std=1.0 / (model.config.hidden_size + 1))
        if head.bias is not None:
            nn.init.zeros_(head.bias)
    model.config.problem_type = "regression"
    # Without a spec of its own the critic checkpoints activations as the policy it copies does.
    checkpointing = spec.gradient_checkpointing if spec is not None else policy.is_gradient_checkpointing
    return _finish(model, checkpointing, own_attention=_attention(spec) != {})


def add_adapters(
    policy: PreTrainedModel,
    critic: PreTrainedModel | None,
    policy_spec: ModelSpec,
    critic_spec: ModelSpec | None,
    base_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, nn.Module | None]:
    """Policy and critic with LoRA adapters where their specs ask (`vapo_lightning.lora`); a
    critic without a spec of its own takes the policy's. The value head trains in full. A
    `base_dtype` (the compute dtype under mixed precision) holds each frozen base."""
    critic_lora = critic_spec.lora if critic_spec is not None else policy_spec.lora
    if policy_spec.lora is not None and critic is not None and critic_lora is None:
        rank_zero_warn(
            "model.critic has no lora of its own: the critic trains in full beside the "
            "LoRA policy (set model.critic.lora to give it adapters)"
        )
    if policy_spec.lora is not None:
        policy = with_adapters(policy, policy_spec.lora, "policy")
    if critic is not None and critic_lora is not None:
        critic = with_adapters(critic, critic_lora, "critic", value_head=_value_head_name(critic))
    for model in (policy, critic):
        if base_dtype is not None and is_lora(model):
            keep_base_in(model, base_dtype)
    return policy, critic


def weights_from_source(policy_spec: ModelSpec, critic_spec: ModelSpec | None) -> dict[str, bool]:
    """Whether each model's weights as built come from a source (a folder or hub id), not a
    random initialisation: a LoRA checkpoint leaves those out (`lora.drop_frozen`)."""
    policy = policy_spec.name_or_path is not None
    own = critic_spec is not None and (critic_spec.name_or_path or critic_spec.config) is not None
    return {"policy": policy, "critic": critic_spec.name_or_path is not None if own else policy}


def _value_head_name(model: PreTrainedModel) -> str:
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), nn.Linear):
            return name
    raise TypeError(f"{type(model).__name__} has no linear score/classifier head to use as value head")


def _value_head(model: PreTrainedModel) -> nn.Linear:
    return getattr(model, _value_head_name(model))


def _meta_device(meta: bool) -> contextlib.AbstractContextManager:
    return torch.device("meta") if meta else contextlib.nullcontext()


def _saved_generation_config(path: str, model: PreTrainedModel) -> GenerationConfig:
    """`generation_config.json` of `path`, as `from_pretrained` loads it (sampling defaults such
    as top_p differ per model); the config's defaults when the checkpoint has none."""
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return model.generation_config


def _finish(model: PreTrainedModel, gradient_checkpointing: bool, own_attention: bool = False) -> PreTrainedModel:
    cfg = model.config
    if cfg._attn_implementation == "sdpa" and cfg.model_type in STANDARD_SDPA and not own_attention:
        model.set_attn_implementation(SDPA)  # fp32 attention on the CPU under autocast
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.float()


def check_torch_compile() -> None:
    """`compile_in_place` needs `torch.compiler.set_stance` (torch >= 2.6)."""
    if not hasattr(torch.compiler, "set_stance"):
        raise ValueError(
            f"model.torch_compile needs torch >= 2.6 (torch.compiler.set_stance keeps the "
            f"sampler eager); this is torch {torch.__version__}. Upgrade torch, or set it false "
            "(load_from_checkpoint(..., torch_compile=False) for a compiled run's checkpoint)."
        )


def compile_in_place(*models: torch.nn.Module | None) -> None:
    """`torch.compile`s each model in place (same parameters and state_dict keys, hooks
    included): whole models, where verl's use_torch_compile compiles only its entropy function.
    The sampler runs them eager (its KV cache grows at each step: `engines.sampler.eager`)."""
    # Policy and critic share one code object (transformers' forward wrapper), and each needs
    # a few graphs (grad / no grad, static then dynamic shapes, small / large batches): past
    # dynamo's default limit (8) they would fall back to eager (one warning). Process-wide,
    # and left raised.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 64))
    for model in models:
        if model is not None:
            model.compile()
