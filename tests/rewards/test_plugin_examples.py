"""The plug-in examples in `examples/rewards/`, how `vapo` finds them, and how the built-in
rewards are reached: `examples/` is user code (not installed), the built-ins are lazy exports
of `vapo_lightning.rewards`."""

import importlib
import shutil
import subprocess
import sys

import pytest
import setuptools

from examples.rewards.multiple_choice import MultipleChoice
from examples.rewards.short_answer import ShortAnswerBonus
from tests.helpers import ROOT, vapo
from vapo_lightning.rewards import RewardError, Sample, combine_rewards


def sample(response, n_tokens=5, truth=None):
    return Sample("p", response, list(range(n_tokens)), False, truth)


def test_short_answer_bonus():
    cb = ShortAnswerBonus(limit=10)
    got = cb.score([sample("\\boxed{5}"), sample("\\boxed{5}", n_tokens=10), sample("5")])
    assert got == [1.0, 0.0, 0.0]


def test_multiple_choice_is_a_verifier_and_reports_rows_it_cannot_score():
    cb = MultipleChoice(on_error="value", error_value=-1.0)
    samples = [
        sample("B is tempting, but... Answer: (C)", truth="C"),
        sample("answer: c", truth="(C)"),
        sample("Answer: C. Wait, no. Answer: D", truth="C"),
        sample("Answer: Cat", truth="C"),  # a word, not a letter
        sample("no answer", truth="A"),
        sample("Answer: A", truth="E"),  # not one of ABCD
    ]
    out = combine_rewards([cb], samples)
    assert out.rewards == [1.0, 1.0, -1.0, -1.0, -1.0, -1.0]
    assert out.errors == 1
    assert cb.correct_threshold == 0.0
    with pytest.raises(RewardError, match="'E' is not one of ABCD"):
        combine_rewards([MultipleChoice(on_error="abort")], samples[-1:])


@pytest.mark.slow
def test_vapo_imports_a_plug_in_folder_from_the_working_directory(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    done = vapo(
        "fit",
        "-c",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "--print_config",
        "--trainer.callbacks+=examples.rewards.short_answer.ShortAnswerBonus",
        "--trainer.callbacks+=examples.rewards.multiple_choice.MultipleChoice",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "class_path: examples.rewards.short_answer.ShortAnswerBonus" in done.stdout
    assert "class_path: examples.rewards.multiple_choice.MultipleChoice" in done.stdout


def test_examples_are_not_installed():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(ROOT), include=find["include"])
    assert "vapo_lightning.rewards" in packages
    assert all(p.split(".")[0] == "vapo_lightning" for p in packages), packages


@pytest.mark.slow
def test_built_in_rewards_are_lazy_exports():
    script = (
        "import sys, vapo_lightning.rewards as r\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vapo_lightning.', 'math_verify'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "['vapo_lightning.rewards', 'vapo_lightning.rewards.base']", (
        done.stdout + done.stderr[-2000:]
    )
    from vapo_lightning.rewards import CodeReward, MathReward, VerlReward, is_equivalent

    rewards = importlib.import_module("vapo_lightning.rewards")
    assert MathReward is importlib.import_module("vapo_lightning.rewards.math").MathReward
    assert is_equivalent is importlib.import_module("vapo_lightning.rewards.math").is_equivalent
    assert CodeReward is importlib.import_module("vapo_lightning.rewards.code").CodeReward
    assert VerlReward is importlib.import_module("vapo_lightning.rewards.verl").VerlReward
    assert set(rewards.__all__) <= set(dir(rewards))
    with pytest.raises(AttributeError, match="no attribute 'MathRewards'"):
        rewards.MathRewards  # noqa: B018


def test_the_no_reward_hint_names_a_class_that_resolves():
    with pytest.raises(RewardError) as err:
        combine_rewards([], [sample("x")])
    (path,) = [w.split("=", 1)[1] for w in str(err.value).split() if "callbacks+=" in w]
    module, _, name = path.rpartition(".")
    assert getattr(importlib.import_module(module), name).__name__ == name
