"""Probe: one actor update (forward, backward, AdamW step) at the TRL benchmark's shapes, eager
against `model.compile()` (what `VAPOModule(torch_compile=True)` does to each model), in fp32
and under CPU bf16 autocast. Median of `--reps` after warm-ups; the first compiled update,
compile included, is reported on its own.

    .venv/bin/python benchmarks/probes/probe_compile_cpu.py > benchmarks/results/compile_cpu.md

Shapes: `probe_attention_cpu.py`'s (the `quickstart` policy, 64 rows of 55 prompt + 128
response tokens), 1 torch thread. A fresh model per case, and a fresh, empty inductor
cache for the run (so "first compiled update" is a cold compile of the policy, plus its update).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_trl
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trl import SHAPES, TOKENIZER
from probe_attention_cpu import batch, update

from benchmarks.stamp import stamp
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    cache = tempfile.mkdtemp(prefix="probe_compile_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at compile time: cold compiles
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    torch.set_num_threads(1)
    tok = load_tokenizer(str(TOKENIZER))
    torch.manual_seed(0)
    ids, mask = batch(tok)
    print("# One actor update, eager vs `model.compile()` (CPU, 1 thread)\n")
    print("Command: `.venv/bin/python benchmarks/probes/probe_compile_cpu.py > benchmarks/results/compile_cpu.md`  ")
    print(f"{stamp()}  ")
    print(
        f"Load average at the start {os.getloadavg()[0]:.2f}; "
        f"{args.reps} updates per case after warm-ups; shapes in the probe's docstring.\n"
    )
    print(
        "| precision | eager s, min / **median** / max | compiled s, min / **median** / max "
        "| first compiled update (compile included) s | speed-up |"
    )
    print("|---|---|---|---|---|")
    for autocast in (False, True):
        times = {}
        for compiled in (False, True):
            torch.manual_seed(0)
            model = build_policy(ModelSpec(config=SHAPES["quickstart"]), tok)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            if compiled:
                model.compile()
            first = update(model, opt, ids, mask, autocast)
            ts = [update(model, opt, ids, mask, autocast) for _ in range(args.reps + 1)][1:]
            times[compiled] = (first, ts)
        (_, eager), (first, comp) = times[False], times[True]
        cell = lambda ts: f"{min(ts):.2f} / **{statistics.median(ts):.2f}** / {max(ts):.2f}"  # noqa: E731
        speed = statistics.median(eager) / statistics.median(comp)
        name = "bf16 autocast" if autocast else "fp32"
        print(f"| {name} | {cell(eager)} | {cell(comp)} | {first:.1f} | {speed:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
