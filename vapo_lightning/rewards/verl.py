"""Bring verl reward files unchanged: `fn(data_source, solution_str, ground_truth, extra_info)`.

--trainer.callbacks+=vapo_lightning.rewards.verl.VerlReward
--trainer.callbacks.path=my_rewards.py --trainer.callbacks.function=compute_score
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vapo_lightning.rewards.base import RewardCallback, Sample

__all__ = ["VerlReward", "load_function"]


def load_function(path: str, function: str) -> Callable[..., Any]:
    """Imports `function` from the Python file at `path` (a verl `custom_reward_function`)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"VerlReward: reward file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"vapo_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise AttributeError(f"VerlReward: {path} has no function {function!r}")
    return fn


class VerlReward(RewardCallback):
    """Calls a verl-style reward function once per sample.

    Args:
        path: the Python file holding the function.
        function: its name (verl's default: ``compute_score``).
        correct_threshold: a score above this counts as correct (accuracy metrics and the
            positive-example NLL); None: this reward is not a verifier.
        **kwargs: `RewardCallback`'s weight, on_error, error_value, timeout_s.

    The function may return a float or a dict with a ``"score"`` entry (as verl allows).
    """

    def __init__(
        self,
        path: str,
        function: str = "compute_score",
        correct_threshold: float | None = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fn = load_function(path, function)
        self.correct_threshold = correct_threshold
        self._name = f"VerlReward({Path(path).name}:{function})"

    @property
    def name(self) -> str:
        return self._name

    def score(self, samples: Sequence[Sample]) -> list[float | None]:
        out = []
        for s in samples:
            value = self.fn(s.data_source, s.response, s.ground_truth, dict(s.extra_info))
            out.append(value["score"] if isinstance(value, dict) else value)
        return out
