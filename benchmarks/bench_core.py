"""Benchmark of the math core: `core.gae` against a naive per-element loop and against the
loop-over-T-vectorised-over-B form peers (verl) use; the losses on (64, 2048, 32000) logits.

    .venv/bin/python benchmarks/bench_core.py > benchmarks/results/core.md
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from vapo_lightning import core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stamp import stamp


def naive_gae(rewards, values, mask, gamma, lam):
    """(a) one element at a time, tensor indexing in the inner loop."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    for b in range(B):
        last, next_v = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                delta = rewards[b, t] + gamma * next_v - values[b, t]
                last = delta + gamma * lam * last
                adv[b, t] = last
                next_v = values[b, t]
    return adv, adv + values


def verl_gae(rewards, values, mask, gamma, lam):
    """(b) verl's `compute_gae_advantage_return`: a Python loop over T, vectorised over B."""
    nextvalues, lastgaelam, out = 0, 0, []
    mask = mask.to(values.dtype)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    values = torch.randn(B, T, generator=g)
    rewards = core.sparse_rewards(torch.randn(B, generator=g), mask)
    return rewards, values, mask


def timeit(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def bench_gae():
    print("## GAE (gamma = 1, lambda = 0.95, float32)\n")
    print("| B | T | method | min s | median s | core.gae speed-up (median) |")
    print("|---|---|---|---|---|---|")
    for B, T, naive_reps in [(256, 1024, 1), (512, 8192, 0)]:
        r, v, m = batch(B, T)
        ours = timeit(lambda r=r, v=v, m=m: core.gae(r, v, m, 1.0, 0.95), 7)
        rows = [("core.gae (blocked scan)", ours)]
        rows.append(
            (
                "(b) loop over T, vectorised over B",
                timeit(lambda r=r, v=v, m=m: verl_gae(r, v, m, 1.0, 0.95), 5),
            )
        )
        if naive_reps:
            rows.append(
                (
                    "(a) naive per-element loop",
                    timeit(lambda r=r, v=v, m=m: naive_gae(r, v, m, 1.0, 0.95), naive_reps),
                )
            )
        for name, (tmin, tmed) in rows:
            print(f"| {B} | {T} | {name} | {tmin:.4f} | {tmed:.4f} | {tmed / ours[1]:.1f}x |")
    print()


def bench_losses():
    # (64, 2048, 32000) fp32 logits are 15.6 GiB: the chunked functions fit beside them on a
    # 24 GiB machine, a full log_softmax copy does not (that reference is timed at B = 16).
    B, T, V = 64, 2048, 32000
    print(f"## Losses on ({B}, {T}, {V}) float32 logits ({B * T * V * 4 / 2**30:.1f} GiB)\n")
    print("A full log_softmax copy would need as much again; the per-token functions work")
    print("in row chunks instead (peak extra memory one (4096, V) block).\n")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    adv, old = torch.randn(B, T, generator=g), -torch.rand(B, T, generator=g) * 5
    correct = torch.rand(B, generator=g) > 0.5
    print("| function | min s | median s |")
    print("|---|---|---|")
    cases = {
        "logprobs_from_logits": lambda: core.logprobs_from_logits(logits, labels),
        "entropy_from_logits": lambda: core.entropy_from_logits(logits),
    }
    lp = core.logprobs_from_logits(logits, labels)
    cases["policy_loss (token-level)"] = lambda: core.policy_loss(lp, old, adv, mask, mask.sum())
    cases["value_loss (clipped)"] = lambda: core.value_loss(adv, old, lp, mask, mask.sum())
    cases["nll_loss"] = lambda: core.nll_loss(lp, mask, correct, mask.sum())
    small, small_labels = logits[:16], labels[:16]
    cases["log_softmax + gather, B = 16 (reference)"] = lambda: torch.log_softmax(small, -1).gather(
        -1, small_labels[..., None]
    )
    cases["logprobs_from_logits, B = 16"] = lambda: core.logprobs_from_logits(small, small_labels)
    for name, fn in cases.items():
        tmin, tmed = timeit(fn, 3)
        print(f"| {name} | {tmin:.4f} | {tmed:.4f} |", flush=True)
    print()


if __name__ == "__main__":
    torch.set_num_threads(2)
    print("# Math core benchmark\n")
    print("Command: `.venv/bin/python benchmarks/bench_core.py`  ")
    print(f"{stamp()}; {torch.get_num_threads()} threads\n")
    bench_gae()
    bench_losses()
