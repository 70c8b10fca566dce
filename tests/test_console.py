"""What a run prints: the rollout step out of max_steps and the metrics that matter, none of
Lightning's messages that do not apply, and an entropy alert only when it means something."""

import pytest

from tests.test_cli_errors import ROOT, vapo
from vapo_lightning.callbacks import EntropyTracker


def test_a_run_prints_rollout_steps_and_no_lightning_noise(tmp_path):
    done = vapo("fit", "-c", str(ROOT / "configs/tiny_cpu.yaml"), "--trainer.max_steps=2",
                f"--trainer.default_root_dir={tmp_path}")  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "step: 2/2" in out and "reward" in out and "rollout/accuracy" in out
    for noise in ("args parameter", "Using ModelCheckpoint with manual optimization", "litlogger",
                  "in eval mode at the start", "Epoch 0/", "v_num", "LeafSpec"):  # fmt: skip
        assert noise not in out, noise


def test_entropy_collapse_is_judged_against_the_runs_early_entropy(recwarn):
    tracker = EntropyTracker(reference_steps=3)
    for step, mean in enumerate([0.06, 0.05, 0.04, 0.017, 0.012], 1):  # short, certain answers
        tracker._warn(mean, step)
    assert len(recwarn) == 0
    with pytest.warns(
        UserWarning, match=r"0\.0040 nats at rollout step 6, below 0\.1 × this run's early"
    ):
        tracker._warn(0.004, 6)
    resumed = EntropyTracker(reference_steps=3)
    resumed.load_state_dict(tracker.state_dict())
    resumed._warn(0.001, 7)  # warned once per run, also across a resume
    assert len(recwarn) == 0
