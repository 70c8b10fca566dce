"""LoRA adapters on the policy and the critic, with peft (Hu et al. 2021, arXiv 2106.09685).

W x + (alpha / r) B A x: each targeted linear layer keeps its pretrained W frozen and learns a
rank-r update B A (B starts at zero, so a fresh adapter is the pretrained model). PPO's two
models then train a few million parameters instead of all of them: their gradients and AdamW
states shrink to the adapters', the backward pass skips the frozen weights' gradients, and the
reference policy of the KL term is the same model with its adapters switched off
(`AdaptersOff`), not a second copy.

The critic's value head is new, so it is always trained in full (peft's `modules_to_save`).
Policy and critic keep their own copy of the base weights: one base with two adapters would
need the critic's forward to switch peft's active adapter (which also flips `requires_grad`)
around every critic pass; a second copy of a 135 M-parameter base costs 0.27 GB in bf16.

Under mixed precision the frozen base is kept in the compute dtype (`keep_base_in`): every
matmul runs in that dtype anyway, and no optimiser needs an fp32 master copy of weights that
never change, so an fp32 base would only double the largest state of a LoRA run (2 bytes a
parameter instead of 4, for each of the two bases). This is what a TRL or verl LoRA run gets
from a model loaded in bf16; the adapters and the value head stay in fp32 (peft's
`autocast_adapter_dtype`), with their AdamW states.

Merged weights (`merged_weights`) are what leaves the trainer: the vLLM engine loads them at a
weight sync, `vapo export` and `hf_export_dir` save them; the trainer's copy stays unmerged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vapo_lightning.config import SetupError

__all__ = [
    "AdaptersOff",
    "LoRA",
    "MergedCopy",
    "base_dtype",
    "drop_frozen",
    "is_lora",
    "keep_base_in",
    "merged_weights",
    "restore_frozen",
    "with_adapters",
]


@dataclass
class LoRA:
    """The peft `LoraConfig` fields a user sets (its others keep peft's defaults)."""

    r: int = 16
    """Rank of each update B A."""
    alpha: float = 32
    """Scale: the update is (alpha / r) B A."""
    dropout: float = 0.0
    """Dropout on each adapter's input. Above 0 the update's forwards differ from pi_old's
    (the models are in train mode there), as any dropout in PPO does."""
    target_modules: list[str] | str = "all-linear"
    """Module names (or name suffixes) that get an adapter; "all-linear": every linear layer
    of the transformer blocks (attention and MLP projections, not the LM or value head)."""
    exclude_modules: list[str] = field(default_factory=list)
    """Module names kept out of `target_modules`."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise SetupError(f"lora.r must be >= 1, got {self.r}")
        if not 0 <= self.dropout < 1:
            raise SetupError(f"lora.dropout must be in [0, 1), got {self.dropout}")


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (LoRA adapters on a frozen base)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def base_dtype(precision: str) -> torch.dtype | None:
    """The dtype a LoRA base is kept in under the trainer's `precision`: the one its forwards
    compute in (bf16-mixed: bfloat16, 16-mixed: float16); None (as built) without autocast."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


PRECISION_OF_BASE = {"bfloat16": "bf16-mixed", "float16": "16-mixed", "float32": "32-true"}


def frozen_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of a LoRA model's frozen floating-point weights (its base)."""
    return next((p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()), None)


@torch.no_grad()
def keep_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Casts a LoRA model's frozen floating-point weights to `dtype`, in place; the adapters
    and a value head (trainable) keep theirs. Before the model is sharded or replicated."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    model.__dict__.pop("_vapo_base_fingerprint", None)


def _import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise SetupError("lora needs peft: pip install 'vapo-lightning[lora]' (or pip install peft)") from None
    return peft


def with_adapters(model: nn.Module, lora: LoRA, which: str, value_head: str | None = None) -> nn.Module:
    """`model` with LoRA adapters from `lora` (peft's `get_peft_model`): only the adapters,
    and the value head `value_head` if given (a critic's), stay trainable. `which` ("policy"
    or "critic") names the setting in errors."""
    peft = _import_peft()
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        exclude_modules=lora.exclude_modules or None,
        modules_to_save=[value_head] if value_head else None,
        bias="none",
    )
    name = type(model).__name__
    try:
        wrapped = peft.get_peft_model(model, config)
    except (ValueError, TypeError) as error:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        first_line = str(error).strip().splitlines()[0]
        raise SetupError(
            f"model.{which}.lora: peft cannot put adapters on {name} with target_modules="
            f"{lora.target_modules!r}: {first_line} (its linear layers: {', '.join(linear)})"
        ) from None
    adapters = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
    if adapters == 0:
        raise SetupError(f"model.{which}.lora: target_modules={lora.target_modules!r} put no adapter on {name}")
    return wrapped


class AdaptersOff:
    """The reference policy of a LoRA policy: the same model with its adapters switched off
    (the pretrained base), called as a model. Not a module, so it adds no parameters, no
    state-dict entries and no second copy of the weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def config(self) -> Any:
        return self.model.config

    def __call__(self, **inputs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(**inputs)


def _lora_layers(base: nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) of each weight of a LoRA model with its adapters merged in,
    W + (alpha / r) B A, one at a time and without changing the model: what a plain model of
    the base's architecture loads. A model without adapters: its own state dict."""
    if not is_lora(model):
        yield from model.state_dict().items()
        return
    base = model.get_base_model()
    layers = _lora_layers(base)
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter factors; a trained head's frozen original
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in layers and leaf == "weight":
            layer = layers[owner]
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            yield f"{owner}.weight", (tensor + delta).to(tensor.dtype)
        else:
            yield name.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."), tensor


