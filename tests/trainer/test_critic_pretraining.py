"""`vapo pretrain-critic` on a tiny config: the buffer is sampled once (reused, resumed after
a kill with the same draws, refused when sampled otherwise), training stops on the held-out
explained variance and resumes after its last epoch, and the critic it writes loads in
`vapo fit`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import TINY_LLAMA, make_rows, write_jsonl
from vapo_lightning import critic_buffer as cb
from vapo_lightning import critic_pretraining as cp
from vapo_lightning.advantages import monte_carlo_returns
from vapo_lightning.cli import main


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A tiny Llama, 24 training prompts, `ParityReward` (varies within every group)."""
    tmp = tmp_path_factory.mktemp("pc")
    train = write_jsonl(tmp / "train.jsonl", make_rows(24))
    val = write_jsonl(tmp / "val.jsonl", make_rows(4, offset=100))
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp / "fit"),
            "callbacks": [{"class_path": "tests.helpers.ParityReward"}],
        },
        "model": {
            "policy": {"config": TINY_LLAMA, "tokenizer": "vapo_lightning/assets/quickstart_sft"},
            "generation": {"n": 2, "max_new_tokens": 8, "temperature": 1.0},
            "val_before_train": False,
            "algorithm": {"mini_batch_size": 8, "micro_batch_size": 4},
            "optim": {"actor_lr": 1e-3, "critic_lr": 1e-3, "warmup_steps": 0},
        },
        "data": {"train": str(train), "val": str(val), "prompts_per_step": 4, "chat_template": False},
    }
    path = tmp / "tiny.yaml"
    path.write_text(json.dumps(cfg))  # (JSON is YAML)
    return path


def pretrain(config: Path, out: Path, *flags: str) -> dict:
    main(["pretrain-critic", "-c", str(config), f"--out={out}", "--chunk_prompts=8", *flags])
    return json.loads((out / "report.json").read_text())


def buffer_tensors(out: Path) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted((out / "buffer").glob("chunk_*.pt"))]


def test_monte_carlo_returns_and_the_split_by_prompt():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    scores = torch.tensor([2.0, -1.0])
    g = monte_carlo_returns(scores, mask)
    assert g.tolist() == [[2.0, 2.0, 2.0, 0.0], [-1.0, -1.0, 0.0, 0.0]]
    g = monte_carlo_returns(scores, mask, gamma=0.5)  # the reward sits on the last token
    assert g[0, :3].tolist() == [0.5, 1.0, 2.0]
    train, held = cp.split_by_prompt(50, 0.1, seed=0)
    assert len(held) == 5 and not set(train) & set(held) and sorted(train + held) == list(range(50))
    assert cp.split_by_prompt(50, 0.1, seed=0) == (train, held)
    assert cp.split_by_prompt(2, 0.01, 0)[1] and cp.split_by_prompt(2, 0.99, 0)[0]  # one of each


def test_stopping_follows_the_held_out_explained_variance():
    opts = cp.Options(patience=2, max_epochs=10, min_delta=0.01)

    def rows(evs):
        return [{"held_out/explained_var": ev, "held_out/value_loss": 1.0} for ev in evs]

    assert cp.stopped(rows([0.0, 0.2, 0.3]), opts) is None
    assert "epoch 1" in cp.stopped(rows([0.0, 0.2, 0.205, 0.19]), opts)  # +0.005 is no gain
    assert cp.improved(rows([0.0, 0.2, 0.205, 0.19]), 0.01) == 1
    assert cp.stopped(rows([0.0] + [0.1 * k for k in range(1, 11)]), opts) == "max_epochs=10"
    undefined = [{"held_out/explained_var": math.nan, "held_out/value_loss": v} for v in (1.0, 0.5, 0.499, 0.6)]
    assert cp.improved(undefined, 0.01) == 1 and cp.stopped(undefined, opts) is not None  # by the value loss


