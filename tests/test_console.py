"""What a run prints: the rollout step out of max_steps and the metrics that matter, none of
Lightning's messages that do not apply (the entropy alert: tests/test_callbacks.py)."""

import json
import re

from tests.test_cli_errors import ROOT, vapo


def test_a_run_prints_rollout_steps_and_no_lightning_noise(tmp_path):
    done = vapo("fit", "-c", str(ROOT / "configs/tiny_cpu.yaml"), "--trainer.max_steps=2",
                f"--trainer.default_root_dir={tmp_path}")  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "step: 2/2" in out and "reward" in out and "rollout/accuracy" in out
    for noise in ("args parameter", "Using ModelCheckpoint with manual optimization", "litlogger",
                  "in eval mode at the start", "Epoch 0/", "v_num", "LeafSpec"):  # fmt: skip
        assert noise not in out, noise


def test_a_resumed_run_counts_its_steps_and_logs_on_in_its_folder(tmp_path):
    """After `--ckpt_path last` the bar reads ``Rollouts 3/3`` (Lightning's read ``3/0``: its
    total counted the steps left, its counter this epoch's batches) and shows seconds per step;
    the logs stay in one TensorBoard folder, and a training sample of each step is kept."""
    common = ["-c", str(ROOT / "configs/tiny_cpu.yaml"), f"--trainer.default_root_dir={tmp_path}",
              "--trainer.val_check_interval=2", "--model.val_before_train=false"]  # fmt: skip
    first = vapo("fit", *common, "--trainer.max_steps=2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    again = vapo("fit", *common, "--trainer.max_steps=3", "--ckpt_path=last")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert re.findall(r"Rollouts\s+\S+\s+(\d+/\d+)", out)[-1] == "3/3" and "s/step" in out
    assert [d.name for d in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "train_samples.jsonl").open()]
    assert steps == [1] * 4 + [2] * 4 + [3] * 4


def test_a_run_without_validation_data_in_bf16_prints_no_false_alarms(tmp_path):
    done = vapo("fit", "-c", str(ROOT / "configs/tiny_cpu.yaml"), "--trainer.max_steps=1", "--data.val=null",
                "--trainer.precision=bf16-mixed", f"--trainer.default_root_dir={tmp_path}")  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for noise in ("Total length of `DataLoader` across ranks is zero", "not supported by the model summary"):
        assert noise not in out, noise
