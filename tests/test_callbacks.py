"""The built-in callbacks (`vapo_lightning/callbacks.py`): value pretraining freezes the actor,
then releases it and saves the critic; the entropy alert; validation samples to JSONL."""

import json

import lightning as L
import pytest
import torch
from transformers import AutoModelForTokenClassification

from tests.helpers import (
    build_tokenizer,
    changed,
    scalars,
    snapshot,
    tiny_data,
    tiny_module,
    tiny_trainer,
)
from vapo_lightning.callbacks import EntropyTracker, ValidationSamples, ValuePretraining


def test_value_pretraining_freezes_the_actor_then_releases_it(tok, tmp_path):
    L.seed_everything(1)
    module = tiny_module(tok)
    module.configure_model()
    policy0, critic0 = snapshot(module.policy), snapshot(module.critic)
    warmup = ValuePretraining(steps=2, save_dir=str(tmp_path / "warm_critic"))
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[warmup])
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert changed(policy0, module.policy) == set()  # the policy is fixed during warm-up
    assert changed(critic0, module.critic) == set(critic0)
    assert not warmup.active and not module.actor_frozen
    logged = scalars(tmp_path)
    assert [v for _, v in logged["warmup/active"]] == [1.0, 1.0]
    assert "actor/pg_loss" not in logged

    # The saved critic is a drop-in critic for a later run that skips the warm-up.
    reloaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "warm_critic")
    for name, p in module.critic.named_parameters():
        torch.testing.assert_close(reloaded.state_dict()[name], p.detach())


def test_entropy_collapse_is_judged_against_the_runs_early_entropy(recwarn):
    tracker = EntropyTracker(reference_steps=3)
    for step, mean in enumerate([0.06, 0.05, 0.04, 0.017, 0.012], 1):  # short, certain answers
        tracker._warn(mean, step)
    assert len(recwarn) == 0
    with pytest.warns(
        UserWarning, match=r"0\.0040 nats at rollout step 6, below 0\.1 × this run's early"
    ):
        tracker._warn(0.004, 6)
    resumed = EntropyTracker(reference_steps=3)
    resumed.load_state_dict(tracker.state_dict())
    resumed._warn(0.001, 7)  # warned once per run, also across a resume
    assert len(recwarn) == 0


def test_validation_generations_go_to_a_jsonl_file(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    out = tmp_path / "val" / "samples.jsonl"
    trainer = tiny_trainer(tmp_path, callbacks=[ValidationSamples(str(out))])
    trainer.validate(tiny_module(tok), datamodule=tiny_data(tmp_path))  # 6 prompts × n=2
    rows = [json.loads(line) for line in out.open()]
    assert len(rows) == 12
    assert {
        "step",
        "data_source",
        "prompt",
        "response",
        "reward",
        "correct",
        "ground_truth",
    } <= rows[0].keys()
    assert all(r["reward"] in (1.0, -1.0) and r["correct"] == (r["reward"] > 0) for r in rows)
    assert {r["prompt"] for r in rows} == {f"What is {a} + {b}?" for a, b in
                                            (((i % 7) + 1, (3 * i) % 5 + 1) for i in range(100, 106))}  # fmt: skip


def test_validation_before_training_is_written_at_step_0(tmp_path):
    """The module scores the start outside Lightning's validation loop; its generations are
    written too, and they are the ones `val/accuracy` at step 0 was computed from."""
    tok = build_tokenizer(tmp_path / "tok")
    out = tmp_path / "samples.jsonl"
    module = tiny_module(tok)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[ValidationSamples(str(out))],
                           val_check_interval=2, check_val_every_n_epoch=None)  # fmt: skip
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    rows = [json.loads(line) for line in out.open()]
    assert [r["step"] for r in rows] == [0] * 12 + [2] * 12
    start = [r["correct"] for r in rows if r["step"] == 0]
    assert sum(start) / len(start) == pytest.approx(module.initial_val_accuracy, abs=1e-6)
