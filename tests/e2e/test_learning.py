"""Every algorithm learns: on a reward a tiny policy can learn in a few rollout steps, the
rollout reward rises for VAPO, vanilla PPO, GRPO and DAPO (the direction of every loss term
and the advantage plumbing, end to end), and stays flat when the actor is frozen.

VAPO needs its value pretraining here: responses are 4 tokens, so the length-adaptive
lambda_actor = 1 - 1/(0.05 l) is clamped to 0 (§4.2) and the actor's advantage is the
critic's one-step TD error alone; without a warmed critic it has no signal (measured: flat
for 20 steps, where PPO with lambda 0.95 learns in 12)."""

import glob

import lightning as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import build_tokenizer, tiny_data, tiny_module
from vapo_lightning.callbacks import ValuePretraining
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.rewards.base import RewardCallback


class LowFirstToken(RewardCallback):
    """+1 when the first response token's id is in the lower half of the vocabulary, else -1:
    a ~50% reward at random init that a policy learns by moving one softmax."""

    correct_threshold = 0.0

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.cut = vocab // 2

    def score(self, samples):
        return [1.0 if s.response_ids and s.response_ids[0] < self.cut else -1.0 for s in samples]


ALGORITHMS = {
    "vapo": Algorithm(mini_batch_size=16, micro_batch_size=8),
    "ppo": Algorithm(
        lam_actor=0.95,
        lam_critic=0.95,
        length_adaptive_gae=False,
        decoupled_gae=False,
        clip_high=0.2,
        loss_agg="sequence",
        nll_coef=0.0,
        mini_batch_size=16,
        micro_batch_size=8,
    ),
    "grpo": Algorithm(
        advantage="group",
        whiten_advantages=False,
        clip_high=0.2,
        loss_agg="sequence",
        nll_coef=0.0,
        mini_batch_size=16,
        micro_batch_size=8,
    ),
    "dapo": Algorithm(
        advantage="group",
        whiten_advantages=False,
        clip_high=0.28,
        nll_coef=0.0,
        dynamic_sampling_rounds=2,
        mini_batch_size=16,
        micro_batch_size=8,
    ),
}


def rewards(root) -> list[float]:
    (event_file,) = glob.glob(f"{root}/lightning_logs/version_0/events.out.tfevents.*")
    acc = EventAccumulator(event_file)
    acc.Reload()
    return [e.value for e in acc.Scalars("critic/score/mean")]


def fit(tmp_path, algorithm: Algorithm, steps: int, warmup: int = 0) -> list[float]:
    tok = build_tokenizer(tmp_path / "tok")
    L.seed_everything(0)
    module = tiny_module(
        tok,
        algorithm=algorithm,
        generation=Generation(n=4, max_new_tokens=4),
        optim=Optim(actor_lr=3e-2, critic_lr=3e-2, warmup_steps=0),
        val_before_train=False,
    )
    module.configure_model()
    callbacks = [LowFirstToken(module.policy.config.vocab_size)]
    if warmup:
        callbacks.append(ValuePretraining(steps=warmup))
    trainer = L.Trainer(
        max_steps=steps,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    return rewards(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_rollout_reward_rises(tmp_path, name):
    # DAPO reaches all-correct rollouts at steps 15-19 over seeds 0-3: 20 steps left its
    # last-three mean at 0.67 on two of them, so the critic-free runs get 25. VAPO is the
    # slowest and the noisiest here (8 responses per step, the actor's advantage a one-step TD
    # error, only as good as the critic): its outcome turned on the CPU's float sums with 6 steps
    # of value pretraining (seeds 0-3 on an Intel Xeon with AMX: 2 passed at 45 steps); with 15
    # all of seeds 0-5 passed there.
    steps, warmup = (45, 15) if name == "vapo" else (25, 0)
    got = fit(tmp_path, ALGORITHMS[name], steps=steps, warmup=warmup)
    first, last = sum(got[:3]) / 3, sum(got[-3:]) / 3
    assert last > 0.7 and last > first + 0.5, got  # mean reward in [-1, 1], ~0.2 at the start


@pytest.mark.slow
def test_frozen_actor_does_not_learn(tmp_path):
    """Control for the test above: the same run with the actor frozen (value pretraining for
    every step) keeps the reward where it started, so the rise is the actor's doing."""
    got = fit(tmp_path, ALGORITHMS["vapo"], steps=20, warmup=20)
    first, last = sum(got[:3]) / 3, sum(got[-3:]) / 3
    assert last < 0.5 and abs(last - first) < 0.5, got
