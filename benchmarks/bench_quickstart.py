"""Runs the README's first command (`vapo fit -c configs/quickstart.yaml`) and reports what it
did: wall time, val/accuracy before training and at each validation, reward and entropy.

    .venv/bin/python benchmarks/bench_quickstart.py [CONFIG [OVERRIDE ...]] > quickstart.md

CONFIG defaults to `configs/quickstart.yaml`; OVERRIDEs go to `vapo fit` after it (e.g.
`--trainer.precision=bf16-mixed`). The report (Markdown) goes to standard output; redirect it
to the file you want. The run's logs go to a fresh temporary directory.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_real_model import cpu_facts  # noqa: E402
from benchmarks.stamp import stamp  # noqa: E402


def scalars(root: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(f"{root}/lightning_logs/version_*/events.out.tfevents.*")):
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def main() -> None:
    config = sys.argv[1] if len(sys.argv) > 1 else "configs/quickstart.yaml"
    overrides = sys.argv[2:]
    root = tempfile.mkdtemp(prefix="quickstart-")
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    start = time.time()
    cmd = [
        str(ROOT / ".venv/bin/vapo"),
        "fit",
        "-c",
        config,
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    minutes = (time.time() - start) / 60
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    m = scalars(root)
    val = m["val/accuracy"]
    print(f"# Quickstart: `vapo fit -c {' '.join([config, *overrides])}`\n")
    print(f"Command: `.venv/bin/python benchmarks/bench_quickstart.py {' '.join([config, *overrides])}`  ")
    print(f"{stamp()}  ")
    print(f"{cpu_facts()}; load average before: {load_before}  ")
    print(f"Wall time of the whole command (start-up, validation, training, export): **{minutes:.1f} min**\n")
    phases = sorted(tag for tag in m if tag.startswith("timing_s/"))
    print("| phase | median s per rollout step | total s |\n|---|---|---|")
    for tag in phases:
        values = [v for _, v in m[tag]]
        print(f"| {tag} | {statistics.median(values):.2f} | {sum(values):.0f} |")
    print()
    print("| rollout step | val/accuracy |\n|---|---|")
    for step, value in val:
        print(f"| {step} | {100 * value:.1f}% |")
    print(
        f"\n**val/accuracy: {100 * val[0][1]:.1f}% before training -> {100 * val[-1][1]:.1f}% at the end "
        f"({100 * (val[-1][1] - val[0][1]):+.1f} points)**\n"
    )
    print("| rollout step | reward | rollout/accuracy | entropy | response_length/mean | warmup/active |")
    print("|---|---|---|---|---|---|")
    rows = {
        k: dict(m[k])
        for k in [
            "reward",
            "rollout/accuracy",
            "rollout/entropy",
            "response_length/mean",
            "warmup/active",
        ]
    }
    for step in sorted(rows["reward"]):
        r = [rows[k].get(step, float("nan")) for k in rows]
        print(f"| {step + 1} | {r[0]:.3f} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.1f} | {r[4]:.0f} |")
    samples = Path(root) / "val_samples.jsonl"
    if "tools/calls/mean" in m and samples.exists():
        tool_report(m, samples)


def tool_report(m: dict[str, list[tuple[int, float]]], samples: Path) -> None:
    """Runs with tools: tool use by rollout step, and accuracy and tool use per difficulty at
    the first and the last validation (`ValidationSamples`' file)."""
    print(
        "\n| rollout step | tools/share_of_responses | tools/calls/mean | tools/errors | timing_s/gen | timing_s/tools |"
    )
    print("|---|---|---|---|---|---|")
    keys = [
        "tools/share_of_responses",
        "tools/calls/mean",
        "tools/errors",
        "timing_s/gen",
        "timing_s/tools",
    ]
    series = {k: dict(m[k]) for k in keys}
    for step in sorted(series[keys[0]]):
        r = [series[k].get(step, float("nan")) for k in keys]
        print(f"| {step + 1} | {r[0]:.3f} | {r[1]:.2f} | {r[2]:.0f} | {r[3]:.2f} | {r[4]:.2f} |")
    rows = [json.loads(line) for line in samples.open()]
    first, last = min(r["step"] for r in rows), max(r["step"] for r in rows)
    print(f"\nPer difficulty, validation at rollout steps {first} and {last} (mean@k at temperature 1):\n")
    print(
        "| difficulty | accuracy | responses that call the tool | accuracy of those that call | of those that answer bare |"
    )
    print("|---|---|---|---|---|")

    def pct(xs: list[bool]) -> str:
        return f"{100 * sum(xs) / len(xs):.1f}%" if xs else "-"

    for level in sorted({r.get("difficulty") for r in rows}, key=str):
        cells = []
        for step in (first, last):
            sel = [r for r in rows if r["step"] == step and r.get("difficulty") == level]
            called = [r for r in sel if r.get("tool_calls", 0) > 0]
            bare = [r for r in sel if not r.get("tool_calls", 0)]
            cells.append(
                (
                    pct([r["correct"] for r in sel]),
                    pct([r.get("tool_calls", 0) > 0 for r in sel]),
                    pct([r["correct"] for r in called]),
                    pct([r["correct"] for r in bare]),
                )
            )
        print(f"| {level} | " + " | ".join(f"{a} → {b}" for a, b in zip(*cells)) + " |")


if __name__ == "__main__":
    main()
