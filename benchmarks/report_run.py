"""A finished `vapo fit` run as a results page: its validations, its rollout curves in windows
of steps, and a figure (accuracy, answer forms, response length, the critic's explained
variance), read from the run's TensorBoard file.

    vapo fit -c configs/smollm2.yaml
    .venv/bin/python benchmarks/report_run.py runs/smollm2 --title "VAPO on SmolLM2-135M-Instruct" \
        --command "vapo fit -c configs/smollm2.yaml" --out benchmarks/results/smollm2.md
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_real_model import cpu_facts
from benchmarks.stamp import stamp

CURVES = [  # (tag, label, scale)
    ("rollout/accuracy", "rollout accuracy %", 100),
    ("rollout/answer_share", "answers read %", 100),
    ("response_length/mean", "response tokens", 1),
    ("critic/vf_explained_var", "critic explained variance", 1),
]
VALIDATION = [("val/accuracy", 100), ("val/answer_share", 100), ("val/boxed_share", 100)]


def read_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged: dict[str, list[tuple[int, float]]] = {}
    for event in sorted(glob.glob(f"{run}/**/events.out.tfevents.*", recursive=True)):
        acc = EventAccumulator(event, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            logged.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(dict(points).items()) for tag, points in logged.items()}  # a resumed step once


def by_rollout_step(logged: dict, tag: str) -> list[tuple[int, float]]:
    """A training metric against its rollout step (1, 2, ...), as `rollout_step` numbers them."""
    step_of = dict(logged.get("rollout_step", []))
    return [(int(step_of[s]), v) for s, v in logged.get(tag, []) if s in step_of]


def after_steps(logged: dict, step: int) -> int:
    """How many rollout steps a validation logged at global `step` came after: the one before
    training is logged at step 0, a later one at its last rollout step's global step."""
    return int(dict(logged.get("rollout_step", [])).get(step, 0)) if step else 0


def windows(points: list[tuple[int, float]], size: int) -> list[tuple[str, float]]:
    out = []
    for start in range(0, len(points), size):
        chunk = points[start : start + size]
        out.append((f"{chunk[0][0]}-{chunk[-1][0]}", statistics.fmean(v for _, v in chunk)))
    return out


def plot(logged: dict, out_png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 4))
    for ax, (tag, label, scale) in zip(axes, CURVES):
        points = by_rollout_step(logged, tag)
        if points:
            ax.plot([s for s, _ in points], [scale * v for _, v in points], ".-", alpha=0.8)
        if tag == "rollout/accuracy" and logged.get("val/accuracy"):
            val = logged["val/accuracy"]
            ax.plot([after_steps(logged, s) for s, _ in val], [100 * v for _, v in val], "s-", label="val/accuracy")
            ax.legend()
        ax.set_xlabel("rollout step")
        ax.set_title(label)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--title", required=True)
    ap.add_argument("--command", required=True, help="the command that made the run")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=5)
    args = ap.parse_args()
    logged = read_scalars(args.run)
    lines = [
        f"# {args.title}\n",
        f"Run: `{args.command}`  ",
        f"Report: `.venv/bin/python benchmarks/report_run.py {args.run} ...`  ",
        f"{stamp()}  ",
        f"{cpu_facts()}\n",
        "## Validations\n",
        "| after rollout steps | " + " | ".join(tag for tag, _ in VALIDATION) + " |",
        "|---|" + "---|" * len(VALIDATION),
    ]
    for i, (step, _) in enumerate(logged.get("val/accuracy", [])):
        cells = [f"{scale * logged[tag][i][1]:.1f} %" if tag in logged else "-" for tag, scale in VALIDATION]
        lines.append(f"| {after_steps(logged, step)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Training, mean over windows of {args.window} rollout steps\n",
        "| steps | " + " | ".join(label for _, label, _ in CURVES) + " | seconds per step |",
        "|---|" + "---|" * (len(CURVES) + 1),
    ]
    columns = [windows(by_rollout_step(logged, tag), args.window) for tag, _, _ in CURVES]
    seconds = windows(by_rollout_step(logged, "timing_s/step"), args.window)
    for i, (span, step_seconds) in enumerate(seconds):
        cells = [f"{scale * col[i][1]:.2f}" if i < len(col) else "-" for (_, _, scale), col in zip(CURVES, columns)]
        lines.append(f"| {span} | " + " | ".join(cells) + f" | {step_seconds:.0f} |")
    png = args.out.with_suffix(".png")
    plot(logged, png, args.title)
    lines += ["", f"![curves]({png.name})", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
