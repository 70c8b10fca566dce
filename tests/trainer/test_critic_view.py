"""The critic's per-token view (`vapo_lightning/critic_view.py`): its TD errors and advantages
against a loop, the numbers the update used, tool observations without numbers, the files and
TensorBoard entries of a validation, and `vapo inspect` on a checkpoint."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import scalars, tiny_data, tiny_module, tiny_trainer
from tests.update_helpers import rollout_with_observations
from vapo_lightning.config import Algorithm
from vapo_lightning.critic_view import CriticView, TokenView, figure, pick_rows, token_views
from vapo_lightning.models import load_tokenizer
from vapo_lightning.rollout import critic_values

ROOT = Path(__file__).resolve().parents[2]


class Ids:
    """A tokenizer stand-in: token i reads "<i>"."""

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def loop_reference(rewards_at_end: float, values: list[float], action: list[bool], gamma: float, lam: float):
    """TD errors and GAE advantages over the action tokens alone, one position at a time."""
    steps = [t for t, a in enumerate(action) if a]
    delta, adv = {}, {}
    for i, t in enumerate(steps):
        last = i == len(steps) - 1
        next_v = 0.0 if last else values[steps[i + 1]]
        delta[t] = (rewards_at_end if last else 0.0) + gamma * next_v - values[t]
    running = 0.0
    for t in reversed(steps):
        running = delta[t] + gamma * lam * running
        adv[t] = running
    return delta, adv


@pytest.mark.parametrize("length_adaptive", [True, False])
def test_td_errors_and_advantages_equal_a_loop_over_the_action_tokens(length_adaptive):
    r = rollout_with_observations(50)
    values = torch.randn(r.response_mask.shape, generator=torch.Generator().manual_seed(1))
    algo = Algorithm(gamma=0.97, lam_actor=0.9, length_adaptive_gae=length_adaptive)
    views = token_views(r, values, algo, Ids())
    lengths = r.response_lengths.float()
    for b, view in enumerate(views):
        lam = min(1.0, max(0.0, 1 - 1 / (algo.alpha * float(lengths[b])))) if length_adaptive else 0.9  # Eq. 5
        action = r.response_mask[b, : len(view.tokens)].tolist()
        assert view.action == action
        assert len(view.tokens) == int(r.attention_mask[b, r.prompt_length :].sum())  # observations too
        delta, adv = loop_reference(float(r.scores[b]), values[b].tolist(), action, 0.97, lam)
        for t, is_action in enumerate(action):
            if is_action:
                assert view.value[t] == pytest.approx(float(values[b, t]), abs=1e-6)
                assert view.td_error[t] == pytest.approx(delta[t], abs=1e-5)
                assert view.advantage[t] == pytest.approx(adv[t], abs=1e-5)
            else:  # a tool's observation: context, no numbers
                assert math.isnan(view.value[t]) and math.isnan(view.td_error[t]) and math.isnan(view.advantage[t])
        if not view.correct:  # the largest fall of V between consecutive action tokens
            steps = [t for t, a in enumerate(action) if a]
            falls = {steps[i]: view.value[steps[i - 1]] - view.value[steps[i]] for i in range(1, len(steps))}
            assert view.drop == (max(falls, key=falls.get) if falls else None)
        else:
            assert view.drop is None
    assert any(not all(v.action) for v in views) and not views[6].action[-1]  # (row 6 ends in one)


def test_pick_rows_shows_a_wrong_answer_when_there_is_one():
    assert pick_rows(torch.tensor([True, True, True, False, True]), 3) == [0, 1, 3]
    assert pick_rows(torch.tensor([True, False, True]), 2) == [0, 1]
    assert pick_rows(torch.tensor([True, True]), 4) == [0, 1]


def test_the_picture_of_a_long_wrong_answer_holds_its_last_token_and_its_drop():
    """A 128-token wrong answer: the reward enters the TD error at token 127 and V falls the
    most at token 108; both are drawn (and labelled), as `critic_view.md` lists them."""
    import matplotlib.pyplot as plt

    n, drop = 128, 108
    value = [0.5 - 0.001 * t - (0.3 if t >= drop else 0.0) for t in range(n)]
    view = TokenView(
        prompt="p",
        response="r",
        reward=-1.0,
        correct=False,
        tokens=[f"<{t}>" for t in range(n)],
        action=[True] * n,
        value=value,
        td_error=[0.0] * (n - 1) + [-1.0 - value[-1]],
        advantage=[0.1] * n,
        drop=drop,
    )
    fig = figure(view)
    try:
        for ax in fig.axes:
            curves = [line for line in ax.lines if len(line.get_xdata()) == n]
            assert curves and list(curves[0].get_xdata()) == list(range(n))
            dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
            assert [list(line.get_xdata()) for line in dashed] == [[drop, drop]]
            assert ax.get_xlim()[1] > n - 1
        star = [line for line in fig.axes[1].lines if line.get_marker() == "*"]
        assert [list(line.get_xdata()) for line in star] == [[n - 1]]
        assert [list(line.get_ydata()) for line in star] == [[view.td_error[-1]]]
        labels = [t.get_text() for t in fig.axes[-1].get_xticklabels()]
        assert "<127>" in labels and "<108>" in labels and len(labels) <= 96 + 2
        assert f"token {drop}" in fig.axes[0].get_title()
    finally:
        plt.close(fig)


@pytest.mark.slow
def test_the_view_draws_the_values_and_advantages_the_update_used(tok, tmp_path, monkeypatch):
    """Captured at the actor's update of a run with tools: V_old and the advantages the loss
    read are the view's, on the action tokens, and the observations have none."""
    import vapo_lightning.module as module_file
    from tests.tool_helpers import EverySpace

    seen = []
    real = module_file.update_actor

    seen_values = []
    real_values = module_file.compute_values

    def values_spy(*args, **kwargs):
        seen_values.append(real_values(*args, **kwargs))
        return seen_values[-1]

    def spy(policy, opt, r, old, advantages, *args, **kwargs):
        seen.append((r, seen_values[-1].clone(), advantages.clone()))
        return real(policy, opt, r, old, advantages, *args, **kwargs)

    monkeypatch.setattr(module_file, "compute_values", values_spy)

    monkeypatch.setattr(module_file, "update_actor", spy)
    L.seed_everything(0)
    algo = Algorithm(mini_batch_size=8, micro_batch_size=4, whiten_advantages=False)
    module = tiny_module(tok, algorithm=algo, tools=[EverySpace()])
    tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_data(tmp_path))
    ((r, values, advantages),) = seen
    mask = r.response_mask
    assert (~mask & (r.attention_mask[:, r.prompt_length :] > 0)).any()  # observations inside
    views = token_views(r, values, algo, load_tokenizer(str(tok)))
    for b, view in enumerate(views):
        n = len(view.tokens)
        for t in range(n):
            if mask[b, t]:
                assert view.value[t] == pytest.approx(float(values[b, t]), abs=1e-6)
                assert view.advantage[t] == pytest.approx(float(advantages[b, t]), abs=1e-5)
            else:
                assert math.isnan(view.advantage[t])
        assert n == int(r.attention_mask[b, r.prompt_length :].sum())  # every token, observations too


