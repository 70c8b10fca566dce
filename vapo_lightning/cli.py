"""`vapo`: the command line. `vapo fit -c configs/X.yaml`, `vapo validate ...`, `vapo sft ...`.

A LightningCLI over `VAPOModule` and `PromptDataModule`: every constructor argument is a
flag and a YAML key (`--print_config` shows them all); unknown keys are jsonargparse errors.
`--trainer.strategy=ddp|fsdp` selects VAPO's data parallelism (`vapo_lightning.distributed`),
which replicates or shards the policy and the critic each on its own.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
import typing
import zipfile
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from jsonargparse import set_parsing_settings
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vapo_lightning.callbacks import StepLog, TrainingSamples, progress_bar
from vapo_lightning.checkpoint import (
    AtomicCheckpointIO,
    CheckpointError,
    CheckpointOnSigterm,
    continue_logging,
)
from vapo_lightning.config import SetupError
from vapo_lightning.console import quiet_lightning
from vapo_lightning.data import DataError, PromptDataModule
from vapo_lightning.distributed import resolve_strategy
from vapo_lightning.engines.vllm import EngineSetupError
from vapo_lightning.models import ModelSpec, looks_like_a_model_source
from vapo_lightning.module import VAPOModule
from vapo_lightning.rewards import RewardError

__all__ = ["VAPOCLI", "main"]

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,  # metrics every rollout step
    "num_sanity_val_steps": 0,  # VAPOModule scores validation before training instead
    "default_root_dir": "runs",
}


class UsageError(ValueError):
    """A mistake in the command line or config; printed as one line naming the field or file."""


def _first_reason(message: str) -> str:
    """jsonargparse's multi-line message as one line: the key and the first reason of its
    ``Errors:`` list (e.g. ``Parser key "model.algorithm": Option 'clip_hihg' is not accepted``)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("- ") and "NoneType" not in line:
            reason, j = line[2:], i + 1
            while reason.endswith(":") and j < len(lines):  # "Problem with given class_path X:"
                reason, j = f"{reason} {lines[j]}" if "key" in reason else lines[j], j + 1
            return f"{lines[0].rstrip(':')}: {reason}"
    return " ".join(lines[:2])


NOT_A_CLASS = re.compile(r"Expected a path but (\S+) either not accessible or invalid")


def _why_not_importable(reason: str) -> str:
    """jsonargparse says "Expected a path but my_rewards.Boxed either not accessible or
    invalid" for a class path that does not import; say why it does not."""
    match = NOT_A_CLASS.search(reason)
    if match is None:
        return reason
    dotted, key = match.group(1), reason[: match.start()]  # 'Parser key "trainer.callbacks": '
    module, _, name = dotted.rpartition(".")
    try:
        found = importlib.import_module(module) if module else None
    except Exception as err:  # not found, or the plug-in's own import failed
        return (
            f"{key}{dotted} does not import: {type(err).__name__}: {err} (plug-in modules are "
            f"imported from the working directory, {os.getcwd()})"
        )
    if found is not None and not hasattr(found, name):
        return f"{key}{dotted}: module {module} ({getattr(found, '__file__', '?')}) has no {name!r}"
    return reason


class VAPOArgumentParser(LightningArgumentParser):
    """Reports a parse error in one line (the unknown key or bad value first), not after
    the whole usage text."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            return super().error(message, ex)
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {_why_not_importable(_first_reason(message))}\n")
        sys.stderr.write(f"(`{prog} --help` lists every option)\n")
        self.exit(2)


def _build(cls: type, values: dict[str, Any]) -> Any:
    """`cls(**values)` with nested dataclasses built from their dicts, for validation."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        inner = [t for t in typing.get_args(hints.get(name)) or [hints.get(name)] if is_dataclass(t)]
        kwargs[name] = _build(inner[0], value) if inner and isinstance(value, dict) else value
    return cls(**kwargs)


