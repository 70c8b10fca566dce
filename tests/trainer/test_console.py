"""What a run prints: the rollout step out of max_steps and the metrics that matter, none of
Lightning's messages that do not apply (the entropy alert: tests/trainer/test_callbacks.py)."""

import json
import re

import pytest

from tests.helpers import ROOT, vapo


@pytest.mark.slow
def test_a_run_prints_rollout_steps_and_no_lightning_noise(tmp_path):
    done = vapo(
        "fit",
        "-c",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "step: 2/2" in out and "reward" in out and "rollout/accuracy" in out
    for noise in (
        "args parameter",
        "Using ModelCheckpoint with manual optimization",
        "litlogger",
        "in eval mode at the start",
        "Epoch 0/",
        "v_num",
        "LeafSpec",
    ):
        assert noise not in out, noise


@pytest.mark.slow
def test_a_resumed_run_counts_its_steps_and_logs_on_in_its_folder(tmp_path):
    """After `--ckpt_path last` the bar reads ``Rollouts 3/3`` (Lightning's read ``3/0``: its
    total counted the steps left, its counter this epoch's batches) and shows seconds per step;
    the logs stay in one TensorBoard folder, and a training sample of each step is kept."""
    common = [
        "-c",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.val_check_interval=2",
        "--model.val_before_train=false",
    ]
    first = vapo("fit", *common, "--trainer.max_steps=2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    again = vapo("fit", *common, "--trainer.max_steps=3", "--ckpt_path=last")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert re.findall(r"Rollouts\s+\S+\s+(\d+/\d+)", out)[-1] == "3/3" and "s/step" in out
    assert [d.name for d in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "train_samples.jsonl").open()]
    assert steps == [1] * 4 + [2] * 4 + [3] * 4


@pytest.mark.slow
def test_a_run_without_validation_data_in_bf16_prints_no_false_alarms(tmp_path):
    done = vapo(
        "fit",
        "-c",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "--trainer.max_steps=1",
        "--data.val=null",
        "--trainer.precision=bf16-mixed",
        f"--trainer.default_root_dir={tmp_path}",
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for noise in ("Total length of `DataLoader` across ranks is zero", "not supported by the model summary"):
        assert noise not in out, noise


def test_validation_metrics_give_no_sync_dist_hint_under_a_process_group(tok, tmp_path):
    """vLLM makes a process group; Lightning then asks, for each validation metric, to log it
    with sync_dist=True. They are reduced over ranks already: the hint is not shown."""
    import warnings

    import torch.distributed as dist

    from tests.helpers import tiny_data, tiny_module, tiny_trainer
    from vapo_lightning.console import quiet_lightning

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_lightning()  # (its filters go with the context)
            tiny_trainer(tmp_path).validate(tiny_module(tok), datamodule=tiny_data(tmp_path))
    finally:
        dist.destroy_process_group()
    assert not [w for w in seen if "sync_dist" in str(w.message)]


def test_vllm_warnings_about_what_the_engine_does_by_design_are_dropped():
    """No tokenizer in the engine (chat-template warm-up, EOS id) and the rotary cache a sync
    does not send: dropped. The same warning for a layer with weights is kept: it would mean
    a sync that missed weights (greedy equality after a sync: tests/engines/test_vllm.py)."""
    import logging

    from vapo_lightning.console import quiet_vllm

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    quiet_vllm()
    quiet_vllm()  # every engine made calls it: its filters are added once
    renderer = logging.getLogger("vllm.renderers.base")
    assert len(renderer.filters) == 1
    loader = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    seen = Seen()
    for logger in (renderer, loader):
        logger.addHandler(seen)
    try:
        renderer.warning("Chat template warmup failed")
        renderer.warning("Using None for EOS token id because tokenizer is not initialized")
        renderer.warning("Unknown chat template")
        loader.warning("%s: Failed to load weights", "RotaryEmbedding")
        loader.warning("%s: Failed to load weights", "QKVParallelLinear")
    finally:
        for logger in (renderer, loader):
            logger.removeHandler(seen)
    assert seen.messages == ["Unknown chat template", "QKVParallelLinear: Failed to load weights"]
