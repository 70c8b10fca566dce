"""`vapo pretrain-critic -c CONFIG [--out DIR]`: value pretraining (VAPO §4.1) run to
convergence, apart from and before a run.

The paper warms the critic up from the fixed initial policy "until the value loss converges"
(§5.1: 50 steps of 512 prompts × 16 answers). Here, from the config's policy, engine,
generation and rewards:

1. **Buffer**: n answers to each of many distinct training prompts (a critic learns a
   prompt's difficulty from many prompts, not from many answers to few), sampled once into
   ``<out>/buffer/`` (`critic_buffer`: reused, resumed, the same draws however often it was
   interrupted).
2. **Regression**: the critic on the λ = γ = 1 Monte-Carlo return (the final reward at every
   response token) by `updates.update_critic` without a value clip, epochs over the buffer's
   training prompts, AdamW at the config's critic learning rate and warm-up; a held-out split *by prompt* is scored after every epoch
   (`critic_checks`); training stops when its explained variance has not improved for
   `patience` epochs, and the best epoch's critic is written (Hugging Face format) to
   ``<out>/critic``, which a run loads with ``--model.critic.name_or_path=<out>/critic``.
   Each epoch's state is kept, so a killed call resumes at the next epoch.
3. **Report**: ``<out>/report.md`` and ``report.json``: the buffer, every epoch's train and
   held-out value loss and explained variance (overall, by position, calibration, against the
   group mean), minutes, machine.

One process (world size 1): the buffer is the expensive part, and a multi-GPU user can
sample it with the vLLM engine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vapo_lightning.advantages import monte_carlo_returns
from vapo_lightning.config import SetupError
from vapo_lightning.critic_buffer import Setup, from_config, progress, sample_buffer, say
from vapo_lightning.critic_checks import check_critic
from vapo_lightning.distributed import save_pretrained
from vapo_lightning.models import add_adapters, build_critic, build_policy
from vapo_lightning.optim import adamw_with_warmup
from vapo_lightning.packing import layout_for
from vapo_lightning.updates import (
    Forwards,
    RankOps,
    compute_values,
    mini_batches,
    update_critic,
)

__all__ = ["Options", "improved", "main", "pretrain_critic", "split_by_prompt", "stopped"]


@dataclass
class Options:
    """What `vapo pretrain-critic` adds to the run's config."""

    out: str = "runs/critic_pretraining"
    prompts: int | None = None  # training prompts in the buffer (None: every one)
    samples_per_prompt: int = 2  # answers to each (the per-prompt success rate needs ≥ 2)
    held_out: float = 0.1  # share of the prompts held out to score the critic
    max_epochs: int = 20
    patience: int = 2  # epochs without a better held-out explained variance before stopping
    min_delta: float = 0.005  # what counts as better
    chunk_prompts: int = 16  # prompts sampled (and saved) at a time
    seed: int = 0
    buffer: str | None = None  # the buffer's folder (None: <out>/buffer), e.g. a committed one


