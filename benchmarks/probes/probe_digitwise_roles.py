"""Probe: where a digitwise SFT model's loss is, by the role of the token it predicts.

A digitwise step is 8 tokens, ``" a" ")" " " x "+" y "=" z``: the label and the punctuation
follow from the format, x and y are copied from the prompt (found by the label), z is
(x + y) mod 10. The mean loss of a run hides which of these the model has learned; this
probe splits it, on the validation problems of the SFT config, for SFT checkpoints (as
`ModelCheckpoint` writes them) or exported models. ln 10 = 2.30 nats is chance on a digit.
The references scored are the clean solutions, so a model calibrated to the demonstrations'
slips has a floor of -ln(1 - slip_rate) under z: 0.078 nats at a 7.5 % slip rate.

    .venv/bin/python benchmarks/probes/probe_digitwise_roles.py runs/digitwise_sft_snapshots/*.ckpt

Checkpoints need the data module's tokenizer, rebuilt from `--config` (deterministic, a few
minutes for 128,000 rows); an exported model brings its own.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.sft.data import IGNORE_INDEX, TASKS, SFTDataModule
from vapo_lightning.sft.module import SFTModule

ROLES = ["label", ")", "space", "x", "+", "y", "=", "z"]  # a step's tokens, in order
FORMAT = {")": ")", "space": " ", "+": "+", "=": "="}


def roles(tokenizer, response_ids: list[int]) -> list[str]:
    """The role of each response token (the last one is EOS); raises if a step's tokens do
    not have the digitwise format."""
    out = []
    for j, tid in enumerate(response_ids[:-1]):
        role, text = ROLES[j % 8], tokenizer.decode([tid])
        ok = (
            text == FORMAT[role]
            if role in FORMAT
            else text.isdigit()
            if role in ("x", "y", "z")
            else re.fullmatch(r" [a-z]", text)
        )
        if not ok:
            raise ValueError(f"token {j} of a response is {text!r}, expected the {role!r} of a step")
        out.append(role)
    return [*out, "EOS"]


@torch.no_grad()
def role_losses(model, data: SFTDataModule, rows: list[dict]) -> dict[str, float]:
    """Mean next-token loss (nats) per role over the rows' reference responses."""
    examples = data._encode(rows)
    batch = data._collate_train(examples)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2),
        batch["labels"][:, 1:],
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    sums: dict[str, list[float]] = {}
    for i, e in enumerate(examples):
        P = len(e.prompt_ids)
        for j, role in enumerate(roles(data.tokenizer, e.response_ids)):
            s = sums.setdefault(role, [0.0, 0])
            s[0] += float(ce[i, P + j - 1])
            s[1] += 1
    return {role: total / n for role, (total, n) in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="SFT checkpoints (.ckpt) or exported model folders")
    ap.add_argument("--config", default="configs/digitwise_sft.yaml")
    ap.add_argument("--rows", type=int, default=200, help="validation problems scored")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = yaml.safe_load(Path(args.config).read_text())["data"]
    if cfg.get("task") != "digitwise":
        raise SystemExit(f"{args.config}: data.task must be digitwise, got {cfg.get('task')!r}")
    data = None
    print(
        f"Per-role loss (nats) on {args.rows} validation problems of {args.config}; chance on "
        f"a digit {math.log(10):.2f}\n"
    )
    print("| model | step | label | x | y | z | EOS | format tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.models:
        if path.endswith(".ckpt"):
            if data is None:
                data = SFTDataModule(**cfg)
            module = SFTModule.load_from_checkpoint(path, tokenizer=data.tokenizer, map_location="cpu")
            model, step, d = module.model, torch.load(path, map_location="cpu", weights_only=False)["global_step"], data
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            d = SFTDataModule.__new__(SFTDataModule)
            d.tokenizer = AutoTokenizer.from_pretrained(path)
            model, step = AutoModelForCausalLM.from_pretrained(path), "-"
        rows = read_jsonl(cfg.get("val_path") or TASKS["digitwise"].assets / "val.jsonl")
        loss = role_losses(model.eval(), d, rows[: args.rows])
        fmt = sum(loss[r] for r in FORMAT) / len(FORMAT)
        print(
            f"| {Path(path).name} | {step} | {loss['label']:.3f} | {loss['x']:.3f} | {loss['y']:.3f} "
            f"| {loss['z']:.3f} | {loss['EOS']:.3f} | {fmt:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
