"""A format reward: does the response end with exactly one final answer in \\boxed{}?

--trainer.callbacks+=vapo_lightning.rewards.format.FormatReward --trainer.callbacks.weight=0.1
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vapo_lightning.rewards.base import RewardCallback, Sample
from vapo_lightning.rewards.math_answers import last_box_span

# what may follow the final box: space, a full stop, closing math delimiters ($, $$, \], \))
_AFTER_BOX = re.compile(r"(?:\s|\.|\$|\\\]|\\\))*")


def ends_with_box(response: str) -> bool:
    """The last ``\\boxed{...}`` (braces balanced to any depth) closes the response, up to a
    full stop and closing math delimiters: ``$\\boxed{\\frac{\\sqrt{3}}{2}}$.``."""
    span = last_box_span(response)
    return span is not None and _AFTER_BOX.fullmatch(response, span[2]) is not None


class FormatReward(RewardCallback):
    """`good` when the response ends with its one final answer and is not truncated, else
    `bad`.

    Args:
        pattern: a regular expression searched in the response in place of the default
            check (`ends_with_box`: one \\boxed{...} answer at the very end).
        max_answers: responses with more \\boxed{} than this get `bad` (answer spraying).
        good, bad: the two reward values.
    """

    def __init__(
        self,
        pattern: str | None = None,
        max_answers: int = 1,
        good: float = 1.0,
        bad: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.matches = re.compile(pattern).search if pattern is not None else ends_with_box
        self.max_answers, self.good, self.bad = max_answers, good, bad

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [
            self.good
            if not s.truncated and s.response.count("\\boxed") <= self.max_answers and self.matches(s.response)
            else self.bad
            for s in samples
        ]
