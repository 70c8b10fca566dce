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


@pytest.mark.slow
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
    assert module.value_pretraining_at(1) and not module.value_pretraining_at(2)
    logged = scalars(tmp_path)
    assert [v for _, v in logged["warmup/active"]] == [1.0, 1.0]
    assert "actor/pg_loss" not in logged

    # The saved critic is a drop-in critic for a later run that skips the warm-up.
    reloaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "warm_critic")
    for name, p in module.critic.named_parameters():
        torch.testing.assert_close(reloaded.state_dict()[name], p.detach())


@pytest.mark.slow
def test_value_pretraining_ends_early_at_its_explained_variance_threshold(tok, tmp_path):
    """The phase is the module's, from the rollout step's index: a threshold every critic
    reaches ends it after its first step, and the actor learns from the second."""
    L.seed_everything(1)
    module = tiny_module(tok, val_before_train=False)
    warmup = ValuePretraining(steps=3, explained_variance_threshold=-1e9)
    tiny_trainer(tmp_path, max_steps=3, limit_val_batches=0, callbacks=[warmup]).fit(
        module, datamodule=tiny_data(tmp_path)
    )
    assert module.value_pretraining_steps == 1
    logged = scalars(tmp_path)
    assert [v for _, v in logged["warmup/active"]] == [1.0, 0.0, 0.0]
    assert len(logged["actor/pg_loss"]) == 2


def test_entropy_collapse_is_judged_against_the_runs_early_entropy(recwarn):
    tracker = EntropyTracker(reference_steps=3)
    for step, mean in enumerate([0.06, 0.05, 0.04, 0.017, 0.012], 1):  # short, certain answers
        tracker._warn(mean, step)
    assert len(recwarn) == 0
    with pytest.warns(UserWarning, match=r"0\.0040 nats at rollout step 6, below 0\.1 × this run's early"):
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
        "response_tokens",
        "reward",
        "correct",
        "ground_truth",
    } <= rows[0].keys()
    assert all(r["reward"] in (1.0, -1.0) and r["correct"] == (r["reward"] > 0) for r in rows)
    r = trainer.lightning_module.last_val_rollout  # the last batch's: its rows end the file
    assert [row["response_tokens"] for row in rows[-len(r) :]] == r.response_extent.tolist()
    assert {r["prompt"] for r in rows} == {
        f"What is {a} + {b}?" for a, b in (((i % 7) + 1, (3 * i) % 5 + 1) for i in range(100, 106))
    }


@pytest.mark.slow
def test_validation_before_training_is_written_at_step_0(tmp_path):
    """The module scores the start outside Lightning's validation loop; its generations are
    written too, and they are the ones `val/accuracy` at step 0 was computed from."""
    tok = build_tokenizer(tmp_path / "tok")
    out = tmp_path / "samples.jsonl"
    module = tiny_module(tok)
    trainer = tiny_trainer(
        tmp_path,
        max_steps=2,
        callbacks=[ValidationSamples(str(out))],
        val_check_interval=2,
        check_val_every_n_epoch=None,
    )
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    rows = [json.loads(line) for line in out.open()]
    assert [r["step"] for r in rows] == [0] * 12 + [2] * 12
    start = [r["correct"] for r in rows if r["step"] == 0]
    assert sum(start) / len(start) == pytest.approx(module.initial_val_accuracy, abs=1e-6)


@pytest.mark.slow
def test_training_samples_are_the_scored_responses_of_each_step(tok, tmp_path):
    """`TrainingSamples` writes k responses per rollout step, one per prompt, with the reward
    the update used and each reward callback's own score, to JSONL and to TensorBoard text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers import ParityReward
    from vapo_lightning.callbacks import TrainingSamples

    class Seen(L.Callback):  # the rollout as the update saw it, before anything else reads it
        def __init__(self):
            self.rollouts = []

        def on_train_batch_end(self, trainer, module, *args):
            self.rollouts.append(module.last_rollout)

    class Half(ParityReward):  # a second, weighted reward with its own scores
        def __init__(self):
            super().__init__(weight=0.5)

        def score(self, samples):
            return [0.5] * len(samples)

    L.seed_everything(2)
    seen, out = Seen(), tmp_path / "samples.jsonl"
    trainer = tiny_trainer(
        tmp_path, max_steps=2, limit_val_batches=0, callbacks=[Half(), seen, TrainingSamples(k=3, path=str(out))]
    )
    trainer.fit(tiny_module(tok, val_before_train=False), datamodule=tiny_data(tmp_path))
    rows = [json.loads(line) for line in out.open()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    for step, r in enumerate(seen.rollouts, 1):
        firsts = [0, 4, 8]  # n = 4: the first response of each of the first 3 prompts
        mine = [row for row in rows if row["step"] == step]
        assert [row["response"] for row in mine] == [r.samples[i].response for i in firsts]
        for row, i in zip(mine, firsts):
            parity = 1.0 if sum(r.samples[i].response_ids) % 2 == 0 else -1.0
            assert row["scores"] == {"ParityReward": parity, "Half": 0.5}
            assert row["reward"] == pytest.approx(float(r.scores[i])) == pytest.approx(parity + 0.25)
            assert row["correct"] == (parity > 0) and row["tokens"] == int(r.response_lengths[i])
    (events,) = (tmp_path / "lightning_logs" / "version_0").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("rollout/samples/text_summary")
    assert [t.step for t in texts] == [1, 2]
    assert rows[3]["response"].splitlines()[0] in texts[1].tensor_proto.string_val[0].decode()


def test_each_reward_callbacks_mean_is_logged_under_its_name(tok, tmp_path):
    from tests.helpers import ParityReward

    class Half(ParityReward):
        def score(self, samples):
            return [0.5] * len(samples)

    L.seed_everything(2)
    trainer = tiny_trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[Half(weight=0.0)])
    module = tiny_module(tok, val_before_train=False)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    logged = scalars(tmp_path)
    r = module.last_rollout
    parity = [1.0 if sum(s.response_ids) % 2 == 0 else -1.0 for s in r.samples]
    assert logged["reward/Half"] == [(0, 0.5)]
    assert logged["reward/ParityReward"] == [(0, pytest.approx(sum(parity) / len(parity)))]