def check_model_config(model: dict[str, Any]) -> None:
    """Builds each dataclass argument of `VAPOModule` alone, so that a bad value is named by
    its field (``model.val_generation`` vs ``model.generation``), and checks that local model
    paths exist, before anything is loaded."""
    hints = typing.get_type_hints(VAPOModule.__init__)
    for name, value in model.items():
        classes = [t for t in typing.get_args(hints.get(name)) or [hints.get(name)] if is_dataclass(t)]
        if not classes or not isinstance(value, dict):
            continue
        try:
            spec = _build(classes[0], value)
        except (TypeError, ValueError) as err:
            message = str(err).removeprefix(f"model.{name}: ")
            raise UsageError(f"model.{name}: {message}") from None
        if isinstance(spec, ModelSpec):
            for field in ("name_or_path", "tokenizer"):
                path = getattr(spec, field)
                if path is not None and not looks_like_a_model_source(path):
                    raise UsageError(
                        f"model.{name}.{field}={path!r}: no such folder (and not a hub id like 'org/name')"
                    )


def check_checkpoint_path(ckpt_path: str | None, resume: bool = False) -> None:
    """An explicit checkpoint file must exist and be a complete torch file (its zip
    directory is at the end: an empty or truncated file has none); one that resumes a run
    must hold the optimiser state (not `ModelCheckpoint(save_weights_only=True)`'s)."""
    if ckpt_path is None or ckpt_path in ("last", "best", "hpc", "registry") or "://" in ckpt_path:
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise UsageError(f"ckpt_path={ckpt_path}: no such file")
    if path.is_file() and not zipfile.is_zipfile(path):
        raise UsageError(
            f"ckpt_path={ckpt_path} ({path.stat().st_size} bytes): not a complete checkpoint "
            "(empty, truncated or not a torch file)"
        )
    if resume and path.is_file() and not holds_optimizer_state(path):
        raise UsageError(
            f"ckpt_path={ckpt_path} holds weights only (ModelCheckpoint save_weights_only): it "
            "cannot resume a run; score it with `vapo validate`, or `vapo export` it and start "
            "a new run from the exported policy (model.policy.name_or_path)"
        )


RESTORED = "; no effect on a resumed fit: the optimisers and their schedules are restored from the checkpoint"


