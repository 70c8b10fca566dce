"""The digitwise task's verifier as a reward (`vapo_lightning.tasks.digitwise`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vapo_lightning.rewards.base import RewardCallback, Sample, SampleError
from vapo_lightning.tasks import digitwise

__all__ = ["DigitwiseReward"]


class DigitwiseReward(RewardCallback):
    """`correct_reward` when the response is the task's labelled steps and the digits they
    write are the answer (`digitwise.is_correct`), `wrong_reward` otherwise (VAPO's +1 / -1,
    §5.1). A pure string check, run in the trainer's process.

    Args:
        correct_reward: reward of a correct response.
        wrong_reward: reward of any other response.
        **kwargs: `RewardCallback`'s ``weight``, ``on_error``, ``error_value``, ...
    """

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = -1.0, **kwargs: Any) -> None:
        kwargs.setdefault("timeout_s", None)
        super().__init__(**kwargs)
        if not correct_reward > wrong_reward:
            raise ValueError("DigitwiseReward: correct_reward must be greater than wrong_reward")
        self.correct_reward, self.wrong_reward = float(correct_reward), float(wrong_reward)
        self.correct_threshold = (self.correct_reward + self.wrong_reward) / 2

    def score(self, samples: Sequence[Sample]) -> list[float | SampleError]:
        out: list[float | SampleError] = []
        for s in samples:
            answer = s.ground_truth
            if not isinstance(answer, str) or not answer.isdigit():
                out.append(SampleError(f"ground truth {answer!r} is not a digit string", "bad ground truth"))
                continue
            ok = digitwise.is_correct(s.response, answer)
            out.append(self.correct_reward if ok else self.wrong_reward)
        return out
