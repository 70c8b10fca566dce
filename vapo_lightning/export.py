"""`vapo export --ckpt_path runs/x/checkpoints/last.ckpt --out DIR`: a checkpoint's policy
(with its tokenizer) and critic in Hugging Face format, after the run (or after it died: a
sharded fsdp checkpoint folder is read in one process too), as `model.hf_export_dir`
writes them at the end of fit (`DIR/policy`, `DIR/critic`). A LoRA run's models are saved with
their adapters merged in (plain transformers loads them); `--adapters` also writes the adapters
alone (`DIR/policy_adapter`, `DIR/critic_adapter`, peft's format)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from vapo_lightning.checkpoint import AtomicCheckpointIO, CheckpointError
from vapo_lightning.distributed import save_pretrained
from vapo_lightning.lora import is_lora, restore_frozen

__all__ = ["export_checkpoint", "main"]


def export_checkpoint(ckpt_path: str | Path, out: str | Path, adapters: bool = False) -> list[Path]:
    """Rebuilds the module from the checkpoint's hyper-parameters, loads its weights and
    saves each model with `save_pretrained` (LoRA: merged; `adapters`: also the adapters
    alone); returns the folders written."""
    from vapo_lightning.module import VAPOModule

    ckpt = (
        read_sharded(Path(ckpt_path))
        if Path(ckpt_path).is_dir()
        else AtomicCheckpointIO().load_checkpoint(ckpt_path, map_location="cpu")
    )
    hparams = {**ckpt.get("hyper_parameters", {}), "torch_compile": False}
    if "policy" not in hparams:
        raise CheckpointError(f"checkpoint {ckpt_path} was not written by a VAPO run")
    module = VAPOModule(**hparams)
    module.configure_model()
    models = module.trained_models
    restore_frozen(ckpt, models, str(ckpt_path), cast=True)  # LoRA: the base from its source
    module.load_state_dict(ckpt["state_dict"])
    if adapters and not any(is_lora(m) for m in models.values()):
        raise CheckpointError(f"--adapters: {ckpt_path} is a full fine-tuning run, it has no adapters")
    written = []
    for name, model in models.items():
        if model is None:
            continue
        written.append(Path(out) / name)
        save_pretrained(model, module.tokenizer, written[-1], True)
        if adapters and is_lora(model):
            written.append(Path(out) / f"{name}_adapter")
            model.save_pretrained(written[-1])  # peft: adapter_config.json + the adapter weights
            module.tokenizer.save_pretrained(written[-1])
    return written


def read_sharded(folder: Path) -> dict:
    """A sharded (fsdp) checkpoint folder as one process reads it: Lightning's metadata file
    (hyper-parameters, counters) and the full weights assembled from every rank's shard (the
    optimiser states, as large again, are not read)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    meta = folder / "meta.pt"
    if not meta.exists():
        raise CheckpointError(f"{folder}: no meta.pt, not a complete sharded checkpoint of a VAPO run")
    ckpt = torch.load(meta, map_location="cpu", weights_only=False)
    ckpt["state_dict"] = _load_state_dict_from_keys({"state_dict"}, checkpoint_id=str(folder))["state_dict"]
    return ckpt


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="vapo export",
        description="Save a checkpoint's policy (with tokenizer) and critic in Hugging Face format.",
    )
    ap.add_argument(
        "--ckpt_path", required=True, help="a .ckpt file or sharded (fsdp) checkpoint folder written by vapo fit"
    )
    ap.add_argument("--out", required=True, help="folder for policy/ and critic/")
    ap.add_argument(
        "--adapters",
        action="store_true",
        help="LoRA runs: also write the adapters alone (policy_adapter/, critic_adapter/; peft)",
    )
    args = ap.parse_args(argv)
    for folder in export_checkpoint(args.ckpt_path, args.out, args.adapters):
        print(f"wrote {folder}")