def changed_keys(saved: dict[str, Any], config: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs between a checkpoint's hyper-parameters and the config,
    as (checkpoint's, config's); keys only one side has are left out (a newer version's), and
    so are keys the config leaves to None (resolved when the module is built)."""
    changed = {}
    for key in saved.keys() & config.keys():
        was, now = saved[key], config[key]
        if now is None:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            changed |= changed_keys(was, now, f"{prefix}{key}.")
        elif was != now and not (isinstance(was, (list, tuple)) and list(was) == list(now or [])):
            changed[f"{prefix}{key}"] = (was, now)
    return dict(sorted(changed.items()))


def holds_optimizer_state(path: Path) -> bool:
    """Whether a torch checkpoint file has Lightning's ``optimizer_states`` key, read from
    its pickled index (a few kB), not by loading its tensors."""
    with zipfile.ZipFile(path) as archive:
        (index,) = [n for n in archive.namelist() if n.endswith("/data.pkl")] or [None]
        return index is None or b"optimizer_states" in archive.read(index)


class _OwnProgs:
    """Subcommand parsers named ``vapo fit`` (not ``vapo [options] fit``) in usage and help,
    and only the subcommands in `names`."""

    names: typing.ClassVar[dict[str, str]] = {"fit": "vapo fit", "validate": "vapo validate"}

    @classmethod
    def subcommands(cls) -> dict[str, set[str]]:
        return {k: v for k, v in LightningCLI.subcommands().items() if k in cls.names}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        for name, sub in self._subcommand_parsers.items():
            sub.prog = self.names[name]


class VAPOCLI(_OwnProgs, LightningCLI):
    """LightningCLI whose `ddp` / `fsdp` strategy names mean `VAPOStrategy` (Lightning's own
    would wrap the whole LightningModule: DDP then trips on the critic's backward, and its
    FSDP refuses CPUs). Mistakes in the config are reported in one line before any work."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", VAPOArgumentParser)
        super().__init__(*args, **kwargs)

    def _sub_config(self) -> tuple[str | None, Any]:
        sub = self.config.get("subcommand")  # set before `self.subcommand` is
        return sub, self.config.get(sub, self.config) if sub else self.config

    def _config_error(self, err: UsageError) -> NoReturn:
        parser = self._subcommand_parsers.get(self._sub_config()[0], self.parser)
        parser.error(str(err))

    def _parse_ckpt_path(self) -> None:
        """Lightning would put a checkpoint file's model hyper-parameters over the config and
        the command line here (for `--ckpt_path FILE`, not for `last`), silently. The config
        and command line win, for every checkpoint; the model keys that differ from the
        checkpoint's run are said."""
        config = self._sub_config()[1]
        try:
            check_checkpoint_path(config.get("ckpt_path"), resume=self._sub_config()[0] == "fit")
        except UsageError as err:
            self._config_error(err)
        path = config.get("ckpt_path")
        if path == "last":
            root = config.get("trainer", {}).get("default_root_dir") or TRAINER_DEFAULTS["default_root_dir"]
            path = os.path.join(root, "checkpoints", "last.ckpt")
        if path and Path(path).is_file():
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True).get("hyper_parameters", {})
            for key, (was, now) in changed_keys(saved, config.get("model").as_dict()).items():
                rank_zero_warn(
                    f"model.{key}: {now!r} from the config, where the checkpoint's run had {was!r}"
                    + (RESTORED if key.startswith("optim.") else "")
                )

    def before_instantiate_classes(self) -> None:
        config = self._sub_config()[1]
        try:
            check_model_config(config.get("model").as_dict())
        except UsageError as err:
            self._config_error(err)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        strategy = resolve_strategy(config.get("strategy", "auto"))
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        sharded = getattr(strategy, "mode", None) == "fsdp"  # writes DCP folders, not files
        if not sharded and not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if not sys.stdout.isatty() and not any(isinstance(cb, StepLog) for cb in callbacks):
            callbacks.append(StepLog())  # (a bar does not reach a file: a line per step does)
        if config.get("enable_progress_bar") is not False and not any(isinstance(cb, ProgressBar) for cb in callbacks):
            callbacks.append(progress_bar())
        if not any(isinstance(cb, TrainingSamples) for cb in callbacks):
            callbacks.append(TrainingSamples())  # a few scored responses per step, to read
        if not any(isinstance(cb, CheckpointOnSigterm) for cb in callbacks):
            callbacks.append(CheckpointOnSigterm())  # a stopped job keeps the step it finished
        if self._sub_config()[0] == "validate":  # (and `vapo inspect`)
            # Scores a checkpoint and writes none (a training config's ModelCheckpoint would
            # only warn that its folder changed), and logs under `validate/`, so the run's own
            # `lightning_logs/version_N` stays the latest one a resumed fit logs on in.
            callbacks = [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
            kwargs.setdefault("enable_checkpointing", False)
            if config.get("logger") in (None, True):
                root = config.get("default_root_dir") or TRAINER_DEFAULTS["default_root_dir"]
                kwargs.setdefault("logger", TensorBoardLogger(root, name="validate"))
        kwargs = {"strategy": strategy, "plugins": plugins, "callbacks": callbacks, **kwargs}
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """Checkpoints without a `dirpath` go to `<default_root_dir>/checkpoints`, not to a
        logger version folder, so `--ckpt_path last` finds them when a killed run restarts;
        the restarted run logs on in the killed run's TensorBoard folder."""
        for cb in self.trainer.checkpoint_callbacks:
            if cb.dirpath is None:
                cb.dirpath = os.path.join(self.trainer.default_root_dir, "checkpoints")
        continue_logging(self.trainer, self._sub_config()[1].get("ckpt_path"))


def import_from_working_directory() -> None:
    """Plug-ins (``--trainer.callbacks+=my_rewards.MyReward``) import from the working
    directory, as with ``python -m``: a console script's ``sys.path`` starts with its own
    ``bin/`` folder instead."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


COMMANDS = {
    "fit": "train with VAPO (or PPO / GRPO / DAPO by switches)",
    "validate": "score a checkpoint on the validation data (val/accuracy, mean@k)",
    "sft": "supervised fine-tuning of a warm start for RL",
    "pretrain-critic": "value pretraining to convergence on a buffer sampled once from the initial policy",
    "inspect": "validate a checkpoint and draw its critic's values, TD errors and advantages per token",
    "export": "save a checkpoint's policy and critic in Hugging Face format",
    "convert-gguf": "turn a GGUF model file into a Hugging Face folder",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}} {what}" for name, what in COMMANDS.items())
    return f"usage: vapo {{{','.join(COMMANDS)}}} ...\n\ncommands:\n{rows}\n\n`vapo COMMAND --help` for each command's options.\n"


def shows_help(argv: list[str]) -> bool:
    """Whether the command line prints the options' help: `-h`, `--help`, a group's
    `--model.algorithm.help`, or a `--print_config` with comments."""
    return any(
        a == "-h" or a.split("=")[0].endswith("help") or (a.startswith("--print_config") and "comments" in a)
        for a in argv
    )


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    import_from_working_directory()
    quiet_lightning()
    # The config dataclasses document each field in an attribute docstring: that is the help
    # (`--help`, `--print_config=comments`). Reading them means parsing every config class's
    # source, so only a command that shows them reads them.
    set_parsing_settings(docstring_parse_attribute_docstrings=shows_help(argv))
    command = argv[0] if argv else None
    if command in (None, "-h", "--help") or (command not in COMMANDS and not command.startswith("-")):
        sys.stdout.write(usage()) if command in ("-h", "--help") else sys.stderr.write(usage())
        if command in ("-h", "--help"):
            return
        sys.exit(2 if command is None else f"vapo: error: unknown command {command!r}")
    try:
        if command == "sft":
            from vapo_lightning.sft import SFTCLI, SFTDataModule, SFTModule

            cli = type("VAPOSFTCLI", (_OwnProgs, SFTCLI), {"names": {"fit": "vapo sft"}})
            sft_args = ["fit", *argv[1:]]
            if args is None:  # Lightning warns when given both sys.argv and args
                sys.argv, sft_args = [sys.argv[0], *sft_args], None
            cli(SFTModule, SFTDataModule, args=sft_args, save_config_kwargs={"overwrite": True})
        elif command == "inspect":  # `vapo validate` with the critic's view (critic_view.py)
            inspect_args = ["validate", *argv[1:], "--trainer.callbacks+=vapo_lightning.critic_view.CriticView"]
            if args is None:  # Lightning warns when given both sys.argv and args
                sys.argv, inspect_args = [sys.argv[0], *inspect_args], None
            run_cli(inspect_args)
        elif command == "pretrain-critic":
            from vapo_lightning.critic_pretraining import main as pretrain_main

            pretrain_main(argv[1:])
        elif command == "export":
            from vapo_lightning.export import main as export_main

            export_main(argv[1:])
        elif command == "convert-gguf":
            from vapo_lightning.convert_gguf import main as convert_gguf_main

            convert_gguf_main(argv[1:])
        else:
            run_cli(argv if args is not None else None)
    except (CheckpointError, DataError, RewardError, EngineSetupError, SetupError) as err:  # names the culprit
        sys.exit(f"vapo: error: {err}")
    except SIGTERMException:  # stopped after a whole step (and its checkpoint): not a success
        sys.exit(128 + signal.SIGTERM)


def run_cli(args: list[str] | None, run: bool = True) -> VAPOCLI:
    """`vapo fit` / `vapo validate` on `args`; `run=False`: the config's module, data and
    trainer, made and checked, nothing run (`args` then hold no subcommand)."""
    return VAPOCLI(
        VAPOModule,
        PromptDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=args,  # None: sys.argv (passing both makes Lightning warn)
        run=run,
    )


if __name__ == "__main__":
    main()
