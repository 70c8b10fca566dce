"""Runs the README's first command (`vapo fit -c configs/quickstart.yaml`) and reports what it
did: wall time, val/accuracy before training and at each validation, reward and entropy.

    .venv/bin/python benchmarks/bench_quickstart.py [CONFIG] > quickstart.md

CONFIG defaults to `configs/quickstart.yaml`. The report (Markdown) goes to standard output;
redirect it to the file you want. The run's logs go to a fresh temporary directory.
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]


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
    root = tempfile.mkdtemp(prefix="quickstart-")
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    start = time.time()
    cmd = [str(ROOT / ".venv/bin/vapo"), "fit", "-c", config, f"--trainer.default_root_dir={root}",
           "--trainer.enable_progress_bar=false"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True
    )
    minutes = (time.time() - start) / 60
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    m = scalars(root)
    val = m["val/accuracy"]
    print(f"# Quickstart: `vapo fit -c {config}`\n")
    print(f"Command: `.venv/bin/python benchmarks/bench_quickstart.py {config}`  ")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; load average before: {load_before}  "
    )
    print(
        f"Wall time of the whole command (start-up, validation, training, export): **{minutes:.1f} min**\n"
    )
    print("| rollout step | val/accuracy |\n|---|---|")
    for step, value in val:
        print(f"| {step} | {100 * value:.1f}% |")
    print(f"\n**val/accuracy: {100 * val[0][1]:.1f}% before training -> {100 * val[-1][1]:.1f}% at the end "
          f"({100 * (val[-1][1] - val[0][1]):+.1f} points)**\n")  # fmt: skip
    print(
        "| rollout step | reward | rollout/accuracy | entropy | response_length/mean | warmup/active |"
    )
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


if __name__ == "__main__":
    main()