@pytest.mark.slow
def test_pretrain_critic_stops_and_writes_a_critic_that_vapo_fit_loads(config, tmp_path):
    report = pretrain(config, tmp_path, "--max_epochs=30", "--patience=1", "--min_delta=0.5")
    b = report["buffer"]
    assert b["prompts"] == 24 and b["responses"] == 48 and b["held_out_prompts"] == 2
    assert b["held_out_responses"] == 4 and b["training_responses"] == 44
    epochs = report["epochs"]
    assert [row["epoch"] for row in epochs] == list(range(len(epochs)))
    assert len(epochs) < 30 and report["stopped"].startswith("no better")  # stopped early
    assert not math.isnan(epochs[0]["held_out/explained_var"])  # ParityReward: the returns vary
    assert all(row["train/value_loss"] > 0 for row in epochs[1:])
    assert "| epoch |" in (tmp_path / "report.md").read_text()
    # The critic written is the best epoch's and loads as a run's critic.
    critic_dir = tmp_path / "critic"
    saved = load_file(next(critic_dir.glob("*.safetensors")))
    main(
        [
            "fit",
            "-c",
            str(config),
            f"--model.critic.name_or_path={critic_dir}",
            f"--trainer.default_root_dir={tmp_path / 'fit'}",
        ]
    )
    from vapo_lightning.models import ModelSpec, build_critic, build_policy, load_tokenizer

    tok = load_tokenizer("vapo_lightning/assets/quickstart_sft")
    policy = build_policy(ModelSpec(config=TINY_LLAMA, tokenizer="vapo_lightning/assets/quickstart_sft"), tok)
    critic = build_critic(ModelSpec(name_or_path=str(critic_dir)), policy, tok)
    state = critic.state_dict()
    assert set(saved) <= set(state)
    assert all(torch.equal(state[k].float(), saved[k].float()) for k in saved)


@pytest.mark.slow
def test_the_buffer_is_reused_and_a_killed_call_resumes_with_the_same_draws(config, tmp_path, monkeypatch):
    pretrain(config, tmp_path / "whole", "--max_epochs=1")
    whole = buffer_tensors(tmp_path / "whole")
    assert len(whole) == 3  # 24 prompts in chunks of 8

    calls, score = [], cb.score_rollout

    def killed_at_the_second_chunk(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return score(*args)

    monkeypatch.setattr(cb, "score_rollout", killed_at_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        pretrain(config, tmp_path / "killed", "--max_epochs=1")
    assert [p.name for p in sorted((tmp_path / "killed" / "buffer").glob("chunk_*"))] == ["chunk_00000.pt"]
    monkeypatch.setattr(cb, "score_rollout", score)
    pretrain(config, tmp_path / "killed", "--max_epochs=1")
    resumed = buffer_tensors(tmp_path / "killed")
    for a, b in zip(whole, resumed, strict=True):
        for k in cb.BUFFER_FIELDS:
            assert torch.equal(a[k], b[k]), k

    # A second call samples nothing: the engine is never made, the chunks are not rewritten.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "whole" / "buffer").glob("chunk_*")}
    monkeypatch.setattr(cb, "make_engine", lambda *a, **k: pytest.fail("sampled again"))
    report = pretrain(config, tmp_path / "whole", "--max_epochs=2")
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert report["buffer"]["responses"] == 48
    # ... and training went on after its last epoch instead of starting over.
    first = json.loads(json.dumps(report["epochs"][:2]))
    assert len(report["epochs"]) == 3 and first == report["epochs"][:2]

    with pytest.raises(SystemExit, match="samples_per_prompt"):  # sampled otherwise: refused
        pretrain(config, tmp_path / "whole", "--samples_per_prompt=3")
    assert len(list((tmp_path / "whole" / "buffer").glob("chunk_*"))) == 3


def test_a_critic_free_config_is_refused(config, tmp_path):
    with pytest.raises(SystemExit, match="no critic"):
        main(["pretrain-critic", "-c", str(config), f"--out={tmp_path}", "--model.algorithm.advantage=group"])
