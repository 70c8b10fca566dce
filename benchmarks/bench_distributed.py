"""Step time and peak RSS per process: 1 process vs 2 (ddp, fsdp) on tiny_cpu shapes; and,
with `--load`, the host memory each rank spends loading a saved checkpoint.

Runs `vapo fit -c configs/tiny_cpu.yaml` as a subprocess per setting on the same global batch
(8 prompts x 4 responses of <= 32 tokens, mini-batches of 16 responses overall); the `Probe`
callback writes each rank's rollout-step wall times and peak RSS. The first step (warm-up,
lazy DDP / FSDP initialisation) is left out of the median.

`--load` saves a Llama of a few hundred MB (fp32; `--hidden`, `--layers`, `--vocab`) and runs
`vapo fit` on it with `max_steps=0`: `LoadProbe` writes each rank's RSS before the models are
built and its peak once they are built and sharded. Under ddp every rank loads the full policy
and critic; under fsdp only rank 0 does, rank 1 holds its shards and one tensor in flight.

    python -m benchmarks.bench_distributed --steps 6 --out benchmarks/results/distributed.md
    python -m benchmarks.bench_distributed --load [--out benchmarks/results/distributed_load.md]
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
sys.path.insert(0, str(ROOT))

from benchmarks.stamp import stamp  # noqa: E402


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
            json.dumps({"times": self.times, "peak_rss_mb": peak_mb, "threads": torch.get_num_threads()})
        )


def rss_mb() -> float:
    """The current resident set size (Linux)."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024