class MergedCopy:
    """A plain model of a LoRA model's base architecture holding its merged weights, for
    sampling: each decoding step then makes one matmul per layer, not the base layer's plus the
    adapter's two small ones. `stale` after each change of the adapters; `refresh` copies them
    in, in place, one tensor at a time. Memory: one more copy of the base's weights, in the
    model's dtype."""

    def __init__(self, model: nn.Module) -> None:
        self.source, self.model, self.stale = model, None, True

    @torch.no_grad()
    def refresh(self) -> bool:
        """Merges the adapters into the copy (made on first use) if they changed since;
        returns whether it did."""
        if not self.stale:
            return False
        if self.model is None:
            base = self.source.get_base_model()
            weight = next(base.parameters())
            with torch.random.fork_rng(devices=[]):  # (its random start must not move the run's stream)
                model = type(base)(base.config)
            self.model = model.to(weight.device, weight.dtype).eval().requires_grad_(False)
        state = self.model.state_dict()
        for name, tensor in merged_weights(self.source):
            state[name].copy_(tensor)
        self.stale = False
        return True


def frozen_names(model: nn.Module, prefix: str) -> list[str]:
    """State-dict keys (under `prefix`) of `model`'s frozen weights: what a LoRA checkpoint
    leaves out, as the base model's source holds them."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return [f"{prefix}{n}" for n in model.state_dict() if n not in trainable]


@torch.no_grad()
def base_fingerprint(model: nn.Module) -> list[float]:
    """Two numbers that change when any frozen weight of `model` changes (the float64 sum of
    the weights and of their squares): a LoRA checkpoint keeps them to refuse a resume onto
    other base weights. A trained head's frozen original (a fresh head's random start) is
    left out. Computed once per model (the base never changes), without a float64 copy."""
    cached = getattr(model, "_vapo_base_fingerprint", None)
    if cached is not None:
        return cached
    state = model.state_dict()
    frozen = [
        state[n] for n in frozen_names(model, "") if state[n].is_floating_point() and ".original_module." not in n
    ]
    total = sum(float(torch.sum(t, dtype=torch.float64)) for t in frozen)
    squares = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in frozen)
    model._vapo_base_fingerprint = [total, squares]
    return model._vapo_base_fingerprint


# --------------------------------------------------------------------------- checkpoints


def drop_frozen(checkpoint: dict[str, Any], models: dict[str, nn.Module | None], from_source: dict[str, bool]) -> None:
    """A LoRA model's checkpoint holds its adapters (and value head), not the frozen base
    weights its source (a folder or hub id) already holds: those keys leave
    `checkpoint["state_dict"]` and a fingerprint of them stays, for `restore_frozen` to check.
    A base initialised at random (`from_source` False) has no source: it stays in the
    checkpoint. `models`: state-dict prefix -> model."""
    bases: dict[str, list[float] | None] = {}
    dtypes: dict[str, str] = {}
    for prefix, model in models.items():
        if model is None or not is_lora(model):
            continue
        bases[prefix] = None
        if from_source[prefix]:
            for key in frozen_names(model, f"{prefix}."):
                checkpoint["state_dict"].pop(key, None)
            bases[prefix] = base_fingerprint(model)
            dtypes[prefix] = str(frozen_dtype(model)).removeprefix("torch.")
    if bases:
        checkpoint["lora_base"], checkpoint["lora_base_dtype"] = bases, dtypes


def restore_frozen(
    checkpoint: dict[str, Any], models: dict[str, nn.Module | None], source: str, cast: bool = False
) -> None:
    """Puts the frozen base weights of the models as built (read from their source) back into
    a LoRA checkpoint's state dict, so that it loads strictly, after checking they are the
    weights its adapters were trained on, in the dtype it was trained with (`cast`: a base
    built wider is cast to it, as an export does; otherwise a base in another dtype, another
    `trainer.precision`, is refused). A LoRA checkpoint into a model without adapters, or the
    reverse, is refused in one line naming `source` (the checkpoint's path)."""
    bases, dtypes = checkpoint.get("lora_base", {}), checkpoint.get("lora_base_dtype", {})
    for prefix, model in models.items():
        if model is None:
            continue
        here, there = is_lora(model), prefix in bases
        if here != there:
            kind = {True: "LoRA adapters", False: "full weights"}
            raise SetupError(
                f"{source} holds {kind[there]} for the {prefix}, but model.{prefix}.lora "
                f"{'is not set' if there else 'is set'}: resume with the settings it was trained "
                f"with (its hyper-parameters), or start a new run"
            )
        if not here or bases[prefix] is None:  # (a random base: saved in the checkpoint)
            continue
        trained, built = dtypes.get(prefix, "float32"), str(frozen_dtype(model)).removeprefix("torch.")
        if trained != built and cast and built == "float32":
            keep_base_in(model, getattr(torch, trained))
        elif trained != built:
            raise SetupError(
                f"{source}: the {prefix}'s LoRA adapters were trained on its base in {trained}, "
                f"this run keeps it in {built}: resume with the trainer.precision it was trained "
                f"with ({PRECISION_OF_BASE.get(trained, trained)})"
            )
        if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(base_fingerprint(model), bases[prefix])):
            raise SetupError(
                f"{source}: the {prefix}'s base weights differ from those its LoRA adapters were "
                f"trained on (model.{prefix}.name_or_path changed since?)"
            )
        state = model.state_dict()
        for key in frozen_names(model, ""):
            checkpoint["state_dict"].setdefault(f"{prefix}.{key}", state[key])
