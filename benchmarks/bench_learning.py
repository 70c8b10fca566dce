"""Learning study: the paper's Table 1 in miniature, at equal policy updates.

For one task (`--task arithmetic`: the quickstart; `--task digitwise`: the credit-assignment
task; `--task digitwise_one_minibatch`: its first configuration, kept) it runs
`vapo fit -c <task config> [-c <layer>]` for VAPO, vanilla PPO, GRPO, DAPO, VAPO
without each of its seven techniques and an SAO-style row, for several seeds, and writes a
table in the shape of Table 1 with a 95 % confidence interval per row, Welch's test of each
row against VAPO (Holm-corrected), accuracy per difficulty bucket and the early-step curves.
`--task smollm2`, the pretrained-critic study on the real model, runs VAPO, VAPO with a critic
of the same architecture at random init, VAPO without value pretraining, vanilla PPO, GRPO
and DAPO, and also reports accuracy by answer length.

Fair budgets: every row gets `--updates` policy-update steps. A row with value pretraining
runs P more rollout steps first (its own column); it is validated at rollout step `updates`
(the equal-samples view, P fewer policy updates) and again after its last update (the
equal-updates view, from its last checkpoint by `vapo validate`). Rows without group sampling
see as many responses per step as the others (prompts_per_step × n prompts, n = 1).

Each finished run is distilled into a summary (`benchmarks/results/learning_runs/<task>/<row>/
seed<N>.json`: its validations, per-bucket accuracy, training curves, minutes, date, commit and
machine), committed with the results: a run with a summary is read, not rerun, so the study is
resumed or extended seed by seed on any machine. The runs themselves (TensorBoard files,
samples) stay under `--root`. `--jobs 2` runs two fits at a time, one thread each. `--partial`
writes the report over the seeds finished so far, saying how many each row has.

    python benchmarks/bench_learning.py --task digitwise --seeds 0 1 2 3 4 --jobs 2
    python benchmarks/bench_learning.py --task arithmetic --seeds 0 1 2 3 4 --jobs 2
    python benchmarks/bench_learning.py --task smollm2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vapo_lightning.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stamp import cpu_model, stamp  # noqa: E402

SUMMARIES = ROOT / "benchmarks/results/learning_runs"
CURVES = (
    "rollout/accuracy",
    "response_length/mean",
    "critic/vf_explained_var",
    "rollout/responses_sampled",
    "actor/critic_baseline",
    "critic_probe/explained_var",
    "critic_probe/explained_var/first_tenth",
    "critic_probe/explained_var/middle_tenth",
    "critic_probe/explained_var/last_tenth",
    "critic_probe/calibration",
    "critic_probe/baseline_share/critic",
    "critic_probe/baseline_share/group_mean",
)


# (name, layer over the task's config or None, the paper's Table 1 AIME24 score)
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
    ("SAO-style (n=1, 2 critic steps)", "configs/baselines/sao.yaml", None),
    # the mechanism test of the pretrained-critic study: a task-specific layer
    ("VAPO, critic at random init", None, None),
    # the critic that works: pretrained to convergence (`vapo pretrain-critic`), and EVPO's gate
    ("VAPO, critic pretrained to convergence", None, None),
    ("VAPO, gated baseline", None, None),
]
TABLE_1 = tuple(name for name, _, _ in RUNS[:-3])  # the rows of the miniature Table 1
RANDOM_CRITIC = "VAPO, critic at random init"
PRETRAINED_CRITIC, GATED = "VAPO, critic pretrained to convergence", "VAPO, gated baseline"
CRITIC_FREE = ("GRPO", "DAPO")  # the rows without a critic (vanilla PPO has one)


@dataclass(frozen=True)
class Task:
    config: str
    val: str
    updates: int  # policy-update steps per row
    buckets: tuple[tuple[int, int], ...]  # difficulty ranges reported separately
    out: str
    layers: dict[str, str]  # task-specific layers in place of the shared ones
    settings: tuple[tuple[str, str, str], ...] = ()  # (setting, the paper, here and why)
    reading: str = ""  # the RESULTS.md section that reads the report
    overrides: tuple[str, ...] = ()  # for every row's fit, after the task's config
    rows: tuple[str, ...] = TABLE_1  # the rows of RUNS it runs
    lengths: tuple[tuple[int, int], ...] = ()  # answer-length buckets (tokens) also reported
    threads: str = "one thread per run"  # how the runs shared the machine
    # which rows start their policy updates from the same value-pretrained critic
    critics: str = (
        "the prompts come in the same order in every run (`data.seed` 0), so the rows of one "
        "seed whose value pretraining samples a group per prompt (all but w/o group-sampling "
        "and SAO-style) start their policy updates from the same critic"
    )


TASKS = {
    "arithmetic": Task(
        "configs/quickstart.yaml",
        "vapo_lightning/assets/arithmetic/val.jsonl",
        50,
        ((1, 3), (4, 6), (7, 10)),
        "benchmarks/results/learning.md",
        {},
        (
            (
                "α of length-adaptive GAE",
                "0.05",
                "1.0: at 6-137 tokens (bare to worked answers) 0.05 gives λ_actor = 0 below 20 "
                "(the quickstart's setting)",
            ),
            ("λ_critic, γ, clip ε_low / ε_high, μ", "1, 1, 0.2 / 0.28, 0.1", "the same"),
            ("actor / critic learning rate", "1e-6 / 2e-6", "1e-4 / 5e-4: a 2.0 M model that must move in 50 updates"),
            ("value pretraining", "50 steps", "5 steps, before the 50 policy updates"),
            ("prompts × samples per rollout step", "512 × 16", "16 × 8: the quickstart's rollout, on one core"),
            (
                "mini-batch",
                "512 responses (16 optimiser steps per rollout)",
                "64 responses (2 optimiser steps per rollout)",
            ),
            ("learning-rate warm-up", "length not given", "3 steps"),
            ("evaluation", "AIME 2024 avg@32, T = 1.0, top-p 0.7", "200 validation problems × 4 samples, T = 1.0"),
        ),
        reading="learning-the-papers-table-1-in-miniature",
    ),
    "digitwise": Task(
        "configs/digitwise.yaml",
        "vapo_lightning/assets/digitwise/val.jsonl",
        40,
        ((2, 9), (10, 18), (19, 26)),
        "benchmarks/results/learning_credit.md",
        {
            "vanilla PPO": "configs/digitwise/ppo.yaml",
            "GRPO": "configs/digitwise/grpo.yaml",
            "DAPO": "configs/digitwise/dapo.yaml",
            "w/o value-pretraining": "configs/digitwise/vapo_wo_value_pretraining.yaml",
        },
        (
            (
                "α of length-adaptive GAE",
                "0.05",
                "0.05: λ_actor 0 at 17-20 tokens to 0.90 at 209 (0.98 would need answers of ~1000 "
                "tokens, 5× longer than the 10-minute runs allow)",
            ),
            ("λ_critic, γ, clip ε_low / ε_high, μ", "1, 1, 0.2 / 0.28, 0.1", "the same"),
            ("actor / critic learning rate", "1e-6 / 2e-6", "1e-4 / 5e-4: a 0.68 M model that must move in 40 updates"),
            ("value pretraining", "50 steps", "50 steps (the same), before the 40 policy updates"),
            ("prompts × samples per rollout step", "512 × 16", "8 × 8: one run ≤ 10 minutes on one core"),
            (
                "mini-batch",
                "512 responses (16 optimiser steps per rollout)",
                "16 responses (4 optimiser steps per rollout: with 1, no clip ever binds)",
            ),
            ("learning-rate warm-up", "length not given", "3 steps"),
            ("evaluation", "AIME 2024 avg@32, T = 1.0, top-p 0.7", "125 validation problems × 2 samples, T = 1.0"),
        ),
        reading="learning-on-the-credit-assignment-task",
    ),
    "smollm2": Task(
        "configs/smollm2.yaml",
        "vapo_lightning/assets/word_problems/val.jsonl",
        22,
        ((1, 1), (2, 2)),
        "benchmarks/results/learning_real.md",
        {
            "vanilla PPO": "configs/smollm2/ppo.yaml",
            "GRPO": "configs/smollm2/grpo.yaml",
            "DAPO": "configs/smollm2/dapo.yaml",
            "w/o value-pretraining": "configs/smollm2/vapo_wo_value_pretraining.yaml",
            "VAPO, critic at random init": "configs/smollm2/random_critic.yaml",
            PRETRAINED_CRITIC: "configs/smollm2/pretrained_critic.yaml",
            GATED: "configs/smollm2/critic_gate.yaml",
        },
        (
            (
                "model",
                "Qwen2.5-32B (policy and critic)",
                "SmolLM2-135M-Instruct from its GGUF (4-bit weights dequantised); the critic from its "
                "backbone with a fresh value head, or at random init (its own row)",
            ),
            (
                "α of length-adaptive GAE",
                "0.05",
                "0.05: λ_actor = 1 − 1/(0.05 l), 0.29 at 28 tokens to 0.75 at 81 (the mean answer "
                "lengths over the first and the last 5 steps of the config's run, results/smollm2.md)",
            ),
            ("λ_critic, γ, clip ε_low / ε_high, μ", "1, 1, 0.2 / 0.28, 0.1", "the same"),
            (
                "actor / critic learning rate",
                "1e-6 / 2e-6",
                "1e-5 / 1e-4: a 135 M pretrained model that must move in 22 updates",
            ),
            (
                "value pretraining",
                "50 steps",
                "8 steps, before the 22 policy updates; every run its own (the rows that start from "
                "the pretrained backbone's value pretraining: VAPO alone), a fixed count, not the "
                "explained-variance threshold, so that every row gets the same policy updates",
            ),
            (
                "prompts × samples per rollout step",
                "512 × 16",
                "16 × 4: sized for a run ≤ 60 min on 2 cores (runs whose answers reach the length "
                "cap take longer: the last column)",
            ),
            (
                "mini-batch",
                "512 responses (16 optimiser steps per rollout)",
                "16 responses (4 optimiser steps per rollout)",
            ),
            ("learning-rate warm-up", "length not given", "3 steps"),
            (
                "evaluation",
                "AIME 2024 avg@32, T = 1.0, top-p 0.7",
                "128 validation problems × 2 samples, T = 0.4, the config's (the start policy: 14.6 % "
                "at 0.4, 11.5 % at 0.7, results/real_model_start.md; 1.0 not measured)",
            ),
        ),
        rows=(
            "VAPO",
            "VAPO, critic at random init",
            "w/o value-pretraining",
            "vanilla PPO",
            "GRPO",
            "DAPO",
            PRETRAINED_CRITIC,
            GATED,
        ),
        lengths=((0, 63), (64, 127), (128, 192)),
        threads=(
            "two threads, one run at a time, except the runs of DAPO, the critic pretrained to "
            "convergence and the gated baseline: mostly one thread beside other work, so their "
            "minutes compare with the others' only roughly"
        ),
        critics=(
            "the prompts come in the same order in every run (`data.seed` 0); VAPO "
            "pretrains a critic from the policy's backbone and the random-critic row one "
            "from random weights, so no two rows share a value-pretrained critic"
        ),
    ),
}
# The credit-assignment study's first configuration, kept with its 27 runs: the whole step's
# 64 responses in one mini-batch, so every update is on-policy and no clip binds.
TASKS["digitwise_one_minibatch"] = replace(
    TASKS["digitwise"],
    out="benchmarks/results/learning_credit_one_minibatch.md",
    overrides=("--model.algorithm.mini_batch_size=64", "--model.algorithm.micro_batch_size=32"),
    settings=tuple(
        (s, paper, "64 responses (1 optimiser step per rollout)" if s == "mini-batch" else here)
        for s, paper, here in TASKS["digitwise"].settings
    ),
)


def task_runs(task: Task) -> list[tuple[str, str | None, int | None]]:
    """(name, layer, Table 1 score) of each row the task runs, its own layers in place."""
    return [(n, task.layers.get(n, layer), paper) for n, layer, paper in RUNS if n in task.rows]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def load(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text()) or {}


def value_pretraining_steps(base: dict, layer: dict) -> int:
    """P of the row: the ValuePretraining callback's steps in the callbacks it runs with
    (a layer's list replaces the base's), 0 without the callback."""
    callbacks = (layer.get("trainer") or {}).get("callbacks", base["trainer"]["callbacks"])
    for cb in callbacks:
        if cb["class_path"].endswith(".ValuePretraining"):
            return int((cb.get("init_args") or {}).get("steps", 50))
    return 0


def row_overrides(task: Task, layer_path: str | None) -> tuple[int, list[str]]:
    """(P, the row's command-line overrides): the fair budget and the equal responses."""
    base, layer = load(task.config), load(layer_path) if layer_path else {}
    p = value_pretraining_steps(base, layer)
    args = [
        f"--trainer.max_steps={task.updates + p}",
        f"--trainer.val_check_interval={task.updates}",
        *task.overrides,
    ]
    n = ((layer.get("model") or {}).get("generation") or {}).get("n")
    if n == 1:  # one response per prompt: as many prompts as the others' responses
        per_step = base["data"]["prompts_per_step"] * base["model"]["generation"]["n"]
        args.append(f"--data.prompts_per_step={per_step}")
    return p, args


def vapo(command: str, configs: list[str], run_dir: Path, args: list[str], log: str) -> None:
    cmd = [
        str(ROOT / ".venv/bin/vapo"),
        command,
        *(a for c in configs for a in ("-c", c)),
        f"--trainer.default_root_dir={run_dir}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=vapo_lightning.callbacks.ValidationSamples",
        f"--trainer.callbacks.path={run_dir / 'val_samples.jsonl'}",
        *args,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (run_dir / log).write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {run_dir / log}")


def run(task: Task, layer: str | None, seed: int, run_dir: Path, extra: list[str]) -> tuple[float, dict]:
    """One row, one seed: fit, then (P > 0) validate the last checkpoint. A fit killed after
    a checkpoint (a session's end) resumes from it, exactly as it would have gone on, with
    the training samples past the checkpoint dropped (the resumed fit writes them again);
    one killed before any starts afresh. Returns the run's minutes, its parts added (a killed
    part counted to its last checkpoint), and where a resumed run's first part stopped."""
    p, args = row_overrides(task, layer)
    configs = [task.config, *([layer] if layer else [])]
    last, started = run_dir / "checkpoints" / "last.ckpt", run_dir / "started.json"
    resumed: dict = {}
    minutes = 0.0
    if last.exists() and started.exists():  # a killed fit's last checkpoint
        import torch

        state = json.loads(started.read_text())
        step = int(torch.load(last, map_location="cpu", mmap=True, weights_only=False)["global_step"])
        resumed = {"resumed_from_step": step, "resumed_from_commit": state["commit"]}
        # a part killed before a checkpoint of its own (its last.ckpt older than its start) adds none
        minutes = state["minutes"] + max(0.0, last.stat().st_mtime - state["since"]) / 60
        keep_samples_up_to(run_dir / "train_samples.jsonl", step)
        resume = [f"--ckpt_path={last}"]
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # what a run killed before a checkpoint left
        run_dir.mkdir(parents=True)
        resume = []
    since = time.time()
    started.write_text(json.dumps({"minutes": minutes, "since": since, "commit": commit()}))
    vapo(
        "fit",
        configs,
        run_dir,
        [f"--seed_everything={seed}", "--model.hf_export_dir=null", *args, *extra, *resume],
        f"log{'_resumed' * bool(resumed)}.txt",
    )
    if p:
        vapo(
            "validate",
            configs,
            run_dir,
            [f"--seed_everything={seed}", f"--ckpt_path={last}", *extra],
            "log_validate.txt",
        )
    last.unlink(missing_ok=True)  # the study keeps curves and samples, not weights
    started.unlink()
    return minutes + (time.time() - since) / 60, resumed


def keep_samples_up_to(path: Path, step: int) -> None:
    """Drops the rows of a samples file written after rollout step `step`."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= step]
        path.write_text("".join(rows))


def summary_path(folder: str, name: str, seed: int) -> Path:
    return SUMMARIES / folder / slug(name) / f"seed{seed}.json"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def commit_span(commits: set[str]) -> str:
    """The runs' commits as a range in history order ("7 commits, a1b2c3d to e4f5a6b"); one
    commit, or commits this clone does not know, are named as they are."""

    def when(c: str) -> int | None:
        proc = subprocess.run(["git", "show", "-s", "--format=%ct", c], cwd=ROOT, capture_output=True, text=True)
        return int(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None

    times = {c: when(c) for c in commits}
    if len(commits) == 1 or None in times.values():
        return f"commit{'s' * (len(commits) > 1)} {', '.join(sorted(commits))}"
    ordered = sorted(commits, key=lambda c: (times[c], c))
    return f"{len(ordered)} commits, {ordered[0]} to {ordered[-1]}"


def summarize(task: Task, run_dir: Path, minutes: float, at_commit: str) -> dict:
    """What the report needs of a finished run, small enough to commit."""
    difficulty = {row["prompt"]: row["difficulty"] for row in read_jsonl(ROOT / task.val)}
    return {
        "val": val_points(run_dir),
        "buckets": bucket_accuracy(run_dir, difficulty, task.buckets),
        "start_buckets": bucket_accuracy(run_dir, difficulty, task.buckets, first=True),
        **({"lengths": length_accuracy(run_dir, task.lengths)} if task.lengths else {}),
        "curves": {tag: scalar_curve(run_dir, tag) for tag in CURVES},
        **dynamic_sampling(run_dir),
        "minutes": round(minutes, 2),
        "date": time.strftime("%Y-%m-%d"),
        "commit": at_commit,
        "machine": machine(),
    }


def dynamic_sampling(run_dir: Path) -> dict:
    """What DAPO's dynamic sampling filtered on in this run (`dynamic_sampling_metric`: the
    answers' correctness or their total reward), read from the config the fit saved; {} for
    a run without dynamic sampling."""
    configs = sorted(run_dir.glob("lightning_logs/version_*/config.yaml"))
    config = load(str(configs[0])) if configs else {}
    algo = (config.get("model") or {}).get("algorithm") or {}
    if not algo.get("dynamic_sampling_rounds"):
        return {}
    return {"dynamic_sampling_metric": algo.get("dynamic_sampling_metric", "reward")}


def ensure_run(folder: str, task: Task, job: tuple, root: Path, extra: list[str], again: bool = False) -> dict:
    """The run's summary: read if committed, else the run is made and summarized. `again`:
    a committed summary whose run is still under `root` is made anew from it (what the run
    took, when and where are kept)."""
    name, layer, seed = job
    path = summary_path(folder, name, seed)
    run_dir = root / slug(name) / f"seed{seed}"
    if path.exists():
        old = json.loads(path.read_text())
        if not (again and (run_dir / "val_samples.jsonl").exists()):
            return old
        summary = summarize(task, run_dir, old["minutes"], old["commit"])
        kept = ("date", "machine", "resumed_from_step", "resumed_from_commit")
        summary.update({k: old[k] for k in kept if k in old})
    else:
        at_commit = commit()
        minutes, resumed = run(task, layer, seed, run_dir, extra)
        summary = summarize(task, run_dir, minutes, at_commit) | resumed
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(path)
    return json.loads(path.read_text())  # as a later study reads it


# ------------------------------------------------------------------ reading the runs


def scalar_curve(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    points: dict[int, float] = {}
    for path in sorted(glob.glob(f"{run_dir}/lightning_logs/version_*/events.out.tfevents.*")):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            points.update((e.step, e.value) for e in acc.Scalars(tag))
    return sorted(points.items())


def val_points(run_dir: Path) -> list[float]:
    """val/accuracy of each validation of a run, in the order they ran (the fit's, a resumed
    fit's files after the first part's, then the final `vapo validate`'s, which logs under
    `validate/`): not merged by step, as the two processes count steps apart."""
    points = []

    def order(path: str) -> tuple[int, int]:  # version, then the file's creation (a resumed fit's)
        return int(Path(path).parent.name.split("_")[1]), int(Path(path).name.split(".")[3])

    fit_then_validate = [
        path
        for folder in ("lightning_logs", "validate")
        for path in sorted(glob.glob(f"{run_dir}/{folder}/version_*/events.out.tfevents.*"), key=order)
    ]
    for path in fit_then_validate:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        if "val/accuracy" in acc.Tags()["scalars"]:
            points += [e.value for e in sorted(acc.Scalars("val/accuracy"), key=lambda e: e.wall_time)]
    return points


def bucket_accuracy(run_dir: Path, difficulty: dict[str, int], buckets, first: bool = False) -> list[float]:
    """Accuracy of the last validation's samples (`first`: the start's), per difficulty
    bucket."""
    hits: dict[int, list[bool]] = {i: [] for i in range(len(buckets))}
    for s in validation_samples(run_dir, first):
        # the sample's prompt is the chat-formatted one: the longest task prompt it holds
        k = difficulty[max((p for p in difficulty if p in s["prompt"]), key=len)]
        i = next(i for i, (lo, hi) in enumerate(buckets) if lo <= k <= hi)
        hits[i].append(bool(s["correct"]))
    return [statistics.mean(h) if h else math.nan for h in hits.values()]


def validation_samples(run_dir: Path, first: bool = False) -> list[dict]:
    """The last validation's samples (the last run of consecutive lines with one step;
    `first`: the first, the start). By position, not by step: `vapo validate` appends its
    samples at step 0, after the fit's own step-0 validation."""
    with (run_dir / "val_samples.jsonl").open() as f:
        samples = [json.loads(line) for line in f]
    order = samples if first else samples[::-1]
    return list(itertools.takewhile(lambda s: s["step"] == order[0]["step"], order))


