"""Compute study: the machine's matmul rate, the fraction of it VAPO's training
phase reaches, and how the rollout step grows with response length (64 → 512 tokens).

All in one process, one run: first the matmul rate (fp32 and bf16, the threads torch uses), then
VAPOModule rollout steps at each response length (fixed length: `min_new_tokens` =
`max_new_tokens`) on the shapes of `bench_trainer.py` (Llama 3 × 256, 16 prompts × 4
samples, one mini-batch). The training phase's FLOPs are counted by
`torch.utils.flop_counter.FlopCounterMode` on the same forward/backward the update runs
(policy and critic), so the achieved rate is counted work / measured update time.

    .venv/bin/python benchmarks/bench_compute.py --out benchmarks/results/compute.md
    .venv/bin/python benchmarks/bench_compute.py --precision bf16 --out benchmarks/results/compute_bf16.md

`--precision bf16` trains in Lightning's bf16-mixed (fp32 weights, bf16 autocast) and measures
the fraction of the bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stamp import stamp
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.data import PromptDataModule
from vapo_lightning.models import ModelSpec
from vapo_lightning.module import VAPOModule
from vapo_lightning.rewards.math import MathReward

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "vapo_lightning/assets/quickstart_sft"
POLICY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}
PROMPTS, N = 16, 4
LENGTHS = (64, 128, 256, 512)
PHASES = ("gen", "old_log_prob", "values", "update_critic", "update_actor")


def matmul_rate(size: int, dtype: torch.dtype = torch.float32, repeats: int = 10) -> float:
    """Best GFLOP/s of a (size × size) @ (size × size) product in `dtype`."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


class StepRecorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.rollout = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):
        self.steps.append(
            {k[len("timing_s/") :]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("timing_s/")}
        )


def run(T: int, steps: int, precision: str) -> tuple[VAPOModule, list[dict[str, float]]]:
    L.seed_everything(0, verbose=False)
    module = VAPOModule(
        policy=ModelSpec(config=POLICY, tokenizer=str(TOKENIZER)),
        algorithm=Algorithm(mini_batch_size=PROMPTS * N, micro_batch_size=PROMPTS * N),
        generation=Generation(n=N, max_new_tokens=T, min_new_tokens=T),
        optim=Optim(actor_lr=1e-5, critic_lr=1e-5, warmup_steps=0),
        val_before_train=False,
    )
    recorder = StepRecorder()
    data = PromptDataModule(
        train=str(ROOT / "vapo_lightning/assets/arithmetic/train.jsonl"),
        prompts_per_step=PROMPTS,
        chat_template=False,
    )
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        precision="bf16-mixed" if precision == "bf16" else "32-true",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MathReward(num_workers=1), recorder],
    )
    trainer.fit(module, datamodule=data)
    return module, recorder.steps[1:]  # the first step pays one-off start-up costs


