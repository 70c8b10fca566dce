"""Probe: one decoding attention call on the CPU, bf16 against fp32, and the matmul rates behind
`attention.decodes_in_autocast_dtype` (decode in bf16 only on CPUs with AMX).

At the TRL benchmark's decoding shapes: 64 rows, 4 heads, head dim 64, one query token, 60 /
120 / 183 cached positions read through views of a 200-position buffer (as `GrowingLayer`
returns them), the left 20 positions of half the rows masked. Each cell is the mean of 300
calls after 5 warm-up calls; max |error| against an fp64 reference.

    .venv/bin/python benchmarks/probes/probe_decode_attention_cpu.py [--threads 1] > benchmarks/results/decode_attention_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stamp import stamp
from vapo_lightning.attention import cpu_has_amx

B, H, D, CAPACITY = 64, 4, 64, 200


def mean_ms(fn, calls: int = 300) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(ap.parse_args().threads)
    torch.manual_seed(0)
    print("# Decoding attention on the CPU: bf16 against fp32\n")
    print(
        "Command: `.venv/bin/python benchmarks/probes/probe_decode_attention_cpu.py > "
        "benchmarks/results/decode_attention_cpu.md`  "
    )
    print(f"{stamp()}  ")
    print(f"{torch.get_num_threads()} thread(s), AMX tiles: {'yes' if cpu_has_amx() else 'no'}  ")
    print(f"Matmul 1024², GFLOP/s: fp32 {matmul_gflops(torch.float32):.0f}, bf16 {matmul_gflops(torch.bfloat16):.0f}\n")
    print("| cached positions | SDPA bf16 ms | SDPA fp32 ms | bf16 / fp32 | max err bf16 | max err fp32 |")
    print("|---|---|---|---|---|---|")
    keys, values = torch.randn(B, H, CAPACITY, D), torch.randn(B, H, CAPACITY, D)
    query = torch.randn(B, H, 1, D)
    for L in (60, 120, 183):
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
        mask[: B // 2, :, :, :20] = False
        ref = F.scaled_dot_product_attention(
            query.double(), keys[:, :, :L].double(), values[:, :, :L].double(), attn_mask=mask
        )
        row = []
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = query.to(dtype), keys.to(dtype)[:, :, :L], values.to(dtype)[:, :, :L]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            err = (out.double() - ref).abs().max().item()
            ms = mean_ms(lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
            row.append((ms, err))
        (bf, e_bf), (fp, e_fp) = row
        print(f"| {L} | {bf:.3f} | {fp:.3f} | {bf / fp:.2f} | {e_bf:.1e} | {e_fp:.1e} |")


if __name__ == "__main__":
    main()
