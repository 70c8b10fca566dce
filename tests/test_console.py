"""What a run prints: the rollout step out of max_steps and the metrics that matter, none of
Lightning's messages that do not apply (the entropy alert: tests/test_callbacks.py)."""

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
