"""`CriticProbe`: the critic measured on fixed held-out rollouts, before training and after
every step, logged to TensorBoard."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import scalars, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.critic_checks import check_critic
from vapo_lightning.critic_probe import CriticProbe
from vapo_lightning.updates import Forwards, compute_values


@pytest.mark.slow
def test_the_probe_is_fixed_logged_from_step_0_and_measures_the_critic_as_it_stands(tmp_path, tok):
    probe = CriticProbe(prompts=4, n=3)
    module, data = tiny_module(tok), tiny_data(tmp_path)
    tiny_trainer(tmp_path, max_steps=3, callbacks=[probe]).fit(module, data)
    r, returns = probe.probe, probe.returns
    assert len(r) == 12 and sorted(set(r.group_ids.tolist())) == [0, 1, 2, 3]  # val prompts 0-3, 3 answers each
    assert torch.equal(returns, r.scores[:, None].expand_as(returns) * r.response_mask)
    logged = scalars(tmp_path)
    steps = [s for s, _ in logged["critic_probe/value_loss"]]
    assert steps == [0, 1, 2, 3]
    # The last logged numbers are the checks of the critic as the run left it.
    values = compute_values(module.critic, r, Forwards(module.algo.micro_batch_size))
    expected = check_critic(values, returns, r.scores, r.correct, r.group_ids, r.response_mask)
    assert logged["critic_probe/value_loss"][-1][1] == pytest.approx(expected["value_loss"], rel=1e-4)
    assert logged["critic_probe/value_loss"][0][1] != pytest.approx(expected["value_loss"], rel=1e-4)  # it learnt
    # A resumed run probes the first run's answers (from the checkpoint), not its own policy's.
    again = CriticProbe(prompts=4, n=3)
    again.load_state_dict(probe.state_dict())
    again.on_train_start(module.trainer, module)
    for k in ("input_ids", "response_mask", "scores"):
        assert torch.equal(getattr(again.probe, k), getattr(r, k))
    assert torch.equal(again.returns, returns)
    fresh = CriticProbe(prompts=4, n=3)
    fresh.on_train_start(module.trainer, module)  # (the trained policy answers otherwise)
    assert not torch.equal(fresh.probe.input_ids, r.input_ids)


def test_the_probe_needs_a_critic_and_validation_data(tmp_path, tok):
    from vapo_lightning.config import Algorithm

    module = tiny_module(tok, algorithm=Algorithm(advantage="group", mini_batch_size=8, micro_batch_size=4))
    with pytest.raises(ValueError, match="CriticProbe needs a critic"):
        tiny_trainer(tmp_path, max_steps=1, callbacks=[CriticProbe()]).fit(module, tiny_data(tmp_path))
