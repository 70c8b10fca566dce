"""The README's plug-in: a bonus for short responses that contain a boxed answer.

    vapo fit -c configs/quickstart.yaml \
      --trainer.callbacks+=examples.rewards.short_answer.ShortAnswerBonus --trainer.callbacks.weight=0.1
"""

from vapo_lightning.rewards import RewardCallback, Sample


class ShortAnswerBonus(RewardCallback):
    """+1 for responses under `limit` tokens that contain a boxed answer, else 0."""

    def __init__(self, limit: int = 100, **kwargs):
        super().__init__(**kwargs)  # weight, on_error, error_value, timeout_s
        self.limit = limit

    def score(self, samples: list[Sample]) -> list[float]:
        # Sample: prompt, response, response_ids, truncated, ground_truth, data_source, extra_info
        return [float(len(s.response_ids) < self.limit and "\\boxed" in s.response) for s in samples]