def length_accuracy(run_dir: Path, buckets) -> list[tuple[float, int]]:
    """(accuracy, number of answers) of the last validation's answers per length bucket, in
    tokens (`response_tokens`); the counts say where the policy's answers went."""
    hits: dict[int, list[bool]] = {i: [] for i in range(len(buckets))}
    for s in validation_samples(run_dir):
        n = s["response_tokens"]
        hits[next(i for i, (lo, hi) in enumerate(buckets) if lo <= n <= hi)].append(bool(s["correct"]))
    return [(statistics.mean(h) if h else math.nan, len(h)) for h in hits.values()]


def ci95(xs: list[float]) -> str:
    """mean ± half-width of the 95 % t interval, in points."""
    from scipy import stats

    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{100 * m:.1f}"
    half = stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{100 * m:.1f} ± {100 * half:.1f}"


def holm(raw: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment (Holm 1979): the i-th smallest of m p-values times
    (m - i + 1), made monotone, capped at 1."""
    adjusted, running = {}, 0.0
    for i, (name, p) in enumerate(sorted(raw.items(), key=lambda kv: kv[1])):
        running = max(running, min(1.0, (len(raw) - i) * p))
        adjusted[name] = running
    return adjusted


def welch_holm(reference: list[float], rows: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Welch's t-test of each row against the reference, p-values Holm-adjusted over the
    rows: {name: (difference of means, adjusted p)}."""
    from scipy import stats

    raw = {
        n: float(stats.ttest_ind(xs, reference, equal_var=False).pvalue)
        for n, xs in rows.items()
        if len(xs) > 1 and len(reference) > 1
    }
    adjusted = holm(raw)
    return {n: (statistics.mean(rows[n]) - statistics.mean(reference), adjusted.get(n, math.nan)) for n in rows}


def mean_curve(runs: list[list[tuple[int, float]]], shift: int, window: int) -> tuple[list, list]:
    """Mean over seeds at each step all runs have, x shifted by -P, trailing moving average."""
    by_step = [dict(r) for r in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    means = [statistics.mean(d[s] for d in by_step) for s in steps]
    smooth = [statistics.mean(means[max(0, i - window + 1) : i + 1]) for i in range(len(means))]
    return [s - shift for s in steps], smooth


def plot(rows: list[dict], task_name: str, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rollout/accuracy", "rollout accuracy (%), 5-step average", 100),
        ("response_length/mean", "response length (tokens), 5-step average", 1),
        ("critic/vf_explained_var", "critic's explained variance, 5-step average", 1),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    for ax, (tag, label, scale) in zip(axes, panels):
        for i, row in enumerate(rows):
            if not all(row["curves"][tag]):  # no critic, or a summary from before the tag
                continue
            steps, means = mean_curve(row["curves"][tag], row["p"], 5)
            style = "-" if row["name"] in ("VAPO", "vanilla PPO", "GRPO", "DAPO") else ":"
            ax.plot(
                steps,
                [scale * m for m in means],
                style,
                label=row["name"],
                color=plt.cm.tab20.colors[(2 * i) % 20 + (2 * i) // 20],
            )
        ax.axvline(0, color="grey", lw=0.5)
        ax.set_xlabel("policy-update step (value pretraining at < 0)")
        ax.set_ylabel(label + ", mean over seeds")
    axes[0].set_title(f"{task_name}: training rollouts")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


def ordering_vs_paper(rows: list[dict]) -> str:
    """Spearman's rank correlation of our final means with Table 1's scores, and the pairs
    of rows whose order agrees with the paper's."""
    from scipy import stats

    scored = [r for r in rows if r["paper"] is not None]
    if len(scored) < 3:
        return f"Only {len(scored)} of the rows have a Table 1 score: no ordering to compare."
    ours, paper = [statistics.mean(r["final"]) for r in scored], [r["paper"] for r in scored]
    rho, p = stats.spearmanr(ours, paper)
    pairs = [(a, b) for i, a in enumerate(scored) for b in scored[i + 1 :] if a["paper"] != b["paper"]]
    agree = sum(
        (statistics.mean(a["final"]) - statistics.mean(b["final"])) * (a["paper"] - b["paper"]) > 0 for a, b in pairs
    )
    weak = (
        f" Over {len(scored)} points (p = {p:.2f}) this is no evidence of agreement with the paper, nor against it."
        if p >= 0.05
        else ""
    )
    return (
        f"Spearman's rank correlation with Table 1 over the {len(scored)} rows it scores: "
        f"{rho:.2f}; {agree} of {len(pairs)} pairs of rows are in the paper's order.{weak}"
    )


def averaged_buckets(rows: list[dict]) -> list[str]:
    """Rows with value pretraining whose summaries predate `start_buckets`: their summarizer
    read the start and the final validation (both at step 0 in the samples file) as one."""
    return [r["name"] for r in rows if r["p"] and len(r["start_buckets"]) < r["seeds"]]


def reading(rows: list[dict], tests: dict[str, tuple[float, float]], lo_hi: str) -> list[str]:
    """The table read against Table 1 and the paper's argument, computed from the rows so
    that it is always the table's: the baselines' order, each ablation's direction (Table 1:
    removing any technique lowers the score), and VAPO's lead by difficulty (§1: it should
    grow with length). Every difference carries its Holm-adjusted p."""
    vapo_row = next((r for r in rows if r["name"] == "VAPO"), None)
    if vapo_row is None or len(rows) < 2:
        return []

    def versus(r: dict) -> str:
        diff, p = tests[r["name"]]
        return f"{r['name']} {100 * diff:+.1f} ({p_value(p)})"

    mean = {r["name"]: statistics.mean(r["final"]) for r in rows}
    random_critic = next((r for r in rows if r["name"] == RANDOM_CRITIC), None)
    working = [r for r in rows if r["name"] in (PRETRAINED_CRITIC, GATED)]
    others = [
        r
        for r in rows
        if r is not vapo_row and r is not random_critic and r not in working and not r["name"].startswith("w/o ")
    ]
    ablations = [r for r in rows if r["name"].startswith("w/o ")]
    out = ["Read against the paper, from the table above (points against VAPO, Holm p):\n"]
    if others:
        scored = sorted(
            (r for r in rows if r["paper"] is not None and not r["name"].startswith("w/o ")), key=lambda r: -r["paper"]
        )
        ours = sorted(scored, key=lambda r: -mean[r["name"]])
        paper_order = " > ".join(f"{r['name']} {r['paper']}" for r in scored)
        our_order = " > ".join(f"{r['name']} {100 * mean[r['name']]:.1f}" for r in ours)
        out.append(
            f"- **Baselines**: {'; '.join(map(versus, others))}. Table 1's order {paper_order}; "
            f"here {our_order}: {'the same' if ours == scored else 'not the same'}."
        )
    if random_critic is not None:
        out.append(critic_pretraining(vapo_row, random_critic, others, tests))
    if working:
        out.append(a_critic_that_works(rows, working, tests))
    if ablations:
        lower = [r for r in ablations if mean[r["name"]] < mean["VAPO"]]
        rest = [r for r in ablations if r not in lower]
        held = [r["name"] for r in lower if tests[r["name"]][1] < 0.05]
        out.append(
            f"- **Ablations** (Table 1: each removal lowers the score): lower here, the paper's "
            f"direction, {len(lower)} of {len(ablations)}: "
            f"{'; '.join(map(versus, lower)) or 'none'}. Not lower: "
            f"{'; '.join(map(versus, rest)) or 'none'}. Lower with Holm p < 0.05: "
            f"{', '.join(held) or 'none'}."
        )
    stale = averaged_buckets(rows)
    if stale:
        return [
            *out,
            f"- **By difficulty**: not read; the accuracies by difficulty of "
            f"{', '.join(stale)} average the start and the final validation.",
            "",
        ]
    gaps = {
        r["name"]: [
            statistics.mean(v) - statistics.mean(r_) for v, r_ in zip(zip(*vapo_row["buckets"]), zip(*r["buckets"]))
        ]
        for r in rows
        if r is not vapo_row
    }
    grows = [n for n, g in gaps.items() if g[-1] > g[0]]
    listed = [r["name"] for r in [*others, *ablations, *([random_critic] if random_critic else []), *working]]
    by_row = "; ".join(n + " " + " / ".join(f"{100 * x:+.1f}" for x in gaps[n]) for n in listed)
    out.append(
        f"- **By difficulty** (the paper's argument: VAPO's lead grows with the length of the "
        f"reasoning, read here as the problem's difficulty): VAPO minus each row at {lo_hi}: "
        f"{by_row}. VAPO minus the row is higher on the hardest bucket than on the easiest "
        f"against {len(grows)} of the {len(gaps)} other rows"
        f"{': ' + ', '.join(grows) if grows else ''} (the buckets are not tested one by "
        "one: read them as a direction)."
    )
    hardest = [statistics.mean(b[-1] for b in r["buckets"]) for r in rows]
    if max(hardest) < 0.10:
        out.append(
            f"  Every row ends at {100 * min(hardest):.1f}-{100 * max(hardest):.1f} % on the "
            "hardest bucket: near the floor, where no row's gap can grow, so these gaps say "
            "nothing about VAPO's lead and the length of the reasoning."
        )
    return [*out, ""]


def exact_floor(rows: list[dict]) -> float:
    """The smallest two-sided p an exact permutation test can give VAPO's seeds against a
    row's: 2 / C(n + m, n), at the most seeds a row has."""
    vapo_n = next((r["seeds"] for r in rows if r["name"] == "VAPO"), 0)
    m = max((r["seeds"] for r in rows if r["name"] != "VAPO"), default=0)
    return min(1.0, 2 / math.comb(vapo_n + m, m)) if vapo_n and m else 1.0


def floor_seeds(rows: list[dict]) -> str:
    vapo_n = next((r["seeds"] for r in rows if r["name"] == "VAPO"), 0)
    m = max((r["seeds"] for r in rows if r["name"] != "VAPO"), default=0)
    return f"{vapo_n} seeds against {m}"


def p_value(p: float) -> str:
    """A Holm-adjusted p as the report writes it; none where a side has one seed."""
    return "no p: one seed" if math.isnan(p) else f"p = {p:.3f}"


def critic_pretraining(
    vapo_row: dict, random_critic: dict, others: list[dict], tests: dict[str, tuple[float, float]]
) -> str:
    """The study's question read from the table: does the critic from the policy's pretrained
    backbone put VAPO ahead of the same VAPO with a critic at random init (the mechanism), and
    ahead of the critic-free rows (the paper's claim)?"""
    diff, p = tests[random_critic["name"]]
    ahead = "ahead of" if diff < 0 else "not ahead of"
    held = "held at Holm p < 0.05" if p < 0.05 else "not held at p < 0.05"
    critic_free = [r for r in others if r["name"] in CRITIC_FREE]
    beaten = [r["name"] for r in critic_free if tests[r["name"]][0] < 0]
    against = "; ".join(
        f"{r['name']} {100 * tests[r['name']][0]:+.1f} ({p_value(tests[r['name']][1])})" for r in critic_free
    )
    return (
        f"- **The critic's pretraining** (the mechanism): the critic at random init "
        f"{100 * diff:+.1f} points against VAPO's from the backbone ({p_value(p)}): the "
        f"pretrained critic is {ahead} the random one here ({held}). The critic's explained "
        f"variance over the last 10 updates: {late_explained_variance(vapo_row)} from the "
        f"backbone, {late_explained_variance(random_critic)} at random init. Against the "
        f"critic-free rows: {against or 'none run'}; VAPO ahead of {len(beaten)} of "
        f"{len(critic_free)}{': ' + ', '.join(beaten) if beaten else ''}."
    )


def a_critic_that_works(rows: list[dict], working: list[dict], tests: dict[str, tuple[float, float]]) -> str:
    """The pretrained-to-convergence critic and the gated baseline, each against VAPO and
    against DAPO (Welch, Holm over these rows), with the critic's held-out explained variance
    when the actor starts."""
    dapo = next((r for r in rows if r["name"] == "DAPO"), None)
    vs_dapo = welch_holm(dapo["final"], {r["name"]: r["final"] for r in working}) if dapo else {}
    parts = []
    for r in working:
        diff, p = tests[r["name"]]
        line = f"{r['name']} {100 * diff:+.1f} against VAPO ({p_value(p)})"
        if r["name"] in vs_dapo:
            d, q = vs_dapo[r["name"]]
            line += f", {100 * d:+.1f} against DAPO ({p_value(q)})"
        start = probe_at(r, r["p"])
        line += f"; the critic's held-out explained variance when the actor starts: {start}"
        parts.append(line)
    return (
        "- **A critic that works?** " + "; ".join(parts) + ". With 3 seeds against 3, no "
        "distribution-free test can go below p = 0.10 (an exact permutation test's smallest "
        "two-sided p is 2 / 20): read a Welch p below that as a direction the seeds agree on."
    )


def responses_sampled(row: dict, task: Task) -> str:
    """Responses a run sampled, mean over seeds: the sum of `rollout/responses_sampled` where
    it was logged; rollout steps × prompts × n where no dynamic sampling can draw more; else
    not known ("not logged")."""
    logged = row["curves"].get("rollout/responses_sampled") or []
    if logged and all(logged):
        return f"{statistics.mean(sum(v for _, v in c) for c in logged):,.0f}"
    path = task.layers.get(row["name"]) or dict((n, lp) for n, lp, _ in RUNS).get(row["name"])
    base, layer = load(task.config), load(path) if path else {}
    model = layer.get("model") or {}
    if (model.get("algorithm") or {}).get("dynamic_sampling_rounds"):
        return "not logged"
    per_step = base["data"]["prompts_per_step"] * base["model"]["generation"]["n"]  # every row's
    return f"{(task.updates + row['p']) * per_step:,}"


def probe_at(row: dict, step: int, tag: str = "critic_probe/explained_var") -> str:
    """The probe's number after `step` rollout steps (the actor's start: P), mean over seeds;
    "-" where the probe did not run."""
    curves = row["curves"].get(tag) or []
    points = [dict(c).get(step) for c in curves if c]
    if not points or None in points or len(points) < row["seeds"]:
        return "-"
    return f"{statistics.mean(points):.2f}"


def probe_late(row: dict, updates: int = 10) -> str:
    curves = row["curves"].get("critic_probe/explained_var") or []
    if not curves or not all(curves):
        return "-"
    return f"{statistics.mean(v for c in curves for _, v in c[-updates:]):.2f}"


def critic_share(row: dict) -> str:
    """The share of policy updates whose advantages used the critic (the gated baseline)."""
    curves = row["curves"].get("actor/critic_baseline") or []
    if not curves or not all(curves):
        return "-"
    return f"{100 * statistics.mean(v for c in curves for _, v in c):.0f} %"


def samples_and_critics(task: Task, rows: list[dict]) -> list[str]:
    """Per row: responses sampled, and what the critic knows on held-out answers."""
    out = [
        "",
        "Responses sampled and the critic on held-out answers (`CriticProbe`: the same "
        "answers to the first 32 validation prompts × 4, sampled once from the start policy; "
        '"-": not measured in that row\'s runs), mean over seeds:',
        "",
        "| run | responses sampled per run | held-out explained variance when the actor starts "
        "| held-out explained variance, last 10 steps | calibration of V(s_0) when the actor starts "
        "| policy updates whose advantages used the critic |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {responses_sampled(r, task)} | {probe_at(r, r['p'])} | {probe_late(r)} "
            f"| {probe_at(r, r['p'], 'critic_probe/calibration')} | {critic_share(r)} |"
        )
    return out


def val_temperature(task: Task) -> float:
    """The validation's sampling temperature in the task's config (the default: 1.0)."""
    return float((load(task.config)["model"].get("val_generation") or {}).get("temperature", 1.0))


def late_explained_variance(row: dict, updates: int = 10) -> str:
    """The critic's explained variance over the last `updates` steps, mean over seeds; "-"
    for rows without a critic (or summaries without the curve)."""
    curves = row["curves"]["critic/vf_explained_var"]
    if not curves or not all(curves):
        return "-"
    return f"{statistics.mean(v for c in curves for _, v in c[-updates:]):.2f}"


def report(
    task_name: str,
    task: Task,
    seeds: list[int],
    rows: list[dict],
    command: str,
    png: str,
    folder: str | None = None,
) -> str:
    lo_hi = " / ".join(f"{lo}-{hi}" for lo, hi in task.buckets)
    vapo_row = next((r for r in rows if r["name"] == "VAPO"), None)
    tests = (
        welch_holm(vapo_row["final"], {r["name"]: r["final"] for r in rows if r is not vapo_row}) if vapo_row else {}
    )
    machines = sorted({m for r in rows for m in r["machines"]})
    dates = sorted({d for r in rows for d in r["dates"]})
    out = [
        f"# Learning study: Table 1 in miniature ({task_name} task)\n",
        f"Command: `{command}`  ",
        f"Report: {stamp()}  ",
        f"Runs: {sum(r['seeds'] for r in rows)}, {dates[0]} to {dates[-1]}, "
        f"{commit_span({c for r in rows for c in r['commits']})}, on {'; '.join(machines)}"
        f" ({task.threads}; summaries in `{os.path.relpath(SUMMARIES, ROOT)}/{folder or task_name}/`).\n",
        f"Each run: `vapo fit -c {task.config} [-c <layer>] "
        f"{''.join(o + ' ' for o in task.overrides)}--seed_everything=<seed>` for "
        f"{task.updates} policy-update steps; seeds {', '.join(map(str, seeds))}. A seed sets "
        f"the sampling and the critic head's initialisation; {task.critics}. "
        f"val/accuracy: mean@k at temperature {val_temperature(task):g} on the validation set "
        f"(`{task.val}`). Final = after the last policy update (equal updates); "
        "equal rollout steps = at the same number of rollout steps as the rows without value "
        "pretraining (not equal responses: DAPO's dynamic sampling draws extra prompts, so it "
        "samples more responses a step; the responses each row sampled are listed below where "
        "the runs logged them). ± is the 95 % confidence interval of the mean over seeds; p is Welch's "
        f"test against VAPO, Holm-adjusted over the rows; with {floor_seeds(rows)} no "
        f"distribution-free test goes below p = {exact_floor(rows):.3f} (an exact permutation "
        "test's smallest two-sided p), so read a Welch p below that as a direction the seeds "
        "agree on. The critic's explained variance is "
        "against its own targets, the GAE returns with λ_critic: at λ_critic = 1 (VAPO and "
        "most ablations) the final reward itself; vanilla PPO (0.95) and w/o decoupled GAE "
        "(the actor's λ) bootstrap from the critic's own values, an easier target, so their "
        "numbers are not comparable with the others'.\n",
        *(
            [
                "Where the runs differ from the paper's setup (§5.1), for every row alike:\n",
                "| setting | the paper | here |",
                "|---|---|---|",
                *(f"| {a} | {b} | {c} |" for a, b, c in task.settings),
                "",
            ]
            if task.settings
            else []
        ),
        f"| run | paper (AIME24) | seeds | value-pretraining rollouts | start % | final % "
        f"| vs VAPO (points, Holm p; exact-test floor {exact_floor(rows):.3f}) "
        f"| equal rollout steps % | final % by difficulty {lo_hi} "
        "| critic's explained variance, last 10 updates | minutes per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff, p = tests.get(r["name"], (math.nan, math.nan))
        versus = "-" if r is vapo_row else f"{100 * diff:+.1f}, {p_value(p)}"
        buckets = " / ".join(f"{100 * statistics.mean(b):.1f}" for b in zip(*r["buckets"]))
        out.append(
            f"| {r['name']} | {r['paper'] if r['paper'] is not None else '-'} | {r['seeds']} "
            f"| {r['p']} | {ci95(r['start'])} | {ci95(r['final'])} | {versus} "
            f"| {ci95(r['equal_samples'])} | {buckets} | {late_explained_variance(r)} "
            f"| {statistics.mean(r['minutes']):.1f} |"
        )
    if stale := averaged_buckets(rows):
        out += [
            "",
            f"By difficulty, {', '.join(stale)}: the average of the start and the final "
            "validation (summaries made before the two were told apart); the overall "
            "final % is right.",
        ]
    out += per_seed(rows)
    out += by_length(task, rows)
    out += samples_and_critics(task, rows)
    starts = [b for r in rows for b in r["start_buckets"]]
    if starts:
        out += [
            "",
            "At the start, by difficulty (every row's start is the same model): "
            + " / ".join(f"{100 * statistics.mean(b):.1f}" for b in zip(*starts))
            + " %.",
        ]
    out += [
        "",
        ordering_vs_paper(rows),
        "",
        *reading(rows, tests, lo_hi),
        *(
            [
                f"The study's section in RESULTS.md, with its command, machine and reading: "
                f"[RESULTS.md](../RESULTS.md#{task.reading}).\n"
            ]
            if task.reading
            else []
        ),
        f"![rollout accuracy and response length vs policy-update step]({png})",
        "",
    ]
    if any(r["name"] == "DAPO" for r in rows):
        out.insert(
            -2,
            "DAPO's rollout accuracy and length are over the groups its dynamic "
            "sampling keeps: its curves are not comparable with the other rows. "
            + filters(next(r for r in rows if r["name"] == "DAPO"))
            + "\n",
        )
    return "\n".join(out)


def filters(row: dict) -> str:
    """Which groups DAPO's dynamic sampling dropped, over the row's runs: those whose answers
    were all right or all wrong (`dynamic_sampling_metric: correct`, the default), or, in runs
    summarised without the field (made before the metric was a choice), those whose total
    rewards were all equal, which keeps a group of wrong answers that a shaping reward tells apart."""
    correct = sum(f == "correct" for f in row["filters"])
    if correct == len(row["filters"]):
        return "Its dynamic sampling dropped the groups whose answers were all right or all wrong."
    return (
        f"Its dynamic sampling dropped the groups whose answers were all right or all wrong in {correct} "
        f"of its {len(row['filters'])} runs, and in the others the groups whose total rewards were all "
        "equal (with the overlong penalty in the sum, a group of wrong answers of different lengths was "
        "kept and trained on)" + (": runs made before the filter on correctness." if None in row["filters"] else ".")
    )


def per_seed(rows: list[dict]) -> list[str]:
    """Each seed's final `val/accuracy` and minutes, so that a reading can quote one seed."""
    if any(len(r.get("seed_ids", ())) != len(r["final"]) for r in rows):
        return []
    out = [
        "",
        "Each seed's final `val/accuracy` and minutes per run:",
        "",
        "| run | seeds | final % | minutes |",
        "|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {', '.join(map(str, r['seed_ids']))} "
            f"| {', '.join(f'{100 * x:.1f}' for x in r['final'])} "
            f"| {', '.join(f'{m:.0f}' for m in r['minutes'])} |"
        )
    return out


def by_length(task: Task, rows: list[dict]) -> list[str]:
    """The final validation's accuracy and share of answers per answer-length bucket, mean
    over seeds (answers, not problems: a row whose answers grow moves between buckets)."""
    rows = [r for r in rows if r["lengths"]]
    if not task.lengths or not rows:
        return []
    heads = " | ".join(f"{lo}-{hi} tokens: % right (share of answers)" for lo, hi in task.lengths)
    out = [
        "",
        "Final validation by answer length, mean over seeds:",
        "",
        f"| run | {heads} |",
        "|---|" + "---|" * len(task.lengths),
    ]
    for r in rows:
        cells = []
        for bucket in zip(*r["lengths"]):  # (accuracy, count) per seed
            accs = [a for a, n in bucket if n]
            share = statistics.mean(n / sum(m for _, m in seed) for (_, n), seed in zip(bucket, r["lengths"]))
            cells.append(
                f"{100 * statistics.mean(accs):.1f} ({100 * share:.0f} %)" if accs else f"- ({100 * share:.0f} %)"
            )
        out.append(f"| {r['name']} | {' | '.join(cells)} |")
    return out


def collect(task: Task, name: str, layer: str | None, paper, summaries: list[dict]) -> dict:
    p, _ = row_overrides(task, layer)
    out = {
        "name": name,
        "paper": paper,
        "p": p,
        "seeds": len(summaries),
        "start": [],
        "final": [],
        "equal_samples": [],
        "buckets": [],
        "start_buckets": [],
        "lengths": [],
        "minutes": [s["minutes"] for s in summaries],
        "curves": {},
        "machines": {s["machine"] for s in summaries},
        "dates": {s["date"] for s in summaries},
        "commits": {s["commit"] for s in summaries},
        "filters": [s.get("dynamic_sampling_metric") for s in summaries],
    }
    for s in summaries:
        val = s["val"]  # start, at `updates` rollout steps, [after P more]
        if len(val) < (3 if p else 2):
            raise RuntimeError(f"{name}: {len(val)} validations, expected {3 if p else 2}")
        out["start"].append(val[0])
        out["equal_samples"].append(val[1])
        out["final"].append(val[-1])
        out["buckets"].append(s["buckets"])
        if "start_buckets" in s:
            out["start_buckets"].append(s["start_buckets"])
        if "lengths" in s:
            out["lengths"].append(s["lengths"])
    for tag in CURVES:
        out["curves"][tag] = [[tuple(point) for point in s["curves"].get(tag, [])] for s in summaries]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="digitwise")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--only", nargs="*", default=None, help="run names to include (default all)")
    ap.add_argument("--jobs", type=int, default=1, help="fits at a time (each gets 2/jobs threads)")
    ap.add_argument("--root", type=Path, default=None, help="default: runs/learning_<task>")
    ap.add_argument("--out", type=Path, default=None, help="markdown file (default: the task's)")
    ap.add_argument("--updates", type=int, default=None, help="policy updates per row (default: the task's)")
    ap.add_argument("--no-report", action="store_true", help="run only, write nothing")
    ap.add_argument("--partial", action="store_true", help="report the finished runs only, running none")
    ap.add_argument(
        "--summaries",
        default=None,
        help=f"folder of the run summaries under {os.path.relpath(SUMMARIES, ROOT)} (default: the task)",
    )
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="make the summaries of finished runs still under --root anew (new fields)",
    )
    ap.add_argument("extra", nargs="*", help="overrides for every run, after `--`")
    args = ap.parse_args()
    task = TASKS[args.task]
    if args.updates is not None:
        task = replace(task, updates=args.updates)
    root = (args.root or ROOT / f"runs/learning_{args.task}").resolve()
    out = args.out or ROOT / task.out
    if args.jobs > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, 2 // args.jobs))
    runs = [run for run in task_runs(task) if args.only is None or run[0] in args.only]
    jobs = [(name, layer, seed) for seed in args.seeds for name, layer, _ in runs]
    folder = args.summaries or args.task
    if args.partial:
        jobs = [j for j in jobs if summary_path(folder, j[0], j[2]).exists()]
    with ThreadPoolExecutor(args.jobs) as pool:
        summaries = dict(
            zip(
                [(n, s) for n, _, s in jobs],
                pool.map(lambda j: ensure_run(folder, task, j, root, args.extra, args.resummarize), jobs),
            )
        )
    if args.no_report:
        return
    rows = [
        collect(task, n, layer, paper, [summaries[n, s] for s in args.seeds if (n, s) in summaries])
        for n, layer, paper in runs
    ]
    for r in rows:
        r["seed_ids"] = [s for s in args.seeds if (r["name"], s) in summaries]
    rows = [r for r in rows if r["seeds"]]
    command = " ".join(["python benchmarks/bench_learning.py", *sys.argv[1:]])
    png = out.with_name(out.stem + "_curves.png")
    text = report(args.task, task, args.seeds, rows, command, png.name, folder)
    out.write_text(text)
    plot(rows, args.task, png)
    print(text)


if __name__ == "__main__":
    main()
