"""Checkpoint files: written atomically beside their target, read with the file's name in errors.

Lightning's default writer stages a checkpoint in ``$TMPDIR`` and then moves it; when the
checkpoints live on another file system the move is a copy, and a full disk leaves a truncated
``last.ckpt`` behind. `AtomicCheckpointIO` writes a temporary file in the target's own folder,
syncs it and renames it over the target, so a failed write leaves the previous checkpoint
as it was. The CLI installs it unless the run brings its own `CheckpointIO`.

A resumed run logs on in its TensorBoard folder (`continue_logging`). SIGTERM, what a scheduler
sends to stop or preempt a job, ends the run after the rollout step in progress, with that
step's checkpoint written (`CheckpointOnSigterm`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "CheckpointOnSigterm",
    "checkpoint_seconds",
    "continue_logging",
    "rank_rng_states",
    "set_rng_state",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file."""


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` with a same-folder temporary file and a rename (local paths);
    remote URLs are left to Lightning's fsspec writer."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0  # spent writing since `take_seconds`

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        start = time.perf_counter()
        try:
            self._write(checkpoint, path, storage_options)
        finally:
            self.seconds += time.perf_counter() - start

    def _write(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(str(path).removeprefix("file://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if not isinstance(err, Exception):  # Ctrl-C: nothing to explain
                raise
            why = f"{type(err).__name__}: {str(err)[:200]}"  # torch reports ENOSPC as RuntimeError
            kept = "the previous one is kept" if path.exists() else "none was written"
            raise CheckpointError(f"could not write checkpoint {path} ({why}); {kept}") from err
        with contextlib.suppress(OSError):  # make the rename itself durable
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if _is_local(path) and not Path(str(path)).exists():
            raise CheckpointError(f"checkpoint {path} does not exist")
        try:
            return super().load_checkpoint(path, *args, **kwargs)
        except (
            RuntimeError,
            EOFError,
            OSError,
            ValueError,
            KeyError,
            pickle.UnpicklingError,
        ) as err:
            if isinstance(err, CheckpointError):
                raise
            size = os.path.getsize(path) if _is_local(path) else "?"
            raise CheckpointError(
                f"checkpoint {path} ({size} bytes) is not a readable checkpoint: it is empty, "
                f"truncated or not a torch file ({type(err).__name__}: {str(err)[:200]})"
            ) from err


def rng_state() -> dict[str, Any]:
    """This process's random streams (Python, torch, CUDA)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rank_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's random streams, in rank order (collective with several ranks)."""
    if world_size == 1:
        return [rng_state()]
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(states, rng_state())
    return states


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def continue_logging(trainer: L.Trainer, ckpt_path: str | None) -> None:
    """A run resumed from `ckpt_path` logs into the TensorBoard folder its latest run wrote
    (``version_N``), not a new ``version_N+1`` that splits one run's curves in two. What the
    interrupted run logged after its checkpoint is purged (SummaryWriter's ``purge_step``):
    the resumed run logs those steps again, and each step keeps one value. A logger given a
    version, or a checkpoint elsewhere than a file, is left alone."""
    logger = trainer.logger
    if ckpt_path is None or not isinstance(logger, TensorBoardLogger) or logger._version is not None:
        return
    if ckpt_path == "last":  # the CLI's checkpoint folder (`VAPOCLI.before_fit`)
        ckpt_path = os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
    versions = [d.name[len("version_") :] for d in Path(logger.root_dir).glob("version_*")]
    versions = sorted(int(v) for v in versions if v.isdigit())
    if not Path(ckpt_path).is_file() or not versions:
        return
    step = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)["global_step"]
    logger._version = versions[-1]
    logger._kwargs["purge_step"] = int(step)


def checkpoint_seconds(trainer: L.Trainer) -> float | None:
    """Seconds spent writing checkpoints since the last call (`AtomicCheckpointIO`); None
    where another writer saves (a sharded ``fsdp`` checkpoint, a run's own `CheckpointIO`)."""
    io = trainer.strategy.checkpoint_io
    return io.take_seconds() if isinstance(io, AtomicCheckpointIO) else None


class CheckpointOnSigterm(L.Callback):
    """Writes `last.ckpt` at the end of the rollout step during which the run got SIGTERM.

    Lightning lets that step finish (minutes on a CPU) and then stops the run; without this,
    everything since the `ModelCheckpoint`'s last save (every 10 steps in a real-model config)
    would be lost to a scheduler's stop or preemption. The save is the `ModelCheckpoint`'s
    `last.ckpt` (one with `save_last`), skipped when that callback saves this step anyway. The
    decision is rank 0's, as Lightning's own stop is (a sharded save is collective).
    """

    _saved_step: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stopping = bool(getattr(trainer, "received_sigterm", False))
        if trainer.world_size > 1:
            stopping = bool(trainer.strategy.broadcast(stopping, src=0))
        if stopping:
            self._save_last(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        """SIGTERM that came after this callback's hook, while Lightning ended the step, stops
        the run at the step's end all the same: that step is saved here. (One process only:
        with several, rank 0's broadcast decides above, and a save here could be entered by
        some ranks alone.)"""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and trainer.world_size == 1:
            self._save_last(trainer)

    def _save_last(self, trainer: L.Trainer) -> None:
        keeper = next((cb for cb in trainer.checkpoint_callbacks if getattr(cb, "save_last", False)), None)
        if keeper is None or keeper.dirpath is None or self._saved_step == trainer.global_step:
            return
        self._saved_step = trainer.global_step
        every = getattr(keeper, "_every_n_train_steps", 0)
        if every and trainer.global_step % every == 0:
            return  # its own save of this step follows (or came)
        last = Path(keeper.dirpath) / f"{keeper.CHECKPOINT_NAME_LAST}{keeper.FILE_EXTENSION}"
        trainer.save_checkpoint(last)
