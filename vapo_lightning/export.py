"""`vapo export --ckpt_path runs/x/checkpoints/last.ckpt --out DIR`: a checkpoint's policy
(with its tokenizer) and critic in Hugging Face format, after the run, as `model.hf_export_dir`
writes them at the end of fit (`DIR/policy`, `DIR/critic`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from vapo_lightning.checkpoint import AtomicCheckpointIO, CheckpointError
from vapo_lightning.distributed import save_pretrained

__all__ = ["export_checkpoint", "main"]


def export_checkpoint(ckpt_path: str | Path, out: str | Path) -> list[Path]:
    """Rebuilds the module from the checkpoint's hyper-parameters, loads its weights and
    saves each model with `save_pretrained`; returns the folders written."""
    from vapo_lightning.module import VAPOModule

    if Path(ckpt_path).is_dir():
        raise CheckpointError(
            f"{ckpt_path} is a sharded (fsdp) checkpoint folder; export it from a run with "
            "model.hf_export_dir, or convert it with torch.distributed.checkpoint first"
        )
    ckpt = AtomicCheckpointIO().load_checkpoint(ckpt_path, map_location="cpu")
    hparams = {**ckpt.get("hyper_parameters", {}), "torch_compile": False}
    if "policy" not in hparams:
        raise CheckpointError(f"checkpoint {ckpt_path} was not written by a VAPO run")
    module = VAPOModule(**hparams)
    module.configure_model()
    module.load_state_dict(ckpt["state_dict"])
    written = [Path(out) / "policy"]
    save_pretrained(module.policy, module.tokenizer, written[0], True)
    if module.critic is not None:
        written.append(Path(out) / "critic")
        save_pretrained(module.critic, module.tokenizer, written[1], True)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="vapo export",
        description="Save a checkpoint's policy (with tokenizer) and critic in Hugging Face format.",
    )
    ap.add_argument("--ckpt_path", required=True, help="a .ckpt file written by vapo fit")
    ap.add_argument("--out", required=True, help="folder for policy/ and critic/")
    args = ap.parse_args(argv)
    for folder in export_checkpoint(args.ckpt_path, args.out):
        print(f"wrote {folder}")
