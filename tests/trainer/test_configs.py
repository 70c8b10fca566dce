"""Every YAML under configs/ parses with the real CLI (`--print_config`, nothing is loaded)."""

import contextlib
import inspect
import io
from pathlib import Path

import pytest
import yaml

from tests.helpers import CONFIGS, config_chain, print_config
from vapo_lightning.cli import main
from vapo_lightning.config import Algorithm, Generation
from vapo_lightning.data import PromptDataModule

ALL = sorted(p for p in CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(CONFIGS)) for p in ALL])
def test_config_parses(path):
    assert path.read_text().startswith("#"), f"{path} must start with a comment saying how to run it"
    cfg = print_config(*config_chain(path))
    if path.name.endswith("_sft.yaml"):
        assert cfg["model"] and cfg["data"]
        return
    assert cfg["model"]["policy"] and cfg["data"]["train"]
    export = cfg["model"]["hf_export_dir"]
    if export:  # a layer writes under its own folder, never over its base run's export
        assert Path(export).is_relative_to(cfg["trainer"]["default_root_dir"]), (export, path)
    overrides = yaml.safe_load(path.read_text())
    for key, value in (overrides.get("model", {}).get("algorithm") or {}).items():
        assert cfg["model"]["algorithm"][key] == value  # the switch really reached the module


def test_unknown_key_is_rejected():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(["fit", "-c", str(CONFIGS / "tiny_cpu.yaml"), "--model.algorithm.clip_hihg=0.3"])
    assert exit_.value.code != 0
    assert "clip_hihg" in err.getvalue()


def test_group_help_shows_each_fields_documentation(capsys):
    """`--model.algorithm.help Algorithm` prints the attribute docstrings of the dataclass."""
    with pytest.raises(SystemExit):
        main(["fit", "--model.algorithm.help", "Algorithm"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Critic optimiser steps on each mini-batch before its actor step" in out
    assert "default: 1" in out


def test_the_defaults_run_together():
    """A config that sets none of the batch sizes starts: the default mini-batch divides the
    default rollout (`data.prompts_per_step` × `model.generation.n`) into several optimiser
    steps, and the micro-batch divides the mini-batch."""
    prompts = inspect.signature(PromptDataModule).parameters["prompts_per_step"].default
    batch, algo = prompts * Generation().n, Algorithm()
    assert batch % algo.mini_batch_size == 0 and batch // algo.mini_batch_size > 1
    assert algo.mini_batch_size % algo.micro_batch_size == 0


@pytest.mark.slow
def test_a_yaml_layer_adds_a_reward_without_restating_the_callbacks(tmp_path):
    """`callbacks+:` in a layer appends to the earlier layers' list (`callbacks:` replaces it)."""
    layer = tmp_path / "overlong.yaml"
    layer.write_text(
        "trainer:\n  callbacks+:\n    - class_path: vapo_lightning.rewards.overlong.OverlongPenalty\n"
        "      init_args: {max_length: 192, cache_length: 32}\n"
    )
    base = [cb["class_path"] for cb in print_config("fit", "-c", "configs/smollm2.yaml")["trainer"]["callbacks"]]
    layered = print_config("fit", "-c", "configs/smollm2.yaml", "-c", str(layer))["trainer"]["callbacks"]
    assert [cb["class_path"] for cb in layered] == [*base, "vapo_lightning.rewards.overlong.OverlongPenalty"]
    assert layered[-1]["init_args"]["cache_length"] == 32


@pytest.mark.slow
def test_the_lora_layer_saves_every_step_and_keeps_the_other_callbacks():
    """A LoRA checkpoint is small (adapters, head, their optimiser states): its layer saves each
    rollout step, so a stop loses no finished step; its list is the base config's otherwise."""
    base = print_config("fit", "-c", "configs/smollm2.yaml")["trainer"]["callbacks"]
    lora = print_config("fit", "-c", "configs/smollm2.yaml", "-c", "configs/smollm2/lora.yaml")["trainer"]["callbacks"]
    saves = [cb["init_args"] for cb in lora if cb["class_path"].endswith("ModelCheckpoint")]
    assert [s["every_n_train_steps"] for s in saves] == [1] and saves[0]["save_last"] is True
    others = [cb for cb in lora if not cb["class_path"].endswith("ModelCheckpoint")]
    assert others == [cb for cb in base if not cb["class_path"].endswith("ModelCheckpoint")]
