"""DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) as a reward callback.

--trainer.callbacks+=vapo_lightning.rewards.overlong.OverlongPenalty
--trainer.callbacks.max_length=512 --trainer.callbacks.cache_length=128
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vapo_lightning.core import overlong_penalty
from vapo_lightning.rewards.base import RewardCallback, Sample


class OverlongPenalty(RewardCallback):
    """0 up to `max_length - cache_length` tokens, then a linear penalty reaching -1 at
    `max_length`, and -1 beyond (responses cut at max_new_tokens hit -1 or close to it).

    Args:
        max_length: L_max, usually `model.generation.max_new_tokens`.
        cache_length: L_cache, the width of the soft window.
    """

    def __init__(self, max_length: int, cache_length: int, **kwargs: Any) -> None:
        if not 0 < cache_length <= max_length:
            raise ValueError("OverlongPenalty: need 0 < cache_length <= max_length")
        super().__init__(**kwargs)
        self.max_length, self.cache_length = max_length, cache_length

    def score(self, samples: Sequence[Sample]) -> list[float]:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        return overlong_penalty(lengths, self.max_length, self.cache_length).tolist()
