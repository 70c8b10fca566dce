"""GPU probe: decode time per step of `sample_responses` on the quickstart SFT model,
16 prompts x 8 samples, up to 160 new tokens, fp32 vs bf16 autocast, stopping at EOS
("max") or forced to the full length ("fixed"), then a profile of 40 bf16 steps.

What it answers: whether attention-kernel planning slows decoding (under bf16, SDPA's cuDNN
kernel re-planned at nearly every step once rows had left the batch, which is why the sampler
disables it: benchmarks/results/gpu.md). Run on a CUDA machine from
the repo root: `python3 benchmarks/probes/probe_decode_gpu.py` (benchmarks/gpu_check.sh runs it).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stamp import stamp
from vapo_lightning.engines.sampler import sample_responses
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer

MODEL = "vapo_lightning/assets/quickstart_sft"


def amp() -> torch.autocast:
    return torch.autocast("cuda", dtype=torch.bfloat16)


def main() -> None:
    print(stamp(), flush=True)
    tok = load_tokenizer(MODEL)
    policy = build_policy(ModelSpec(name_or_path=MODEL), tok).cuda().eval()
    lines = Path("vapo_lightning/assets/arithmetic/train.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines[:16] for _ in range(8)]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left").to("cuda")
    kw = {"stop_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "temperature": 1.0}

    def run(label: str, ctx, **extra) -> None:
        for _ in range(3):  # the third repeat is reported
            torch.cuda.synchronize()
            start = time.perf_counter()
            with ctx():
                out = sample_responses(policy, enc.input_ids, enc.attention_mask, **kw, **extra)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        steps = out.shape[1]
        print(f"{label}: {seconds:.3f} s, {steps} steps, {1000 * seconds / steps:.2f} ms/step", flush=True)

    T = 160
    run(f"fp32 max{T}", contextlib.nullcontext, max_new_tokens=T)
    run(f"fp32 fixed{T}", contextlib.nullcontext, max_new_tokens=T, min_new_tokens=T)
    run(f"autocast-bf16 max{T}", amp, max_new_tokens=T)
    run(f"autocast-bf16 fixed{T}", amp, max_new_tokens=T, min_new_tokens=T)
    run(f"fp32 max{T} no-compaction", contextlib.nullcontext, max_new_tokens=T, compact_fraction=2.0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with amp():
            sample_responses(policy, enc.input_ids, enc.attention_mask, **kw, max_new_tokens=40)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
