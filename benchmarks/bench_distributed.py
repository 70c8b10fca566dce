"""Step time and peak RSS per process: 1 process vs 2 (ddp, fsdp) on tiny_cpu shapes.

Runs `vapo fit -c configs/tiny_cpu.yaml` as a subprocess per setting on the same global batch
(8 prompts x 4 responses of <= 32 tokens, mini-batches of 16 responses overall); the `Probe`
callback writes each rank's rollout-step wall times and peak RSS. The first step (warm-up,
lazy DDP / FSDP initialisation) is left out of the median.

    python -m benchmarks.bench_distributed [--steps 6] [--out benchmarks/results/distributed.md]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]


class Probe(L.Callback):
    """Per rank: wall time of each rollout step and the peak RSS, written at the end of fit."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.times, self.start = out_dir, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer, pl_module) -> None:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        rank = trainer.global_rank
        Path(self.out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {"times": self.times, "peak_rss_mb": peak_mb, "threads": torch.get_num_threads()}
            )
        )


def run(
    strategy: str, devices: int, steps: int, out_dir: Path, threads: int | None = None
) -> list[dict]:
    per_rank_prompts, mini = 8 // devices, 16 // devices
    cmd = [
        sys.executable, "-m", "vapo_lightning.cli", "fit", "-c", "configs/tiny_cpu.yaml",
        f"--trainer.devices={devices}", f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={out_dir}", "--trainer.enable_progress_bar=false",
        "--model.val_before_train=false", f"--data.prompts_per_step={per_rank_prompts}",
        f"--model.algorithm.mini_batch_size={mini}", f"--model.algorithm.micro_batch_size={mini}",
        "--model.generation.min_new_tokens=32",  # fixed-length responses: comparable steps
        "--trainer.callbacks+=benchmarks.bench_distributed.Probe",
        f"--trainer.callbacks.out_dir={out_dir}",
    ]  # fmt: skip
    if devices > 1:
        cmd.append(f"--trainer.strategy={strategy}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:  # otherwise torch's default (cores); Lightning gives each of 2 ranks cores / 2
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(devices)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for strategy, devices, threads in [
        ("single", 1, None),
        ("single", 1, 1),
        ("ddp", 2, None),
        ("fsdp", 2, None),
    ]:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run(strategy, devices, args.steps, Path(tmp), threads)
        step = max(statistics.median(r["times"][1:]) for r in ranks)
        rss = [round(r["peak_rss_mb"]) for r in ranks]
        rows.append((strategy, devices, step, rss, ranks[0]["threads"]))
        print(
            f"{strategy:6s} x{devices}: step {step:.2f} s, peak RSS {rss} MB, steps {[round(t, 2) for r in ranks for t in r['times']]}",
            flush=True,
        )
    lines = [
        "| setting | processes | torch threads / process | median step (s) | peak RSS per process (MB) |",
        "|---|---|---|---|---|",
        *[
            f"| {s} | {d} | {t} | {st:.2f} | {', '.join(map(str, rss))} |"
            for s, d, st, rss, t in rows
        ],
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
