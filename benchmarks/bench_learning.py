"""Learning study: the paper's Table 1 in miniature on the quickstart task.

Runs `vapo fit -c configs/quickstart.yaml [-c <layer>]` for VAPO, vanilla PPO, GRPO, DAPO and
VAPO without each of its seven techniques, for several seeds, reads `val/accuracy` from each
run's TensorBoard events, and writes a table in the shape of Table 1 (final and best
accuracy, mean ± std over seeds, next to the paper's AIME 2024 score) and the curves.

Runs already finished under `--root` are read, not rerun, so the study can be resumed or
extended seed by seed. `--jobs 2` runs two fits at a time with one thread each.

    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 --out benchmarks/results/learning.md
    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 --jobs 2 --root runs/learning50 \
        --out benchmarks/results/learning.md -- --trainer.max_steps=50      # what was run
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
BASE = "configs/quickstart.yaml"
# (name, layer over the quickstart config or None, the paper's Table 1 AIME24 score)
RUNS = [
    ("VAPO", None, 60),
    ("vanilla PPO", "configs/baselines/ppo.yaml", 5),
    ("GRPO", "configs/baselines/grpo.yaml", None),
    ("DAPO", "configs/baselines/dapo.yaml", 50),
    ("w/o value-pretraining", "configs/ablations/vapo_wo_value_pretraining.yaml", 11),
    ("w/o decoupled GAE", "configs/ablations/vapo_wo_decoupled_gae.yaml", 33),
    ("w/o length-adaptive GAE", "configs/ablations/vapo_wo_length_adaptive_gae.yaml", 45),
    ("w/o clip-higher", "configs/ablations/vapo_wo_clip_higher.yaml", 46),
    ("w/o token-level loss", "configs/ablations/vapo_wo_token_level_loss.yaml", 53),
    ("w/o positive-example LM loss", "configs/ablations/vapo_wo_positive_example_nll.yaml", 54),
    ("w/o group-sampling", "configs/ablations/vapo_wo_group_sampling.yaml", 55),
    # not in Table 1: VAPO's critic and advantages with GRPO's policy loss (seq-level, clip
    # 0.2, no NLL), to tell the loss from the advantage estimator where PPO/GRPO beat VAPO
    ("VAPO with GRPO's loss", "configs/ablations/vapo_with_grpo_loss.yaml", None),
    ("VAPO with GRPO's loss, token-level", "configs/ablations/vapo_with_grpo_loss_token_level.yaml", None),
    ("VAPO with GRPO's loss, Clip-Higher", "configs/ablations/vapo_with_grpo_loss_clip_higher.yaml", None),
]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def scalar_curve(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    points: dict[int, float] = {}
    for path in sorted(glob.glob(f"{run_dir}/lightning_logs/version_*/events.out.tfevents.*")):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            points.update((e.step, e.value) for e in acc.Scalars(tag))
    return sorted(points.items())


def mean_curve(runs: list[list[tuple[int, float]]], window: int = 1) -> tuple[list, list]:
    """Mean over seeds at each step all runs have, then a trailing moving average."""
    by_step = [dict(r) for r in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    means = [statistics.mean(d[s] for d in by_step) for s in steps]
    smooth = [statistics.mean(means[max(0, i - window + 1) : i + 1]) for i in range(len(means))]
    return steps, smooth


def fit(layer: str | None, seed: int, run_dir: Path, extra: list[str]) -> float:
    done = run_dir / "DONE"
    if done.exists():
        return float(done.read_text())
    cmd = [str(ROOT / ".venv/bin/vapo"), "fit", "-c", BASE, *(["-c", layer] if layer else []),
           f"--seed_everything={seed}", f"--trainer.default_root_dir={run_dir}",
           "--trainer.enable_progress_bar=false", "--model.hf_export_dir=null", *extra]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (run_dir / "log.txt").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {run_dir / 'log.txt'}")
    minutes = (time.time() - start) / 60
    done.write_text(f"{minutes:.2f}")
    return minutes


def mean_std(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{100 * xs[0]:.1f}"
    return f"{100 * statistics.mean(xs):.1f} ± {100 * statistics.stdev(xs):.1f}"


PANELS = [  # (tag, y label, scale, moving-average window)
    ("val/accuracy", "val/accuracy (%), mean over seeds", 100, 1),
    ("rollout/accuracy", "rollout/accuracy (%), mean over seeds, 5-step average", 100, 5),
    ("response_length/mean", "response_length/mean (tokens), mean over seeds, 5-step average", 1, 5),
]


def plot(curves: dict[str, dict[str, list]], out_png: Path) -> None:
    """`curves[tag][name]`: one curve per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 5))
    for ax, (tag, label, scale, window) in zip(axes, PANELS):
        for i, (name, runs) in enumerate(curves[tag].items()):
            steps, means = mean_curve(runs, window)
            style = "-" if name in ("VAPO", "vanilla PPO", "GRPO", "DAPO") else ":"
            marker = "o" if tag == "val/accuracy" else None
            ax.plot(steps, [scale * m for m in means], style, marker=marker, label=name,
                    color=plt.cm.tab20.colors[(2 * i) % 20 + (2 * i) // 20])  # fmt: skip
        ax.set_xlabel("rollout step")
        ax.set_ylabel(label)
    axes[0].set_title("Quickstart task: accuracy vs rollout steps")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=None, help="run names to include (default all)")
    ap.add_argument("--jobs", type=int, default=1, help="fits at a time (each gets 2/jobs threads)")
    ap.add_argument("--root", type=Path, default=ROOT / "runs/learning")
    ap.add_argument("--out", type=Path, default=None, help="markdown file (default: stdout)")
    ap.add_argument("extra", nargs="*", help="overrides for every fit, after `--`: -- --trainer.max_steps=20")
    args = ap.parse_args()
    args.root = args.root.resolve()
    if args.jobs > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, 2 // args.jobs))
    runs = [r for r in RUNS if args.only is None or r[0] in args.only]
    jobs = [(name, layer, seed) for name, layer, _ in runs for seed in args.seeds]
    dirs = {(n, s): args.root / slug(n) / f"seed{s}" for n, _, s in jobs}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        minutes = dict(zip(
            [(n, s) for n, _, s in jobs],
            pool.map(lambda j: fit(j[1], j[2], dirs[j[0], j[2]], args.extra), jobs),
        ))  # fmt: skip

    curves = {
        tag: {name: [scalar_curve(dirs[name, s], tag) for s in args.seeds] for name, _, _ in runs}
        for tag, *_ in PANELS
    }
    out = [
        "# Learning study: Table 1 in miniature (quickstart task)\n",
        f"Command: `.venv/bin/python benchmarks/bench_learning.py --seeds {' '.join(map(str, args.seeds))}"
        f"{' --jobs ' + str(args.jobs) if args.jobs > 1 else ''}"
        f"{' --root ' + str(args.root.relative_to(ROOT)) if args.root.is_relative_to(ROOT) else ''}"
        f" --out benchmarks/results/learning.md{' -- ' + ' '.join(args.extra) if args.extra else ''}`  ",
        f"Each run: `vapo fit -c {BASE} [-c <layer>] --seed_everything=<seed>`; val/accuracy is "
        "mean@4 at temperature 1.0 on the 200 validation problems.\n",
        "| run | paper (AIME24) | start % | final % (mean ± std) | best % | gain (points) "
        "| rollout acc., last 5 steps % | response length, last 5 steps (mean over seeds) "
        "| minutes per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _, paper in runs:
        cs = curves["val/accuracy"][name]
        last5 = {
            tag: [statistics.mean(v for _, v in c[-5:]) for c in curves[tag][name]]
            for tag in ("rollout/accuracy", "response_length/mean")
        }
        start = [c[0][1] for c in cs]
        final = [c[-1][1] for c in cs]
        best = [max(v for _, v in c) for c in cs]
        gain = [f - s for f, s in zip(final, start)]
        mins = statistics.mean(minutes[name, s] for s in args.seeds)
        out.append(
            f"| {name} | {paper if paper is not None else '-'} | {mean_std(start)} | {mean_std(final)} "
            f"| {mean_std(best)} | {mean_std(gain)} | {mean_std(last5['rollout/accuracy'])} "
            f"| {statistics.mean(last5['response_length/mean']):.1f} | {mins:.1f} |"
        )
    if any(name == "DAPO" for name, _, _ in runs):
        out.append(
            "\nDAPO's rollout accuracy and length are over the groups its dynamic sampling keeps "
            "(not all right, not all wrong): not comparable with the other rows."
        )
    out.append("\n![val/accuracy, rollout accuracy and response length vs rollout step]"
               "(learning_curves.png)\n")  # fmt: skip
    text = "\n".join(out) + "\n"
    if args.out:
        args.out.write_text(text)
        plot(curves, args.out.parent / "learning_curves.png")
    print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
