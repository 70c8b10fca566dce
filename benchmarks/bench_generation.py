"""Benchmark of the rollout sampler (`vapo_lightning.engines.sampler.sample_responses`) against
`transformers`' `generate` on the same model, prompts and sampling settings.

Two workloads on the quickstart's SFT policy (2.0 M parameters): 16 training prompts × 8
samples, (a) free: each response stops at its EOS (lengths as in a quickstart rollout);
(b) forced: every response exactly 128 tokens (EOS suppressed), the same token count for
both, so only the per-token cost differs. Runs alternate between the two samplers.

    .venv/bin/python -m benchmarks.bench_generation > benchmarks/results/generation.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from vapo_lightning.attention import SDPA
from vapo_lightning.engines.sampler import sample_responses
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stamp import stamp

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "vapo_lightning/assets/quickstart_sft"
PROMPTS = ROOT / "vapo_lightning/assets/arithmetic/train.jsonl"


def hf_generate(model, ids, mask, tok, max_new, min_new):
    model.set_attn_implementation("sdpa")  # transformers' own SDPA (bf16 under autocast)
    try:
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            min_new_tokens=min_new or None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[:, ids.shape[1] :]
    finally:
        model.set_attn_implementation(SDPA)


def lean(model, ids, mask, tok, max_new, min_new):
    return sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )


def tokens(out, tok) -> int:
    """Generated tokens up to and including each row's first EOS."""
    is_eos = out == tok.eos_token_id
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, out.shape[1])
    return int(first.sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: both samplers under bf16 autocast (fp32 weights), as in bf16-mixed training",
    )
    args = ap.parse_args()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    tok = load_tokenizer(str(MODEL))
    model = build_policy(ModelSpec(name_or_path=str(MODEL)), tok).eval()
    rows = [json.loads(line) for line in PROMPTS.open()][:16]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    P = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts]).repeat_interleave(8, 0)
    mask = (ids != tok.pad_token_id).long()
    samplers = {"transformers generate": hf_generate, "vapo sample_responses": lean}
    workloads = {"free (stop at EOS, max 160)": (160, 0), "forced 128 tokens": (128, 128)}
    print("# Rollout sampler vs transformers generate\n")
    flags = "" if args.threads == [1, 2] else " --threads " + " ".join(map(str, args.threads))
    flags += "" if args.precision == "fp32" else f" --precision {args.precision}"
    print(f"Command: `.venv/bin/python -m benchmarks.bench_generation{flags}`  ")
    print(f"{stamp()}  ")
    print(f"Load average at start {os.getloadavg()[0]:.2f}  ")
    print(
        f"Model: quickstart SFT policy; 16 prompts × 8 samples = {len(ids)} responses, "
        f"temperature 1, no top-k/top-p; {args.reps} runs per cell after one warm-up, alternating; "
        + ("fp32.\n" if args.precision == "fp32" else "bf16 autocast around both samplers (fp32 weights).\n")
    )
    print(
        "| threads | workload | sampler | s per call, min / **median** / max | generated tokens/s (median) | speed-up |"
    )
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for wname, (max_new, min_new) in workloads.items():
            times = {k: [] for k in samplers}
            counts = {k: [] for k in samplers}
            for fn in samplers.values():  # warm-up
                with autocast:
                    fn(model, ids, mask, tok, max_new, min_new)
            for rep in range(args.reps):
                for k, fn in samplers.items():
                    torch.manual_seed(rep)
                    t0 = time.perf_counter()
                    with autocast:
                        out = fn(model, ids, mask, tok, max_new, min_new)
                    times[k].append(time.perf_counter() - t0)
                    counts[k].append(tokens(out, tok))
            base = statistics.median(times["transformers generate"])
            for k in samplers:
                med = statistics.median(times[k])
                tps = statistics.median(c / t for c, t in zip(counts[k], times[k]))
                print(
                    f"| {threads} | {wname} | {k} | {min(times[k]):.2f} / **{med:.2f}** / {max(times[k]):.2f} "
                    f"| {tps:.0f} | {base / med:.2f}x |"
                )
    print(
        "\nSpeed-up: transformers' median time over this sampler's. Free sampling draws differ "
        "run to run (the same distribution, tests/engines/test_generation.py); tokens/s counts each "
        "response up to its EOS."
    )


if __name__ == "__main__":
    main()