@pytest.mark.slow
def test_a_validation_writes_the_view_to_tensorboard_and_files(tok, tmp_path):
    L.seed_everything(0)
    module = tiny_module(tok)
    view = CriticView(k=3)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[view], val_check_interval=1, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    folder = tmp_path / "critic_view"
    text = (folder / "critic_view.md").read_text()
    assert text.count("### step 1, response ") == 3  # the validation after step 1
    assert sorted(p.name for p in folder.glob("*.png")) == [f"step1_{i}.png" for i in range(3)]
    assert (folder / "step1_0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event,) = (tmp_path / "lightning_logs" / "version_0").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert {f"critic_view/image/{i}" for i in range(3)} <= set(acc.Tags()["images"])
    assert any(tag.startswith("critic_view/text") for tag in acc.Tags()["tensors"])
    assert "val/accuracy" in scalars(tmp_path)
    # The values drawn: each response's own critic forward, alone, at the weights validated.
    r, drawn = view.last_rollout, view.last_views
    assert len(drawn) == len(r) == 3
    for b, shown in enumerate(drawn):
        with torch.no_grad():
            alone = critic_values(module.critic, r.select([b]).trimmed())[0]
        actions = [t for t, a in enumerate(shown.action) if a]
        torch.testing.assert_close(
            torch.tensor([shown.value[t] for t in actions]), alone[actions], atol=1e-5, rtol=1e-4
        )


@pytest.mark.slow
def test_vapo_inspect_draws_the_view_of_a_checkpoint_on_a_prompt_file(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    short = [
        "-c",
        "configs/tiny_cpu.yaml",
        "--model.generation.max_new_tokens=8",
        "--data.prompts_per_step=4",
        "--model.algorithm.mini_batch_size=16",
        "--trainer.enable_progress_bar=false",
    ]
    fit = subprocess.run(
        [
            sys.executable,
            "-m",
            "vapo_lightning.cli",
            "fit",
            *short,
            "--trainer.max_steps=1",
            "--model.val_before_train=false",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Evaluate left to right: 2 + 3 * 4", "answer": "20"}\n'
        '{"prompt": "Evaluate left to right: 7 - 2 + 1", "answer": "6"}\n'
    )
    out = tmp_path / "inspect"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vapo_lightning.cli",
            "inspect",
            *short,
            f"--ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}",
            f"--data.val={prompts}",
            f"--trainer.default_root_dir={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "critic_view" / "critic_view.md").read_text()
    assert text.count(", response ") == 2 and "| t | token | V | TD error | advantage |" in text
    assert "2 + 3 * 4" in text and len(list((out / "critic_view").glob("step1_*.png"))) == 2
    assert text.startswith("### step 1, response 0")  # the checkpoint's step, not validate's 0