def split_by_prompt(num_prompts: int, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """(training prompts, held-out prompts), disjoint, sorted; at least one of each for
    two prompts or more."""
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(max(1, round(held_out * num_prompts)), num_prompts - 1) if num_prompts > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def improved(history: list[dict[str, float]], min_delta: float) -> int:
    """The index of the best epoch by held-out explained variance, counting as better only a
    gain above `min_delta`; where the held-out returns do not vary (explained variance
    undefined, NaN, from the first row on), by held-out value loss, lower by `min_delta`."""
    undefined = math.isnan(history[0]["held_out/explained_var"])
    key = (lambda row: -row["held_out/value_loss"]) if undefined else (lambda row: row["held_out/explained_var"])
    best = 0
    for i, row in enumerate(history):
        if not math.isnan(key(row)) and (math.isnan(key(history[best])) or key(row) > key(history[best]) + min_delta):
            best = i
    return best


# --------------------------------------------------------------------------- the command


def pretrain_critic(argv: list[str], opts: Options) -> dict[str, Any]:
    """Samples (or reads) the buffer, trains the critic to convergence, writes it and the
    report; returns the report."""
    started = time.perf_counter()
    out = Path(opts.out)
    s = from_config(argv)
    try:
        return _pretrain(s, argv, opts, out, started)
    finally:
        for cb in s.rewards:
            cb.close()


def _pretrain(s: Setup, argv: list[str], opts: Options, out: Path, started: float) -> dict[str, Any]:
    module, optim = s.module, s.module.optim
    if not module.algo.uses_critic:
        raise SetupError("model.algorithm.advantage='group' has no critic to pretrain")
    # The critic's regression: the λ = γ = 1 return as the target, no value clip (it bounds
    # a step against V_old, which a fixed target does not need), one step per mini-batch.
    algo = replace(module.algo, value_clip=None, critic_updates_per_step=1)
    torch.manual_seed(opts.seed)
    module.policy = build_policy(module.policy_spec, module.tokenizer).to(s.device)
    module.critic = build_critic(module.critic_spec, module.policy, module.tokenizer).to(s.device)
    module.policy, module.critic = add_adapters(module.policy, module.critic, module.policy_spec, module.critic_spec)
    folder = Path(opts.buffer) if opts.buffer else out / "buffer"
    buffer, sample_seconds, chosen = sample_buffer(
        s, folder, opts.prompts, opts.samples_per_prompt, opts.chunk_prompts, opts.seed
    )
    module.policy = None  # the critic trains alone from here
    critic = module.critic

    _, held_prompts = split_by_prompt(len(chosen), opts.held_out, opts.seed)
    in_held = torch.isin(buffer.group_ids, torch.tensor([chosen[i] for i in held_prompts]))
    train, held = buffer.select(torch.nonzero(~in_held)[:, 0]), buffer.select(torch.nonzero(in_held)[:, 0])
    returns = {}  # (B, T) each part's λ = 1 return: the critic's target
    layouts = {}  # how each part's rows go through the critic
    for name, part in (("train", train), ("held", held)):
        returns[name] = monte_carlo_returns(part.scores, part.response_mask, algo.gamma)
        layouts[name] = layout_for(part.group_ids, algo)

    opt, sched = adamw_with_warmup([p for p in critic.parameters() if p.requires_grad], optim.critic_lr, optim)
    state_path, history = out / "state.pt", []
    if state_path.exists():  # a killed call: go on after its last whole epoch
        state = torch.load(state_path, weights_only=False)
        critic.load_state_dict(state["critic"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        history = state["history"]

    def score(epoch: int, train_loss: float, seconds: float) -> dict[str, float]:
        with s.forward_context():
            values = compute_values(critic, held, Forwards(algo.micro_batch_size, layout=layouts["held"]))
        checks = check_critic(values, returns["held"], held.scores, held.correct, held.group_ids, held.response_mask)
        return {
            "epoch": epoch,
            "train/value_loss": train_loss,
            **{f"held_out/{k}": v for k, v in checks.items()},
            "minutes": seconds / 60,
        }

    if not history:  # the critic as it starts, kept unless an epoch beats it
        history.append(score(0, float("nan"), 0.0))
        save_pretrained(critic, module.tokenizer, out / "critic", True)
    stop = stopped(history, opts)
    with progress() as bar:
        task = bar.add_task("training the critic", total=None)
        while stop is None:
            epoch, start = len(history), time.perf_counter()
            batches = mini_batches(len(train), algo.mini_batch_size, 1, layouts["train"].pack)
            if len(batches) == 1:  # (one mini-batch comes in order: shuffle it too)
                batches = [torch.randperm(len(train))]
            bar.update(task, total=len(batches), completed=0, description=f"critic epoch {epoch}")
            losses = []
            for index in batches:
                with s.forward_context():
                    fw = Forwards.of(algo, layout=layouts["train"])
                    stats = update_critic(
                        critic, opt, train, None, returns["train"], [index], algo, optim.max_grad_norm, RankOps(), fw
                    )
                sched.step()
                losses += stats["critic/vf_loss"]
                bar.advance(task)
            history.append(score(epoch, sum(losses) / len(losses), time.perf_counter() - start))
            if improved(history, opts.min_delta) == epoch:
                save_pretrained(critic, module.tokenizer, out / "critic", True)
            torch.save(
                {
                    "critic": critic.state_dict(),
                    "opt": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "history": history,
                },
                state_path.with_suffix(".tmp"),
            )
            os.replace(state_path.with_suffix(".tmp"), state_path)
            stop = stopped(history, opts)
            row = history[-1]
            say(
                f"critic epoch {epoch}: train value loss {row['train/value_loss']:.4f}, held-out value loss "
                f"{row['held_out/value_loss']:.4f}, explained variance {row['held_out/explained_var']:.3f}, "
                f"{row['minutes']:.1f} min"
            )
    best = improved(history, opts.min_delta)
    report = {
        "command": "vapo pretrain-critic " + " ".join(argv + _flags(opts)),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "machine": _machine(),
        "options": asdict(opts),
        "buffer": {
            "prompts": len(chosen),
            "responses": len(buffer),
            "training_responses": len(train),
            "held_out_responses": len(held),
            "held_out_prompts": len(held_prompts),
            "correct": float(buffer.correct.float().mean()),
            "mean_reward": float(buffer.scores.mean()),
            "mean_response_tokens": float(buffer.response_lengths.float().mean()),
            "truncated": float(buffer.truncated.float().mean()),
            "sampling_minutes": sample_seconds / 60,
        },
        "epochs": history,
        "best_epoch": best,
        "stopped": stop,
        "critic": str(out / "critic"),
        "minutes_this_call": (time.perf_counter() - started) / 60,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render(report))
    return report


def stopped(history: list[dict[str, float]], opts: Options) -> str | None:
    """Why training stops after these epochs, or None to go on."""
    epochs, best = len(history) - 1, improved(history, opts.min_delta)
    if epochs - best >= opts.patience and epochs > 0:
        return f"no better held-out explained variance for {opts.patience} epochs (best: epoch {best})"
    if epochs >= opts.max_epochs:
        return f"max_epochs={opts.max_epochs}"
    return None


def render(report: dict[str, Any]) -> str:
    b, rows = report["buffer"], report["epochs"]
    lines = [
        "# Critic pretraining to convergence",
        "",
        f"Command: `{report['command']}`  ",
        f"Date {report['date']}, code at {report['commit']}  ",
        f"Machine: {report['machine']}  ",
        f"Buffer: {b['responses']} responses to {b['prompts']} prompts ({b['held_out_prompts']} held out: "
        f"{b['held_out_responses']} responses), {100 * b['correct']:.1f} % correct, mean reward {b['mean_reward']:.3f}, "
        f"{b['mean_response_tokens']:.0f} tokens on average ({100 * b['truncated']:.1f} % at the cap); "
        f"sampled and scored in {b['sampling_minutes']:.1f} min.  ",
        f"Stopped: {report['stopped']}; the critic written ({report['critic']}) is epoch {report['best_epoch']}'s.",
        "",
        "Train value loss: the mean over the epoch's mini-batches of their per-token 0.5 (V - R)². "
        "Held-out: the responses to prompts the critic never trained on. Explained variance against the "
        "λ = γ = 1 return (the final reward at every token); by the tenth of the response the token lies in; "
        "calibration: correlation over prompts of V(s_0) with the prompt's success rate; baseline shares: the "
        "return's variance removed by the critic's values and by the group's mean reward (GRPO's baseline).",
        "",
        "| epoch | train value loss | held-out value loss | held-out explained var | first / middle / last tenth "
        "| calibration | variance removed: critic / group mean | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['epoch']} | {row['train/value_loss']:.4f} | {row['held_out/value_loss']:.4f} "
            f"| {row['held_out/explained_var']:.3f} | {row['held_out/explained_var/first_tenth']:.3f} / "
            f"{row['held_out/explained_var/middle_tenth']:.3f} / {row['held_out/explained_var/last_tenth']:.3f} "
            f"| {row['held_out/calibration']:.3f} | {row['held_out/baseline_share/critic']:.3f} / "
            f"{row['held_out/baseline_share/group_mean']:.3f} | {row['minutes']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _flags(opts: Options) -> list[str]:
    default = Options()
    return [f"--{k}={v}" for k, v in asdict(opts).items() if v != getattr(default, k)]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} threads"
        + (f", {gpu}" if gpu else "")
        + (f", torch {torch.__version__}")
    )


def parse(argv: list[str]) -> tuple[Options, list[str]]:
    """`Options` from the flags it names; the rest (-c CONFIG, --model..., --trainer...)
    is the run's config, as `vapo fit` reads it."""
    parser = argparse.ArgumentParser(
        prog="vapo pretrain-critic",
        description="Pretrain the critic to convergence on a buffer sampled once from the config's "
        "initial policy (VAPO §4.1); every other flag is the run's config, as for `vapo fit`.",
    )
    for name, value in asdict(Options()).items():
        kind = {"prompts": int, "buffer": str}.get(name, type(value))
        parser.add_argument(f"--{name}", type=kind, default=value)
    known, rest = parser.parse_known_args(argv)
    opts = Options(**vars(known))
    if opts.samples_per_prompt < 1 or not 0 < opts.held_out < 1 or opts.patience < 1:
        parser.error("--samples_per_prompt must be ≥ 1, --held_out in (0, 1), --patience ≥ 1")
    return opts, rest


def main(argv: list[str]) -> None:
    opts, rest = parse(argv)
    report = pretrain_critic(rest, opts)
    best = report["epochs"][report["best_epoch"]]
    print(
        f"critic: {report['critic']} (epoch {report['best_epoch']}, held-out explained variance "
        f"{best['held_out/explained_var']:.3f}); report: {Path(opts.out) / 'report.md'}"
    )