class LoadProbe(L.Callback):
    """Per rank: RSS before `configure_model` builds the models (callbacks' `setup` runs first)
    and the peak RSS at `on_fit_start`, once they are built, sharded and filled."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.before_mb = out_dir, 0.0

    def setup(self, trainer, pl_module, stage) -> None:
        self.before_mb = rss_mb()

    def on_fit_start(self, trainer, pl_module) -> None:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        Path(self.out_dir, f"load{trainer.global_rank}.json").write_text(
            json.dumps({"before_mb": self.before_mb, "peak_mb": peak_mb, "after_mb": rss_mb()})
        )


def fit(cmd_args: list[str], out_dir: Path, devices: int, prefix: str, threads: int | None = None) -> list[dict]:
    """`vapo fit -c configs/tiny_cpu.yaml` with `cmd_args`; each rank's `{prefix}{rank}.json`."""
    cmd = [
        sys.executable,
        "-m",
        "vapo_lightning.cli",
        "fit",
        "-c",
        "configs/tiny_cpu.yaml",
        f"--trainer.devices={devices}",
        f"--trainer.default_root_dir={out_dir}",
        "--trainer.enable_progress_bar=false",
        "--model.val_before_train=false",
        *cmd_args,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:  # otherwise torch's default (cores); Lightning gives each of 2 ranks cores / 2
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return [json.loads(Path(out_dir, f"{prefix}{r}.json").read_text()) for r in range(devices)]


def run(
    strategy: str,
    devices: int,
    steps: int,
    out_dir: Path,
    threads: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[dict]:
    per_rank_prompts, mini = 8 // devices, 16 // devices
    args = [
        f"--trainer.max_steps={steps}",
        f"--data.prompts_per_step={per_rank_prompts}",
        f"--model.algorithm.mini_batch_size={mini}",
        f"--model.algorithm.micro_batch_size={mini}",
        "--model.generation.min_new_tokens=32",  # fixed-length responses: comparable steps
        "--trainer.callbacks+=benchmarks.bench_distributed.Probe",
        f"--trainer.callbacks.out_dir={out_dir}",
        *extra,
    ]
    if devices > 1:
        args.append(f"--trainer.strategy={strategy}")
    return fit(args, out_dir, devices, "rank", threads)


def save_llama(directory: Path, hidden: int, layers: int, vocab: int) -> float:
    """A random Llama saved with `save_pretrained`; returns its fp32 size in MB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=vocab,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters()) * 4 / 2**20


def bench_load(args: argparse.Namespace) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        policy_mb = save_llama(Path(tmp, "ckpt"), args.hidden, args.layers, args.vocab)
        print(f"policy {policy_mb:.0f} MB fp32 (critic: its backbone + a value head)", flush=True)
        for strategy, devices in [("single", 1), ("ddp", 2), ("fsdp", 2)]:
            out = Path(tmp, strategy)
            out.mkdir()
            cmd_args = [
                f"--model.policy.name_or_path={tmp}/ckpt",
                "--model.policy.config=null",
                "--trainer.max_steps=0",
                "--trainer.logger=false",
                "--trainer.callbacks+=benchmarks.bench_distributed.LoadProbe",
                f"--trainer.callbacks.out_dir={out}",
            ] + ([f"--trainer.strategy={strategy}"] if devices > 1 else [])
            ranks = fit(cmd_args, out, devices, "load")
            for rank, r in enumerate(ranks):
                cost = r["peak_mb"] - r["before_mb"]
                rows.append(
                    f"| {strategy} | {rank} | {r['before_mb']:.0f} | {r['peak_mb']:.0f} | "
                    f"{cost:.0f} | {r['after_mb']:.0f} |"
                )
                print(rows[-1], flush=True)
    return [
        "# Distributed: host memory of loading a saved checkpoint, 1 vs 2 processes\n",
        "    python -m benchmarks.bench_distributed --load --out benchmarks/results/distributed_load.md\n",
        f"{stamp()}; load average at the end "
        f"{Path('/proc/loadavg').read_text().split()[:3]} (memory, not time, is measured).\n",
        f"Loading a saved Llama of {policy_mb:.0f} MB fp32 (hidden {args.hidden}, {args.layers} "
        f"layers, vocab {args.vocab}) as policy and critic; RSS in MB per rank.",
        "",
        "| setting | rank | RSS before building | peak RSS after loading | load cost (peak - before) | RSS after loading |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Reading: under fsdp only rank 0 reads the weights (from_pretrained); rank 1 builds on the "
        "meta device and receives its shards by broadcast, so it never holds the full weights "
        "(its peak is its half of policy + critic); rank 0 peaks while it still holds the full "
        "copy and its shards. After loading each rank holds half.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", action="store_true", help="measure the memory of loading instead")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    if args.load:
        lines = bench_load(args)
        print("\n".join(lines))
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        return
    rows = []
    for strategy, devices, threads, extra in [
        ("single", 1, None, ()),
        ("single", 1, 1, ()),
        ("ddp", 2, None, ()),
        ("fsdp", 2, None, ()),  # sampling gathers the policy's weights once per rollout
        ("fsdp", 2, None, ("--model.generation.gather_weights=false",)),  # per layer per step
    ]:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run(strategy, devices, args.steps, Path(tmp), threads, extra)
        if extra:
            strategy += ", gather_weights=false"
        step = max(statistics.median(r["times"][1:]) for r in ranks)
        rss = [round(r["peak_rss_mb"]) for r in ranks]
        rows.append((strategy, devices, step, rss, ranks[0]["threads"]))
        print(
            f"{strategy:6s} x{devices}: step {step:.2f} s, peak RSS {rss} MB, steps {[round(t, 2) for r in ranks for t in r['times']]}",
            flush=True,
        )
    step = {name: st for name, _, st, _, threads in rows if not (name == "single" and threads == 1)}
    lines = [
        "# Distributed: 1 vs 2 processes on tiny_cpu shapes (CPU, gloo)\n",
        f"    python -m benchmarks.bench_distributed --steps {args.steps} --out benchmarks/results/distributed.md\n",
        f"{stamp()}; load average at the end {Path('/proc/loadavg').read_text().split()[0]}\n",
        "`vapo fit -c configs/tiny_cpu.yaml` (a tiny Llama, policy + critic), the same global batch in",
        "every row: 8 prompts x 4 responses forced to 32 tokens, mini-batches of 16 responses overall.",
        f"Step = wall time of one rollout step, median over steps 2-{args.steps}, slowest rank; peak RSS",
        "= ru_maxrss of each rank's process. Lightning gives each of 2 ranks 1 torch thread; torch's",
        "default in one process is 2. Process start-up (imports, process group) is not in the steps.\n",
        "| setting | processes | torch threads / process | median step (s) | peak RSS per process (MB) |",
        "|---|---|---|---|---|",
        *[f"| {s} | {d} | {t} | {st:.2f} | {', '.join(map(str, rss))} |" for s, d, st, rss, t in rows],
        "",
        "Reading: at these shapes a step is a fraction of a second of compute, so 2 processes cannot be",
        "faster than one; the rows measure overhead. Gathering the sharded policy once per rollout",
        "(`generation.gather_weights`, the default) takes FSDP2's step from "
        f"{step['fsdp, gather_weights=false']:.2f} to {step['fsdp']:.2f} s",
        f"(one process with 2 threads: {step['single']:.2f} s); it costs one full copy of the policy's weights",
        "per device while sampling.",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
