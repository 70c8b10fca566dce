"""The GPU-readiness checks on one GPU, one line each (a few minutes on an H100; no vLLM, no
model hub: models from configs):

1. `token_budget`: one actor update of a Qwen2.5-0.5B-shaped policy (its 151,936-token
   vocabulary) under FSDP2 + bf16 autocast, micro-batches by a 4,096-token budget, at answers
   of 512 and 2,048 tokens: the peak memory of each against the memory plan's prediction
   (`memory_plan`), and whether the peak stays flat as answers lengthen.
2. `fit`: `vapo fit` of configs/tiny_cpu.yaml on the GPU, fsdp, bf16-mixed, micro-batches
   smaller than the mini-batch and a sharded save every step, then resumed for one more step
   from `last.ckpt` and exported from it by `vapo export`.

    python scripts/gpu_ready.py [--cpu]   # --cpu: a smoke test of the script itself
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN05 = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 151_936,
    "max_position_embeddings": 4096,
}


class Tok:
    """What `build_policy` reads of a tokenizer."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 151_936


def token_budget(cpu: bool) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vapo_lightning.config import Algorithm
    from vapo_lightning.distributed import _mixed_precision, shard
    from vapo_lightning.memory_plan import GiB, ModelShape, memory_plan
    from vapo_lightning.models import ModelSpec, build_policy
    from vapo_lightning.rollout import Rollout
    from vapo_lightning.updates import OldPolicy, RankOps, update_actor

    device = torch.device("cpu" if cpu else "cuda:0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
    policy = build_policy(ModelSpec(config=TINY if cpu else QWEN05), Tok()).to(device)
    shape = ModelShape.of(policy, device)
    shard(policy, init_device_mesh(device.type, (1,)), _mixed_precision("32-true" if cpu else "bf16-mixed"))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-7)
    budget, prompt, B, out = 4096, 256, 8, []
    for T in (64, 256) if cpu else (512, 2048):
        on = {"device": device}
        r = Rollout(
            input_ids=torch.randint(3, 151_000, (B, prompt + T), **on),
            attention_mask=torch.ones(B, prompt + T, dtype=torch.long, **on),
            response_mask=torch.ones(B, T, dtype=torch.bool, **on),
            group_ids=torch.arange(B, **on),
            truncated=torch.zeros(B, dtype=torch.bool, **on),
            scores=torch.randn(B, **on),
            correct=torch.zeros(B, dtype=torch.bool, **on),
        )
        advantages, old = torch.randn(B, T, **on), OldPolicy(torch.full((B, T), -11.0, **on), None, None)
        algo = Algorithm(mini_batch_size=B, micro_batch_size=B, max_tokens_per_micro_batch=budget, nll_coef=0.0)
        if not cpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=not cpu):
            update_actor(policy, opt, r, old, advantages, [torch.arange(B)], algo, 1.0, 1.0, RankOps())
        peak = torch.cuda.max_memory_allocated() if not cpu else float("nan")
        plan = memory_plan(
            shape,
            None,
            world=1,
            sharded=True,
            reference=False,
            prompt=prompt,
            max_new_tokens=T,
            responses=B,
            micro_batch=B,
            max_tokens=budget,
            checkpointing=False,
            engine="native",
            device_bytes=0,
            gpu_memory_utilization=0,
        )
        out.append(
            f"T={T}: peak {peak / GiB:.2f} GiB, plan {plan.actor_update / GiB:.2f} GiB, "
            f"{time.perf_counter() - start:.1f} s"
        )
    dist.destroy_process_group()
    return "token_budget: " + "; ".join(out)


def fit(cpu: bool) -> str:
    accel = "cpu" if cpu else "gpu"
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            "-c",
            "configs/tiny_cpu.yaml",
            f"--trainer.accelerator={accel}",
            "--trainer.devices=1",
            "--trainer.strategy=fsdp",
            f"--trainer.precision={'32-true' if cpu else 'bf16-mixed'}",
            f"--trainer.default_root_dir={tmp}",
            "--trainer.enable_progress_bar=false",
            "--model.algorithm.micro_batch_size=4",
            "--model.val_before_train=false",
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env["HF_HUB_OFFLINE"] = "1"  # (the fit starts its own process group)
        codes = []
        for args in (["--trainer.max_steps=3"], ["--trainer.max_steps=4", "--ckpt_path=last"]):
            done = subprocess.run(
                [sys.executable, "-m", "vapo_lightning.cli", "fit", *common, *args],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            codes.append(done.returncode)
            if done.returncode:
                return f"fit: FAILED (exit {done.returncode}): {done.stderr.strip().splitlines()[-1]}"
        export = subprocess.run(
            [
                sys.executable,
                "-m",
                "vapo_lightning.cli",
                "export",
                "--ckpt_path",
                f"{tmp}/checkpoints/last.ckpt",
                "--out",
                f"{tmp}/export",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        saves = sorted(p.name for p in Path(tmp, "checkpoints", "last.ckpt.saves").iterdir())
        ok = export.returncode == 0 and (Path(tmp) / "export" / "policy" / "config.json").exists()
        return (
            f"fit: 3 steps, then 1 resumed, exit codes {codes}; saves kept {saves}; export {'ok' if ok else 'FAILED'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    for check in (token_budget, fit):
        try:
            print(check(args.cpu), flush=True)
        except Exception as err:  # one line per check, whatever happens
            print(f"{check.__name__}: FAILED: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
