"""Checkpoint files: `last.ckpt` is replaced only by a complete file, even on a full disk;
an unreadable checkpoint is named in the error."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import CONFIGS
from vapo_lightning.checkpoint import AtomicCheckpointIO, CheckpointError
from vapo_lightning.cli import VAPOCLI
from vapo_lightning.data import PromptDataModule
from vapo_lightning.module import VAPOModule

# Runs in a mount namespace of its own, on a 1 MiB tmpfs, with TMPDIR on another file system.
FULL_DISK = r"""
import os, sys, torch
from pathlib import Path
from vapo_lightning.checkpoint import AtomicCheckpointIO, CheckpointError
disk = Path(sys.argv[1])
last = disk / "checkpoints" / "last.ckpt"
io = AtomicCheckpointIO()
io.save_checkpoint({"step": 1, "w": torch.ones(10_000)}, last)  # ~40 kB
fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk, then free ~100 kB
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    os.close(fd)
os.truncate(disk / "filler", max(0, os.path.getsize(disk / "filler") - 100_000))
try:
    io.save_checkpoint({"step": 2, "w": torch.ones(100_000)}, last)  # ~400 kB: does not fit
    print("saved")
except CheckpointError as err:
    print("refused:", err)
print("step", torch.load(last, weights_only=True)["step"])
print("files", sorted(p.name for p in last.parent.iterdir()))
"""


@pytest.mark.slow
def test_a_full_disk_keeps_the_previous_last_ckpt(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = (
        f'mount -t tmpfs -o size=1m tmpfs "{disk}" && exec env TMPDIR="{tmp_path}" "{sys.executable}" -c "$0" "{disk}"'
    )
    runner = [] if Path("/proc/self").owner() == "root" else ["-r"]
    done = subprocess.run(
        ["unshare", *runner, "-m", "sh", "-c", cmd, FULL_DISK],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    if "mount" in done.stderr and done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "refused: could not write checkpoint" in out and "the previous one is kept" in out
    assert "step 1" in out and "files ['last.ckpt']" in out  # no partial temporary file left


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage that is not a checkpoint", None],
    ids=["empty", "garbage", "truncated"],
)
def test_an_unreadable_checkpoint_is_named(tmp_path, content):
    path = tmp_path / "last.ckpt"
    if content is None:
        AtomicCheckpointIO().save_checkpoint({"w": torch.ones(1000)}, path)
        content = path.read_bytes()[:2000]
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} .* is not a readable checkpoint"):
        AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


def test_the_cli_writes_checkpoints_atomically(tmp_path):
    cli = VAPOCLI(
        VAPOModule,
        PromptDataModule,
        run=False,
        auto_configure_optimizers=False,
        args=["-c", str(CONFIGS / "tiny_cpu.yaml"), f"--trainer.default_root_dir={tmp_path}"],
    )
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_a_resumed_run_logs_on_in_its_tensorboard_folder(tmp_path, monkeypatch):
    """`--ckpt_path last` continues the killed run's `version_0` (not a new `version_1`), and
    the steps the killed run logged after its checkpoint keep the resumed run's values only."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vapo_lightning.checkpoint import continue_logging

    # The killed run started a minute earlier. TensorBoard reads a folder's event files in name
    # order, and a name is the file's start second, then host, pid and a per-process counter
    # that sorts ".10" before ".9": two files of one process in the same second may swap.
    now = time.time
    with monkeypatch.context() as earlier:
        earlier.setattr(time, "time", lambda: now() - 60)
        first = TensorBoardLogger(tmp_path)
        for step in range(5):  # a run killed after step 4, its last checkpoint at global step 3
            first.log_metrics({"reward": float(step)}, step=step)
        first.finalize("killed")
    (tmp_path / "checkpoints").mkdir()
    torch.save({"global_step": 3}, tmp_path / "checkpoints" / "last.ckpt")
    trainer = L.Trainer(default_root_dir=tmp_path, logger=TensorBoardLogger(tmp_path))
    continue_logging(trainer, "last")
    for step in (3, 4, 5):  # the resumed run logs from its checkpoint on
        trainer.logger.log_metrics({"reward": 10.0 + step}, step=step)
    trainer.logger.finalize("success")
    assert [d.name for d in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    acc = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
        (5, 15.0),
    ]
    fresh = L.Trainer(default_root_dir=tmp_path / "other", logger=TensorBoardLogger(tmp_path / "other"))
    continue_logging(fresh, None)  # not resuming: a new version as always
    assert fresh.logger.version == 0 and "purge_step" not in fresh.logger._kwargs


def test_sigterm_after_the_steps_save_hook_still_keeps_the_step(tok, tmp_path):
    """A scheduler's SIGTERM that lands after `CheckpointOnSigterm`'s hook of a step, while
    Lightning ends that step, stops the run there all the same: the step is in last.ckpt
    (the `ModelCheckpoint` saves only every 100 steps)."""
    import os
    import signal

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from tests.helpers import tiny_data, tiny_module, tiny_trainer
    from vapo_lightning.checkpoint import CheckpointOnSigterm

    class LateSigterm(L.Callback):  # after CheckpointOnSigterm's hook, at the end of step 2
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    keeper = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=100, save_top_k=0)
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[keeper, CheckpointOnSigterm(), LateSigterm()])
    with pytest.raises(SIGTERMException):
        trainer.fit(tiny_module(tok), datamodule=tiny_data(tmp_path))
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 2
