"""The two rollout engines on the same rollouts: this package's native sampler against vLLM.

Each engine runs in its own process (peak memory is per process), on the same prompts and
sampling settings, every response forced to the same length (EOS suppressed) so both make
the same tokens:

1. rollout: `reps` calls of prompts × n responses, after one warm-up; generated tokens/s;
2. weight sync (vLLM): `VLLMEngine.load_weights` of the policy after an optimizer step;
3. training step: `fit_steps` rollout steps of VAPOModule through Lightning (no value
   pretraining, so every step updates the actor and the next one loads new weights); the
   median of `timing_s/step`, `timing_s/gen` and `timing_s/weight_sync` after the first.

Shapes: `quickstart` (the SFT policy shipped in the package, 2.0 M parameters, fp32 on the
CPU) and `qwen2.5-1.5b` (Qwen2.5-1.5B's architecture built from its config, random weights,
bf16; nothing is downloaded), the GPU target: 512 prompts × 4 responses of 1024 tokens.

    .venv/bin/python -m benchmarks.bench_engines --out benchmarks/results/engines_cpu.md
    python -m benchmarks.bench_engines --device cuda --shape qwen2.5-1.5b --out $OUT/engines_gpu.md
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stamp import stamp  # noqa: E402

ASSET = ROOT / "vapo_lightning/assets/quickstart_sft"
PROMPTS = ROOT / "vapo_lightning/assets/arithmetic/train.jsonl"
QWEN25_1_5B = {  # Qwen/Qwen2.5-1.5B's config.json (architecture only)
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "architectures": ["Qwen2ForCausalLM"],
}
DEFAULTS = {  # shape: (prompts, n, new tokens, reps, fit steps, micro-batch)
    "quickstart": (16, 8, 128, 3, 3, 32),
    "qwen2.5-1.5b": (512, 4, 1024, 2, 3, 16),
}


def policy_spec(shape: str) -> dict:
    if shape == "quickstart":
        return {"name_or_path": str(ASSET)}
    return {"config": QWEN25_1_5B, "tokenizer": str(ASSET)}


def used_memory_gb(device: str) -> float:
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB -> GiB)


def logged(root: str, tags: list[str]) -> list[list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = Path(root).glob("**/events.out.tfevents.*")
    acc = EventAccumulator(str(path))
    acc.Reload()
    return [[e.value for e in acc.Scalars(tag)] for tag in tags]


def child(args: argparse.Namespace) -> dict:
    """One engine: rollout, weight sync and training-step times, as one JSON dict."""
    import lightning as L

    from vapo_lightning.config import Algorithm, Generation, Optim, VLLMOptions
    from vapo_lightning.data import PromptDataModule
    from vapo_lightning.models import ModelSpec
    from vapo_lightning.module import VAPOModule
    from vapo_lightning.rewards.math import MathReward

    torch.manual_seed(0)
    on_gpu = args.device == "cuda"
    options = VLLMOptions(gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=1)
    gen = Generation(
        n=args.n,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        engine=args.engine,
        vllm=options,
    )
    batch = args.prompts * args.n
    module = VAPOModule(
        policy=ModelSpec(**policy_spec(args.shape)),
        generation=gen,
        val_generation=Generation(n=1, max_new_tokens=8, engine=args.engine, vllm=options),
        algorithm=Algorithm(mini_batch_size=batch, micro_batch_size=min(args.micro_batch, batch)),
        optim=Optim(actor_lr=1e-6, critic_lr=1e-6, warmup_steps=0),
        val_before_train=False,
    )
    data = PromptDataModule(
        train=str(PROMPTS), prompts_per_step=args.prompts, max_prompt_length=256, chat_template=False
    )
    root = tempfile.mkdtemp(prefix="bench_engines_")
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        max_steps=args.fit_steps,
        precision="bf16-mixed" if on_gpu else "32-true",
        callbacks=[MathReward(num_workers=1)],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=L.pytorch.loggers.TensorBoardLogger(root),
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=data)
    timings = logged(root, ["timing_s/step", "timing_s/gen", "timing_s/weight_sync"])
    out = {key: statistics.median(v[1:] or v) for key, v in zip(["step_s", "fit_gen_s", "fit_sync_s"], timings)}
    # The rollout alone, on the trained policy: the fit's prompts, `reps` times.
    rows = data.train_rows[: args.prompts]
    module.train()  # (sampling as in training: the engine's own stream)
    engine = module.engine(module.gen)
    engine.sync()
    with torch.no_grad(), torch.autocast(args.device, torch.bfloat16, enabled=on_gpu):
        module.sample(rows, module.gen)  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            r = module.sample(rows, module.gen)
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    tokens = int(r.response_mask.sum())
    out.update(rollout_s=statistics.median(times), tokens=tokens, tokens_per_s=tokens / statistics.median(times))
    if args.engine == "vllm":
        syncs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            engine.load_weights(module.policy)
            if on_gpu:
                torch.cuda.synchronize()
            syncs.append(time.perf_counter() - t0)
        out["sync_s"] = statistics.median(syncs)
    out["peak_memory_gb"] = used_memory_gb(args.device)
    module.teardown("fit")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=sorted(DEFAULTS), default="quickstart")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--n", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--fit-steps", type=int)
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--engines", nargs="+", default=["native", "vllm"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # a child's engine
    args = ap.parse_args()
    for key, value in zip(["prompts", "n", "new_tokens", "reps", "fit_steps", "micro_batch"], DEFAULTS[args.shape]):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.engine:
        print("RESULT " + json.dumps(child(args)))
        return
    results, argv = {}, [a for a in sys.argv[1:] if not a.startswith("--out")]
    if args.out is not None:
        argv = [a for a in argv if a != str(args.out)]
    for engine in args.engines:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_engines", *argv, "--engine", engine],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{engine} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        results[engine] = json.loads(lines[-1][len("RESULT ") :])
    report = render(args, results)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


def render(args: argparse.Namespace, results: dict[str, dict]) -> str:
    flags = " ".join(a for a in sys.argv[1:])
    lines = [
        f"# Rollout engines: native sampler vs vLLM ({args.shape}, {args.device})\n",
        f"Command: `python -m benchmarks.bench_engines {flags}`  ",
        f"{stamp()}; load average at the end {os.getloadavg()[0]:.2f}.  ",
        f"Workload: {args.prompts} prompts × {args.n} responses, each forced to {args.new_tokens} "
        f"tokens (EOS suppressed), temperature 1; rollout {args.reps} calls after a warm-up; "
        f"training {args.fit_steps} rollout steps (medians after the first), "
        f"{'bf16-mixed' if args.device == 'cuda' else 'fp32'}.\n",
        "| engine | rollout s | generated tokens/s | weight sync s | step s | of which rollout s | of which weight sync s | sync share of step | peak memory GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for engine, r in results.items():
        sync = f"{r['sync_s']:.3f}" if "sync_s" in r else "—"
        share = f"{100 * r['fit_sync_s'] / r['step_s']:.1f} %" if engine == "vllm" else "—"
        lines.append(
            f"| {engine} | {r['rollout_s']:.2f} | {r['tokens_per_s']:.0f} | {sync} | {r['step_s']:.2f} "
            f"| {r['fit_gen_s']:.2f} | {r['fit_sync_s']:.3f} | {share} | {r['peak_memory_gb']:.2f} |"
        )
    if set(results) == {"native", "vllm"}:
        ratio = results["vllm"]["tokens_per_s"] / results["native"]["tokens_per_s"]
        lines.append(f"\nvLLM / native generated tokens/s: **{ratio:.2f}×**.")
    lines.append(
        "\nPeak memory: the process's peak RSS on the CPU (vLLM reserves its KV cache, "
        "`generation.vllm.kv_cache_gib`, up front); on a GPU the device memory in use at the end."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
