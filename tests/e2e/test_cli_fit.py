"""`vapo fit -c configs/tiny_cpu.yaml` end to end through the real CLI, with a plug-in reward."""

import glob

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import CONFIGS
from vapo_lightning.cli import main


@pytest.mark.slow
def test_tiny_cpu_fit_with_every_callback_and_a_plugin(tmp_path):
    main(
        [
            "fit",
            "-c",
            str(CONFIGS / "tiny_cpu.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=3",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=examples.rewards.short_answer.ShortAnswerBonus",
            "--trainer.callbacks.weight=0.1",
            f"--model.hf_export_dir={tmp_path / 'hf'}",
        ]
    )
    (event_file,) = glob.glob(f"{tmp_path}/lightning_logs/version_0/events.out.tfevents.*")
    acc = EventAccumulator(event_file, size_guidance={"histograms": 0})
    acc.Reload()
    scalars = {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert scalars["warmup/active"] == [1.0, 1.0, 0.0]  # ValuePretraining(steps=2)
    assert "actor/pg_loss" in scalars and len(scalars["actor/pg_loss"]) == 1  # actor only after warm-up
    # A random policy: every reward equal, so the explained variance is undefined, not logged
    # (it was -7e5 from dividing by a zero variance).
    assert len(set(scalars["reward"])) == 1 and "critic/vf_explained_var" not in scalars
    for name in [
        "critic/vf_loss",
        "rollout/entropy",
        "reward/errors",
        "val/accuracy",
    ]:
        assert name in scalars, name
    assert scalars["reward/errors"] == [0.0, 0.0, 0.0]
    assert "rollout/entropy_tokens" in acc.Tags()["histograms"]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "hf" / "policy" / "model.safetensors").exists()


@pytest.mark.slow
def test_validate_scores_a_checkpoint_beside_the_run_it_came_from(tmp_path, recwarn):
    """With the training config: it logs under `validate/`, writes no checkpoint and says
    nothing about the checkpoint folder; the run's resumed fit logs on in its own version_0."""
    args = [
        "-c",
        str(CONFIGS / "tiny_cpu.yaml"),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--model.val_before_train=false",
    ]
    main(["fit", *args, "--trainer.max_steps=1"])
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    saved = ckpt.stat().st_mtime_ns
    recwarn.clear()
    main(["validate", *args, f"--ckpt_path={ckpt}"])
    assert not [w for w in recwarn if "dirpath" in str(w.message)], [str(w.message) for w in recwarn]
    assert ckpt.stat().st_mtime_ns == saved
    events = sorted(glob.glob(f"{tmp_path}/validate/version_0/events.out.tfevents.*"))
    acc = EventAccumulator(events[-1])
    acc.Reload()
    (value,) = [e.value for e in acc.Scalars("val/accuracy")]
    assert 0.0 <= value <= 1.0
    main(["fit", *args, "--trainer.max_steps=2", "--ckpt_path=last"])
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]


@pytest.mark.slow
def test_validate_needs_no_training_file_and_fit_says_it_does(tmp_path):
    """`vapo validate` reads only the validation prompts: no data.train to give; a fit without
    one stops in one line naming the field."""
    args = [
        "-c",
        str(CONFIGS / "tiny_cpu.yaml"),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--data.train=null",
    ]
    main(["validate", *args])
    (event,) = glob.glob(f"{tmp_path}/validate/version_0/events.out.tfevents.*")
    acc = EventAccumulator(event)
    acc.Reload()
    (value,) = [e.value for e in acc.Scalars("val/accuracy")]
    assert 0.0 <= value <= 1.0
    with pytest.raises(SystemExit) as stop:
        main(["fit", *args])
    assert str(stop.value.code).startswith("vapo: error: data.train: training needs prompts")


@pytest.mark.slow
def test_a_fit_writing_to_a_file_logs_one_line_per_step(tmp_path):
    """stdout to a file (a run in the background): a line per rollout step with its time,
    reward, accuracy, length and phases, where a progress bar shows nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "out.log"
    with log.open("w") as out:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "vapo_lightning.cli",
                "fit",
                "-c",
                "configs/tiny_cpu.yaml",
                "--trainer.max_steps=3",
                f"--trainer.default_root_dir={tmp_path}",
                "--model.val_before_train=false",
            ],
            cwd=root,
            stdout=out,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=300,
        )
    assert done.returncode == 0
    lines = [line for line in log.read_text().splitlines() if "] step " in line]
    assert [line.split("] step ")[1].split()[0] for line in lines] == ["1/3", "2/3", "3/3"]
    assert all(" s  reward " in line and "accuracy" in line and "length" in line and "gen " in line for line in lines)
    assert "value pretraining" in lines[0] and "value pretraining" not in lines[2]


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["last", "file"])
def test_a_resumed_fit_takes_the_configs_model_keys_and_says_which_changed(tmp_path, recwarn, ckpt):
    """Lightning put a checkpoint file's hyper-parameters over the command line (not for
    `last`): the config wins either way, and each changed key is named; a learning rate is
    said to have no effect (the optimiser state comes from the checkpoint)."""
    import yaml

    args = [
        "-c",
        str(CONFIGS / "tiny_cpu.yaml"),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--model.val_before_train=false",
        "--model.generation.max_new_tokens=8",
    ]
    main(["fit", *args, "--trainer.max_steps=1"])
    recwarn.clear()
    path = "last" if ckpt == "last" else str(tmp_path / "checkpoints" / "last.ckpt")
    main(
        [
            "fit",
            *args,
            "--trainer.max_steps=2",
            f"--ckpt_path={path}",
            "--model.algorithm.clip_high=0.4",
            "--model.optim.actor_lr=0.4",
        ]
    )
    said = sorted(str(w.message) for w in recwarn if str(w.message).startswith("model."))
    assert said == [
        "model.algorithm.clip_high: 0.4 from the config, where the checkpoint's run had 0.28",
        "model.optim.actor_lr: 0.4 from the config, where the checkpoint's run had 0.001; no effect on "
        "a resumed fit: the optimisers and their schedules are restored from the checkpoint",
    ]
    used = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert used["model"]["algorithm"]["clip_high"] == 0.4
