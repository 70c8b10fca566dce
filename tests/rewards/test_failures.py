"""A failing reward is visible in a real fit: the progress bar shows its errors, and a
reward failing on most samples for several steps stops the run with its message."""

import pytest

from tests.helpers import tiny_data, tiny_module, tiny_trainer
from vapo_lightning.rewards import RewardCallback, RewardError


class Broken(RewardCallback):
    def __init__(self, fail_every: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.fail_every = fail_every

    def score(self, samples):
        return [None if i % self.fail_every == 0 else 1.0 for i in range(len(samples))]


@pytest.mark.slow
def test_errors_are_on_the_progress_bar(tok, tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[Broken(fail_every=4)])
    with pytest.warns(UserWarning, match="Broken failed on 4 of 16 samples"):
        trainer.fit(tiny_module(tok, val_before_train=False), tiny_data(tmp_path))
    assert trainer.progress_bar_metrics["reward/errors"] == 4


@pytest.mark.slow
def test_a_reward_failing_on_every_sample_stops_the_run(tok, tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=10, callbacks=[Broken(max_error_steps=2)])
    with pytest.raises(RewardError, match=r"Broken failed on more than 50% .* 2 consecutive"):
        trainer.fit(tiny_module(tok, val_before_train=False), tiny_data(tmp_path))
    assert trainer.global_step == 1
