"""What a run keeps across checkpoints beyond the weights, as hooks of `VAPOModule`: the
rollout-step count that `max_steps` and the checkpoint intervals read, each rank's random
streams, the bad-update counters and how many steps value pretraining took, and LoRA's frozen
base left out of the file (the adapters are what trains)."""

from __future__ import annotations

from typing import Any

from vapo_lightning.checkpoint import checkpoint_seconds, rank_rng_states, set_rng_state
from vapo_lightning.distributed import shards_checkpoints
from vapo_lightning.lora import drop_frozen, restore_frozen
from vapo_lightning.models import weights_from_source

__all__ = ["RunStateHooks"]


class RunStateHooks:
    """Mixed into `VAPOModule` (a `LightningModule`): its checkpoint hooks and step count."""

    def _count_rollout_as_one_step(self) -> None:
        """Under manual optimisation Lightning counts every `optimizer.step()` as a global
        step (Lightning-AI/pytorch-lightning#17958, open); users count rollout steps
        (max_steps, checkpoint and logging intervals), so one rollout advances
        `trainer.global_step` by exactly one, through the loop's private progress counter
        (pyproject bounds Lightning to releases tests/trainer/test_cli_errors.py checked)."""
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        target = self._rollout_steps_before + 1
        progress.total.ready = progress.total.completed = target

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the callbacks, `ModelCheckpoint` included: logs what this step's save took."""
        if (seconds := checkpoint_seconds(self.trainer)) is not None:  # (None: not measured)
            self.log("timing_s/checkpoint", seconds, on_step=True, on_epoch=False, batch_size=1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Random streams (one per rank) and counters, so a resumed run samples exactly what
        the uninterrupted run would have (data order: `ResumableDataLoader`)."""
        states = rank_rng_states(self.trainer.world_size)  # (every rank dumps the checkpoint)
        checkpoint["vapo"] = {
            "rng": states,
            "bad_updates": self.bad_updates,
            "value_pretraining_steps": self.value_pretraining_steps,
        }
        sources = weights_from_source(self.policy_spec, self.critic_spec)
        if shards_checkpoints(self):  # (fsdp loads every key of the model from its shards)
            sources = dict.fromkeys(sources, False)
        drop_frozen(checkpoint, self.trained_models, sources)  # LoRA: adapters, not the base

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint_step = int(checkpoint.get("global_step", 0))  # (validate keeps its own at 0)
        source = str(getattr(self._trainer, "ckpt_path", None) or "the checkpoint")
        restore_frozen(checkpoint, self.trained_models, source)
        state = checkpoint.get("vapo")
        if state is not None:
            states = state["rng"]
            set_rng_state(states[self.global_rank] if self.global_rank < len(states) else states[0])
            self.bad_updates = state["bad_updates"]
            self.value_pretraining_steps = state.get("value_pretraining_steps", self.value_pretraining_steps)
        for engine in self.engines.values():  # restored weights: an engine made before reloads
            engine.policy_changed()
