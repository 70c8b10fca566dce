"""Probe: where the time of the real model's passes goes on this CPU, against the rate its
matmuls can reach. Explains how far the rollout step's model passes are from what the CPU
can do (benchmarks/results/real_model_step.md).

1. The bf16 matmul rate (GFLOP/s) at the shapes of SmolLM2-135M's layers: 8,768 rows (the
   tokens of one rollout step's packs) × its linear layers, and 64 rows (one decoding step).
2. One no-grad V_old pass of the critic and one decoding run of the sampler (16 prompts × 4
   answers, 64 forced tokens) under torch's profiler: each op's share of the time, and the
   rate the pass's matmuls ran at (the profiler's FLOP count / their time).

Both on a fixed rollout sampled as `bench_real_model.update_phases` does (T 0.4, bf16).

    .venv/bin/python benchmarks/probes/probe_pass_profile.py > benchmarks/results/pass_profile_cpu.md
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_real_model as bench  # noqa: E402

from benchmarks.stamp import stamp  # noqa: E402
from vapo_lightning.engines.sampler import sample_responses, weights_cast_once  # noqa: E402
from vapo_lightning.models import ModelSpec, build_critic, build_policy, load_tokenizer  # noqa: E402
from vapo_lightning.packing import Layout  # noqa: E402
from vapo_lightning.rollout import assemble  # noqa: E402
from vapo_lightning.updates import Forwards, compute_values  # noqa: E402

HIDDEN, MLP, KV, VOCAB = 576, 1536, 192, 49152  # SmolLM2-135M's linear layers


def seconds(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def matmul_rates() -> list[tuple[int, int, int, float]]:
    """(rows, in, out, GFLOP/s) of bf16 `linear` at the model's shapes."""
    out = []
    for rows in (8768, 64):
        for k, n in ((HIDDEN, MLP), (MLP, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, VOCAB)):
            m = rows if n != VOCAB or rows == 64 else 7168  # the LM head sees response tokens only
            x, w = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
            s = seconds(lambda: torch.nn.functional.linear(x, w), 3 if m > 64 else 50)  # noqa: B023
            out.append((m, k, n, 2 * m * k * n / s / 1e9))
    return out


MATMULS = ("aten::mm", "aten::bmm")


def op_table(run, top: int = 8) -> tuple[list[tuple[str, float, int]], float, float]:
    """`run` under the profiler: the `top` ops by self time (name, share of all ops' time,
    calls), the matmuls' rate (GFLOP/s) and all ops' time (s). The FLOPs come from a second
    run under torch's FLOP counter (the profiler's own count records shapes, which slows every
    op down)."""
    with profile(activities=[ProfilerActivity.CPU]) as timed:
        run()
    with FlopCounterMode(display=False) as counter:
        run()
    counts = counter.get_flop_counts()["Global"]
    flops = sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.bmm"))
    events = timed.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rate = flops / max(sum(e.self_cpu_time_total for e in events if e.key in MATMULS), 1) / 1e3
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key, e.self_cpu_time_total / total, e.count) for e in rows], rate, total / 1e6


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print("# Where the real model's passes spend their time on this CPU\n")
    print("Command: `.venv/bin/python benchmarks/probes/probe_pass_profile.py`  ")
    print(f"{stamp()}  ")
    print(f"{bench.cpu_facts()}\n")
    print("## bf16 matmul rate at the model's shapes\n")
    print("| rows | in | out | GFLOP/s |\n|---|---|---|---|")
    for m, k, n, rate in matmul_rates():
        print(f"| {m} | {k} | {n} | {rate:.0f} |", flush=True)

    tok = load_tokenizer(str(bench.MODEL))
    policy = build_policy(ModelSpec(name_or_path=str(bench.MODEL)), tok).eval()
    critic = build_critic(None, policy, tok)
    prompts = bench.config_prompts(tok, 16)
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(4, 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(4, 0)

    def sample(new: int, forced: bool):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), weights_cast_once():
            return sample_responses(
                policy,
                ids,
                mask,
                max_new_tokens=new,
                min_new_tokens=new if forced else 0,
                stop_token_ids=[tok.eos_token_id],
                pad_token_id=tok.pad_token_id,
                temperature=0.4,
            )

    torch.manual_seed(0)
    r = assemble(ids, mask, sample(192, forced=False), [tok.eos_token_id], tok.pad_token_id, 4)
    layout = Layout(4)
    print(
        f"\nRollout: 64 answers of {r.response_lengths.float().mean():.0f} tokens on average, "
        f"{int(r.attention_mask[::4].sum() + r.response_mask.sum())} tokens in its 16 packs.\n"
    )

    def values():
        with torch.autocast("cpu", torch.bfloat16):
            compute_values(critic, r, Forwards(16, layout=layout))

    passes = {"V_old pass (critic, no grad)": values, "sampling, 64 rows × 64 forced tokens": lambda: sample(64, True)}
    for name, run in passes.items():
        run()  # warm-up
        ops, rate, total = op_table(run)
        print(f"## {name}: {total:.1f} s of op time, its matmuls at {rate:.0f} GFLOP/s\n")
        print("| op | share of the time | calls |\n|---|---|---|")
        for key, share, calls in ops:
            print(f"| {key} | {100 * share:.1f} % | {calls} |", flush=True)
        print()


if __name__ == "__main__":
    main()
