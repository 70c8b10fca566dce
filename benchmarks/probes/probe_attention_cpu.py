"""Probe: one actor update (forward, backward, AdamW step) at the TRL benchmark's shapes under
CPU bf16 autocast, with transformers' SDPA against `vapo_lightning.attention` (fp32 attention
under CPU autocast), and in fp32 for reference. Median of `--reps` after 2 warm-up updates.

    .venv/bin/python benchmarks/probes/probe_attention_cpu.py [--threads 1 2]

Shapes: the `quickstart` policy of bench_trl.py (Llama 4 × 256, vocab 283), 64 rows = the
first 16 training prompts × 4, left-padded to 55 tokens, + 128 response tokens.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_trl
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trl import PROMPTS_FILE, SHAPES, TOKENIZER

from benchmarks.stamp import stamp
from vapo_lightning import core
from vapo_lightning.attention import SDPA
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer

T = 128


def batch(tok) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines()][:16]
    lens = [len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    P = max(lens)
    ids = torch.randint(5, len(tok), (64, P + T))
    mask = torch.ones_like(ids)
    for i in range(64):
        mask[i, : P - lens[i // 4]] = 0
    return ids, mask


def update(model, opt, ids, mask, autocast: bool) -> float:
    start = time.perf_counter()
    L = ids.shape[1]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            logits_to_keep=torch.arange(L - T - 1, L - 1),
            use_cache=False,
        ).logits
        loss = -core.logprobs_from_logits(logits, ids[:, -T:]).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(str(TOKENIZER))
    ids, mask = batch(tok)
    model = build_policy(ModelSpec(config=SHAPES["quickstart"]), tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cases = {
        "bf16 autocast, transformers' sdpa": ("sdpa", True),
        "bf16 autocast, vapo_sdpa (fp32 attention)": (SDPA, True),
        "fp32": (SDPA, False),
    }
    print("# One actor update under CPU bf16 autocast: transformers' SDPA vs vapo_sdpa\n")
    print(
        "Command: `.venv/bin/python benchmarks/probes/probe_attention_cpu.py > benchmarks/results/attention_cpu.md`  "
    )
    print(f"{stamp()}  ")
    print(
        f"Load average at the start {os.getloadavg()[0]:.2f}; "
        f"{args.reps} updates per case after 2 warm-ups; shapes in the probe's docstring.\n"
    )
    print("| threads | precision, attention | actor update s, min / **median** / max |")
    print("|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (attn, autocast) in cases.items():  # one case at a time, warmed up:
            model.set_attn_implementation(attn)  # alternating them churned the allocator
            ts = [update(model, opt, ids, mask, autocast) for _ in range(args.reps + 2)][2:]
            print(f"| {threads} | {name} | {min(ts):.2f} / **{statistics.median(ts):.2f}** / {max(ts):.2f} |")


if __name__ == "__main__":
    main()
