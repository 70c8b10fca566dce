"""`vapo`: the command line. `vapo fit -c configs/X.yaml`, `vapo validate ...`, `vapo sft ...`.

A LightningCLI over `VAPOModule` and `PromptDataModule`: every constructor argument is a
flag and a YAML key (`--print_config` shows them all); unknown keys are jsonargparse errors.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from vapo_lightning.data import PromptDataModule
from vapo_lightning.module import VAPOModule

__all__ = ["main"]

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,  # metrics every rollout step
    "num_sanity_val_steps": 0,  # VAPOModule scores validation before training instead
    "default_root_dir": "runs",
}


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "sft":
        from vapo_lightning.sft import sft_main

        sft_main(["fit", *argv[1:]])
        return
    LightningCLI(
        VAPOModule,
        PromptDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=argv,
    )


if __name__ == "__main__":
    main()
