"""The answers `vapo pretrain-critic` regresses the critic on: n answers to each of many
training prompts, sampled once from the run's initial policy with its engine, generation and
rewards, in chunk files. A second call reuses them, a killed call goes on after the last whole
chunk, and each chunk draws from its own seed, so the buffer is the same however often it
was interrupted. `meta.json` records what sampled them; a buffer sampled otherwise is
refused, never overwritten.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from vapo_lightning.config import SetupError
from vapo_lightning.engines import make_engine
from vapo_lightning.rewards.base import RewardCallback, score_rollout
from vapo_lightning.rollout import Rollout, cat_rollouts

__all__ = ["BUFFER_FIELDS", "Buffer", "Setup", "from_config", "progress", "sample_buffer", "say"]

SAMPLING = (
    "engine",
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "max_turns",
    "max_observation_tokens",
)  # the generation settings the buffer depends on
BUFFER_FIELDS = ("input_ids", "attention_mask", "response_mask", "group_ids", "truncated", "scores", "correct")


@dataclass
class Setup:
    """What the run's config gives the pretraining (`from_config`)."""

    module: Any  # VAPOModule, models not built
    rows: list[dict]
    rewards: list[RewardCallback]
    precision: str  # the trainer's ("bf16-mixed": the vLLM engine samples in bf16)
    forward_context: Callable[[], AbstractContextManager]  # its autocast, for every forward
    device: torch.device
    settings: dict[str, Any]  # what decides the buffer's content (its fingerprint)


def from_config(args: list[str]) -> Setup:
    """The run's module, training prompts and reward callbacks from ``vapo fit``'s own config
    and flags (the same one-line errors), without starting a run."""
    from vapo_lightning.cli import run_cli

    argv, sys.argv = sys.argv, [sys.argv[0], *args]  # (Lightning warns when given args and sys.argv)
    try:
        cli = run_cli(None, run=False)
    finally:
        sys.argv = argv
    module, dm, trainer = cli.model, cli.datamodule, cli.trainer
    rows = dm.load_rows("train", module.tokenizer)
    rewards = [cb for cb in trainer.callbacks if isinstance(cb, RewardCallback)]
    if not rewards:
        raise SetupError("trainer.callbacks: no reward callback to score the buffer with")
    if trainer.world_size > 1:
        raise SetupError("vapo pretrain-critic runs in one process: leave trainer.devices / num_nodes at 1")
    spec, gen = module.policy_spec, module.gen
    settings = {  # what decides the answers and their scores, nothing else
        "policy": {"name_or_path": spec.name_or_path, "config": spec.config, "tokenizer": spec.tokenizer},
        "generation": {k: getattr(gen, k) for k in SAMPLING},
        "data.train": str(dm.hparams.train),
        "prompts": [hashlib.sha256(json.dumps(r["prompt_ids"]).encode()).hexdigest()[:16] for r in rows],
        "rewards": [f"{type(cb).__module__}.{type(cb).__qualname__}(weight={cb.weight})" for cb in rewards],
    }
    for cb in rewards:  # (a sandbox pool, worker processes: closed by `close`)
        cb.setup(trainer, module, "fit")
    forward_context = trainer.precision_plugin.forward_context  # (bf16-mixed: autocast)
    return Setup(module, rows, rewards, str(trainer.precision), forward_context, trainer.strategy.root_device, settings)


