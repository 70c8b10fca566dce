"""Kill a real `vapo fit` with SIGKILL, resume with `--ckpt_path last`, lose nothing."""

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def vapo_fit(root: Path, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "vapo_lightning.cli",
        "fit",
        "-c",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"--trainer.max_steps={STEPS}",
        f"--trainer.default_root_dir={root}",
        "--trainer.val_check_interval=100",
        "--trainer.enable_progress_bar=false",
        "--model.generation.max_new_tokens=16",
        "--model.val_before_train=false",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def metrics(root: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(f"{root}/lightning_logs/version_*/events.out.tfevents.*")):
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def checkpoint_step(path: Path) -> int:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["global_step"]
    except Exception:
        return -1


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = vapo_fit(tmp_path / "full")
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out.decode()[-3000:]

    victim = vapo_fit(tmp_path / "killed")
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 600
    while checkpoint_step(last) < 2 and victim.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert victim.poll() is None, "the run ended before it could be killed"
    time.sleep(0.2)  # inside rollout step 3 (generation, reward or update) or its checkpoint write
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = checkpoint_step(last)
    assert 2 <= killed_at < STEPS  # last.ckpt is whole (atomic write) and not the end

    resumed = vapo_fit(tmp_path / "killed", "--ckpt_path=last")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out.decode()[-3000:]
    assert checkpoint_step(last) == STEPS

    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "killed")
    per_step = dict.fromkeys(range(killed_at, STEPS), 0)
    for name, by_step in a.items():
        if name.startswith(("timing_s/", "perf/")) or name in ("epoch", "hp_metric"):
            continue
        for step in per_step:
            if step in by_step:
                assert b[name][step] == by_step[step], (name, step)
                per_step[step] += 1
    assert all(count > 30 for count in per_step.values()), per_step  # every resumed step, all metrics


SAVE_EVERY_100 = """
trainer:
  callbacks:
    - class_path: vapo_lightning.rewards.math.MathReward
      init_args: {num_workers: 1}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, every_n_train_steps: 100, save_top_k: 0}
"""


@pytest.mark.slow
def test_sigterm_ends_the_step_in_progress_and_keeps_it_in_last_ckpt(tmp_path):
    """What a scheduler sends to stop a job: the run finishes its rollout step, writes
    `last.ckpt` for it though the config saves every 100 steps, and exits 143 (not 0); the
    resumed run starts after that step."""
    layer = tmp_path / "every100.yaml"
    layer.write_text(SAVE_EVERY_100)
    root = tmp_path / "run"
    victim = vapo_fit(root, "-c", str(layer), "--trainer.max_steps=50")
    lines = []
    for raw in victim.stdout:  # stdout is a pipe: one StepLog line per rollout step
        lines.append(raw.decode())
        if "step 2/50" in lines[-1]:
            victim.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + victim.communicate(timeout=600)[0].decode()
    assert victim.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped_at = max(int(m) for m in re.findall(r"step (\d+)/50", out))
    assert 2 <= stopped_at < 50
    last = root / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == stopped_at, out[-3000:]

    resumed = vapo_fit(root, "-c", str(layer), f"--trainer.max_steps={stopped_at + 1}", "--ckpt_path=last")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out.decode()[-3000:]
    assert f"step {stopped_at + 1}/{stopped_at + 1}" in out.decode()