def update_flops(module: VAPOModule, T: int) -> int:
    """FLOPs of one update phase: forward + backward of policy and critic on the rollout's
    shapes (B = prompts × n sequences of prompt + T tokens), as the updates run them."""
    tok = module.tokenizer
    prompts = [r["prompt_ids"] for r in module.trainer.datamodule.train_rows[:PROMPTS]]
    P = max(map(len, prompts))
    ids = torch.randint(3, len(tok), (PROMPTS * N, P + T))
    counter = FlopCounterMode(display=False)
    with counter:
        module.policy(input_ids=ids, logits_to_keep=T + 1).logits.sum().backward()
        module.critic(input_ids=ids).logits.sum().backward()
    module.policy.zero_grad(set_to_none=True)
    module.critic.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def plot(rows: list[dict], out_png: Path, precision: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(rows)
    xs = [str(r["T"]) for r in rows]
    for phase in PHASES:
        heights = [r["phases"][phase] for r in rows]
        ax.bar(xs, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("response length (tokens, fixed)")
    ax.set_ylabel("seconds per rollout step (median)")
    ax.set_title(f"VAPO rollout step vs response length ({PROMPTS}x{N} responses, CPU {precision})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="rollout steps per length (first dropped)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default: stdout)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (matmul and trainer)")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the trainer's: fp32, or bf16 mixed precision (bf16 autocast)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peak = {(p, size): matmul_rate(size, dt) for p, dt in dtypes.items() for size in (512, 1024, 2048)}
    best = max(r for (p, _), r in peak.items() if p == args.precision)
    rows = []
    for T in LENGTHS:
        module, steps = run(T, args.steps, args.precision)
        phases = {p: statistics.median(s.get(p, 0.0) for s in steps) for p in PHASES}
        step = statistics.median(s["step"] for s in steps)
        flops = update_flops(module, T)
        update = phases["update_critic"] + phases["update_actor"]
        rows.append({"T": T, "step": step, "phases": phases, "flops": flops, "update": update})
    peak_after = matmul_rate(2048, dtypes[args.precision])
    suffix = "" if args.precision == "fp32" else f"_{args.precision}"  # of the plot's file

    out = [
        "# Compute study: matmul rate, training-phase utilisation, step time vs response length\n",
        f"Command: `.venv/bin/python benchmarks/bench_compute.py --threads {args.threads} "
        + ("" if args.precision == "fp32" else f"--precision {args.precision} ")
        + (f"--out {args.out}`  " if args.out else "`  "),
        f"{stamp()}; {torch.get_num_threads()} threads; "
        f"load average before {load_before}, after {Path('/proc/loadavg').read_text().split()[:3]}  ",
        f"Shapes: Llama 3 × 256 policy and critic, {PROMPTS} prompts × {N} samples, fixed-length "
        "responses, one mini-batch, "
        + ("fp32" if args.precision == "fp32" else "bf16 mixed precision (fp32 weights, bf16 autocast)")
        + f"; median of {args.steps - 1} steps per length.\n",
        "## Matmul rate (square products, best of 10)\n",
        "| size | fp32 GFLOP/s | bf16 GFLOP/s |\n|---|---|---|",
        *[f"| {s} | {peak['fp32', s]:.1f} | {peak['bf16', s]:.1f} |" for s in (512, 1024, 2048)],
        "| 2048, after the trainer runs | "
        + (f"{peak_after:.1f} | |" if args.precision == "fp32" else f" | {peak_after:.1f} |"),
        "\n## Step time by phase and training-phase utilisation\n",
        "| response tokens | step s | "
        + " | ".join(f"{p} s" for p in PHASES)
        + f" | update GFLOP | update GFLOP/s | fraction of the {args.precision} matmul peak |",
        "|---" * (len(PHASES) + 5) + "|",
    ]
    for r in rows:
        rate = r["flops"] / r["update"] / 1e9
        out.append(
            f"| {r['T']} | {r['step']:.2f} | "
            + " | ".join(f"{r['phases'][p]:.2f}" for p in PHASES)
            + f" | {r['flops'] / 1e9:.1f} | {rate:.1f} | {rate / best:.0%} |"
        )
    growth = rows[-1]["step"] / rows[0]["step"]
    out += [
        f"\nFrom {LENGTHS[0]} to {LENGTHS[-1]} tokens ({LENGTHS[-1] // LENGTHS[0]}x the tokens) the step "
        f"grows {growth:.1f}x. The update phase's FLOPs are counted by FlopCounterMode on one "
        "forward + backward of each model (the optimiser step is not counted). One epoch over one "
        "mini-batch runs no separate no-grad forwards (pi_old and V_old come from the updates' own "
        "forwards), so old_log_prob and values are 0 here.",
        f"\n![step time vs response length](compute_step_time{suffix}.png)",
    ]
    text = "\n".join(out) + "\n"
    if args.out:
        args.out.write_text(text)
        plot(rows, args.out.parent / f"compute_step_time{suffix}.png", args.precision)
    print(text)


if __name__ == "__main__":
    main()
