"""`vapo`: the command line. `vapo fit -c configs/X.yaml`, `vapo validate ...`, `vapo sft ...`.

A LightningCLI over `VAPOModule` and `PromptDataModule`: every constructor argument is a
flag and a YAML key (`--print_config` shows them all); unknown keys are jsonargparse errors.
`--trainer.strategy=ddp|fsdp` selects VAPO's data parallelism (`vapo_lightning.distributed`),
which replicates or shards the policy and the critic each on its own.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from vapo_lightning.checkpoint import AtomicCheckpointIO
from vapo_lightning.data import PromptDataModule
from vapo_lightning.distributed import resolve_strategy
from vapo_lightning.module import VAPOModule

__all__ = ["VAPOCLI", "main"]

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,  # metrics every rollout step
    "num_sanity_val_steps": 0,  # VAPOModule scores validation before training instead
    "default_root_dir": "runs",
}


class VAPOCLI(LightningCLI):
    """LightningCLI whose `ddp` / `fsdp` strategy names mean `VAPOStrategy` (Lightning's own
    would wrap the whole LightningModule: DDP then trips on the critic's backward, and its
    FSDP refuses CPUs)."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        strategy = resolve_strategy(config.get("strategy", "auto"))
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        sharded = getattr(strategy, "mode", None) == "fsdp"  # writes DCP folders, not files
        if not sharded and not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        return super().instantiate_trainer(**{"strategy": strategy, "plugins": plugins, **kwargs})

    def before_fit(self) -> None:
        """Checkpoints without a `dirpath` go to `<default_root_dir>/checkpoints`, not to a
        logger version folder, so `--ckpt_path last` finds them when a killed run restarts."""
        for cb in self.trainer.checkpoint_callbacks:
            if cb.dirpath is None:
                cb.dirpath = os.path.join(self.trainer.default_root_dir, "checkpoints")


def import_from_working_directory() -> None:
    """Plug-ins (``--trainer.callbacks+=my_rewards.MyReward``) import from the working
    directory, as with ``python -m``: a console script's ``sys.path`` starts with its own
    ``bin/`` folder instead."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    import_from_working_directory()
    if argv and argv[0] == "sft":
        from vapo_lightning.sft import sft_main

        sft_main(["fit", *argv[1:]])
        return
    VAPOCLI(
        VAPOModule,
        PromptDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=argv,
    )


if __name__ == "__main__":
    main()