class Buffer:
    """Answers to the chosen prompts, one chunk file each `chunk_prompts` prompts, in `root`."""

    def __init__(self, root: Path, meta: dict[str, Any]) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "meta.json"
        if path.exists():
            found = json.loads(path.read_text())
            if found["fingerprint"] != meta["fingerprint"]:
                changed = sorted(k for k in meta["settings"] if found["settings"].get(k) != meta["settings"][k])
                raise SetupError(
                    f"{self.root}: a buffer sampled with other settings ({', '.join(changed)} differ); "
                    "give another --out, or delete that folder to sample anew"
                )
        else:
            path.with_suffix(".tmp").write_text(json.dumps(meta, indent=1))
            os.replace(path.with_suffix(".tmp"), path)

    def chunk_path(self, i: int) -> Path:
        return self.root / f"chunk_{i:05d}.pt"

    def save(self, i: int, r: Rollout, prompt_index: list[int], seconds: float) -> None:
        data = {k: getattr(r, k).cpu() for k in BUFFER_FIELDS}
        data["input_ids"] = data["input_ids"].int()  # (compact on disk: a few MB for thousands)
        data["attention_mask"] = data["attention_mask"].bool()
        data["group_ids"] = torch.tensor(prompt_index)[r.group_ids.cpu()]  # the prompt's index in the data
        data["seconds"] = seconds
        path = self.chunk_path(i)
        torch.save(data, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a killed save leaves no half chunk

    def load(self, chunks: int) -> tuple[Rollout, float]:
        """Every chunk as one rollout (group ids: the prompts' indices), and the seconds their
        sampling and scoring took."""
        parts, seconds = [], 0.0
        for i in range(chunks):
            data = torch.load(self.chunk_path(i), weights_only=True)
            seconds += float(data.pop("seconds"))
            data["input_ids"], data["attention_mask"] = data["input_ids"].long(), data["attention_mask"].long()
            parts.append(
                Rollout(
                    **{k: data[k] for k in BUFFER_FIELDS if k not in ("scores", "correct")},
                    scores=data["scores"],
                    correct=data["correct"],
                )
            )
        r = cat_rollouts(parts)
        r.group_ids = torch.cat([p.group_ids for p in parts])  # (cat_rollouts renumbers groups)
        return r, seconds


def progress() -> Progress:
    """A rich bar on a terminal; written to a file or a pipe (a run in the background), one
    plain line per chunk and per epoch instead (`say`)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
    )


def say(line: str) -> None:
    """A progress line where no bar shows (stderr not a terminal)."""
    if not sys.stderr.isatty():
        print(f"[{datetime.datetime.now():%H:%M:%S}] {line}", file=sys.stderr, flush=True)


def sample_buffer(
    s: Setup, folder: Path, prompts: int | None, samples_per_prompt: int, chunk_prompts: int, seed: int
) -> tuple[Rollout, float, list[int]]:
    """The buffer in `folder` (sampled, or read where it already is): `samples_per_prompt`
    answers to `prompts` training prompts (None: all) drawn with `seed`, as one rollout; the
    seconds its sampling took; the prompts' indices. The policy is `s.module.policy`."""
    chosen = torch.randperm(len(s.rows), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = sorted(chosen[:prompts] if prompts else chosen)
    gen = replace(s.module.gen, n=samples_per_prompt)
    settings = {
        **s.settings,
        "chosen": chosen,
        "samples_per_prompt": samples_per_prompt,
        "seed": seed,
        "chunk_prompts": chunk_prompts,
    }
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    buffer = Buffer(folder, {"fingerprint": fingerprint, "settings": settings})
    chunks = [chosen[i : i + chunk_prompts] for i in range(0, len(chosen), chunk_prompts)]
    todo = [i for i in range(len(chunks)) if not buffer.chunk_path(i).exists()]
    if todo:
        longest = max(len(s.rows[i]["prompt_ids"]) for i in chosen) + gen.max_new_tokens
        engine = make_engine(
            gen,
            s.module.policy,
            s.module.tokenizer,
            s.module.tools,
            max_model_len=longest,
            precision=s.precision,
            local_rank=0,
        )
        try:
            with progress() as bar:
                task = bar.add_task("sampling the buffer", total=len(chunks), completed=len(chunks) - len(todo))
                for i in todo:
                    start = time.perf_counter()
                    with torch.random.fork_rng(devices=[s.device] if s.device.type == "cuda" else []):
                        torch.manual_seed(seed * 1_000_003 + i)
                        with s.forward_context(), torch.no_grad():
                            engine.sync()
                            r = engine.sample([s.rows[j] for j in chunks[i]], gen, reproducible=True)
                    score_rollout(r, s.rewards)
                    buffer.save(i, r, chunks[i], time.perf_counter() - start)
                    bar.advance(task)
                    say(
                        f"buffer chunk {i + 1}/{len(chunks)}: {len(r)} responses, {time.perf_counter() - start:.0f} s, "
                        f"{100 * float(r.correct.float().mean()):.0f} % correct"
                    )
        finally:
            engine.close()
    r, seconds = buffer.load(len(chunks))
    return r, seconds, chosen
