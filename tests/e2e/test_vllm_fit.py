"""Training with the vLLM engine end to end, through the real CLI: one process, a resumed run,
and two processes under ddp and fsdp (gloo on the CPU, vLLM's external launcher).

The policy is the quickstart's SFT model (peaked distributions: an engine holding stale
weights shows |p_engine - p_trainer| of 0.1 and more; in sync, fp32, under 1e-3), trained
at tiny_cpu.yaml's actor learning rate of 1e-3, which moves it far in one step.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import SHORT, skip_without_vllm, vapo_fit
from vapo_lightning.cli import main

skip_without_vllm()

ROOT = Path(__file__).resolve().parents[2]
SFT_POLICY = [  # the quickstart's SFT model instead of tiny_cpu's random one
    "--model.policy.config=null",
    "--model.policy.name_or_path=vapo_lightning/assets/quickstart_sft",
    "--model.policy.tokenizer=null",
]
VLLM = [
    "--model.generation.engine=vllm",
    "--model.generation.vllm.gpu_memory_utilization=0.05",
]


def scalars(root: Path, version: int, run: int | None = None) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the one event file of `version`, or of its `run`-th (a resumed run logs
    on in the same folder, in a file of its own)."""
    files = sorted(glob.glob(f"{root}/lightning_logs/version_{version}/events.out.tfevents.*"))
    (event_file,) = files if run is None else [files[run]]
    acc = EventAccumulator(event_file)
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def check_engine_in_sync(s: dict[str, list[tuple[int, float]]], actor_steps: int) -> None:
    diffs = [v for _, v in s["training/rollout_probs_diff_max"]]
    assert diffs and max(diffs) < 1e-3, diffs
    syncs = [v for _, v in s["timing_s/weight_sync"]]
    assert sum(v > 1e-3 for v in syncs) >= actor_steps - 1, syncs  # one load per new policy


@pytest.mark.slow
def test_fit_then_resume_with_the_vllm_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = [
        "fit",
        "-c",
        "configs/tiny_cpu.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        *SHORT,
        *SFT_POLICY,
        *VLLM,
        "--model.val_generation.engine=vllm",
        "--model.algorithm.rollout_is=tis",
    ]
    main([*args, "--trainer.max_steps=4"])  # 2 steps of value pretraining, then 2 updates
    first = scalars(tmp_path, 0)
    check_engine_in_sync(first, actor_steps=2)
    assert [v for _, v in first["warmup/active"]] == [1.0, 1.0, 0.0, 0.0]
    assert "val/accuracy" in first and "actor/pg_loss" in first

    # Resumed: the engine starts from the checkpoint's weights (not the SFT start it was
    # configured with), so the first resumed rollout is already in sync.
    main([*args, "--trainer.max_steps=6", "--ckpt_path=last"])
    assert [d.name for d in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    resumed = scalars(tmp_path, 0, run=-1)
    steps = [s for s, _ in resumed["training/rollout_probs_diff_max"]]
    assert steps[0] >= 4
    check_engine_in_sync(resumed, actor_steps=2)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "tp"), [("ddp", 1), ("fsdp", 1), ("fsdp", 2)])
def test_two_processes_with_the_vllm_engine(tmp_path, strategy, tp):
    """One engine per rank, or (tp=2) one engine over both ranks: each rank then asks it for
    the prompts of both and keeps its own responses."""
    vapo_fit(
        tmp_path,
        strategy,
        *SFT_POLICY,
        *VLLM,
        "--trainer.max_steps=4",
        f"--model.generation.vllm.tensor_parallel_size={tp}",
    )
    s = scalars(tmp_path, 0)
    check_engine_in_sync(s, actor_steps=2)


@pytest.mark.slow
def test_a_lora_run_keeps_the_vllm_engine_in_sync(tmp_path, monkeypatch):
    """LoRA on policy and critic: every sync sends the merged weights (the engine-level test,
    tests/engines/test_vllm.py, shows a sync without the merge is caught)."""
    pytest.importorskip("peft")
    monkeypatch.chdir(ROOT)
    main(
        [
            "fit",
            "-c",
            "configs/tiny_cpu.yaml",
            f"--trainer.default_root_dir={tmp_path}",
            *SHORT,
            *SFT_POLICY,
            *VLLM,
            '--model.policy.lora={"r": 8, "alpha": 16}',
            "--model.optim.actor_lr=1e-2",
            "--trainer.max_steps=4",
        ]
    )
    s = scalars(tmp_path, 0)
    check_engine_in_sync(s, actor_steps=2)
