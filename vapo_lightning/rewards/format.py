"""A format reward: does the response end with exactly one final answer in \\boxed{}?

--trainer.callbacks+=vapo_lightning.rewards.format.FormatReward --trainer.callbacks.weight=0.1
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vapo_lightning.rewards.base import RewardCallback, Sample

BOXED_AT_END = r"\\boxed\{[^{}]*(\{[^{}]*\}[^{}]*)*\}\s*\.?\s*$"


class FormatReward(RewardCallback):
    """`good` when the response matches `pattern` and is not truncated, else `bad`.

    Args:
        pattern: a regular expression searched in the response (default: one \\boxed{...}
            answer at the very end).
        max_answers: responses with more \\boxed{} than this get `bad` (answer spraying).
        good, bad: the two reward values.
    """

    def __init__(
        self,
        pattern: str = BOXED_AT_END,
        max_answers: int = 1,
        good: float = 1.0,
        bad: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pattern = re.compile(pattern)
        self.max_answers, self.good, self.bad = max_answers, good, bad

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [
            self.good
            if not s.truncated
            and s.response.count("\\boxed") <= self.max_answers
            and self.pattern.search(s.response)
            else self.bad
            for s in samples
        ]
