"""Reward callbacks: the plug-in API (`base`) and the built-in rewards.

The built-ins are imported on first use (module ``__getattr__``), so that importing the
plug-in API loads neither the sandbox nor the verl adapter; ``--trainer.callbacks+=
vapo_lightning.rewards.MathReward`` and ``vapo_lightning.rewards.math.MathReward`` name the
same class.
"""

from __future__ import annotations

import importlib
from typing import Any

from vapo_lightning.rewards.base import *  # noqa: F403 - the plug-in API is this package's
from vapo_lightning.rewards.base import __all__ as _api

_BUILT_IN = {
    "MathReward": "math",
    "MathVerifier": "math",
    "extract_answer": "math",
    "is_equivalent": "math",
    "CodeReward": "code",
    "VerlReward": "verl",
    "FormatReward": "format",
    "OverlongPenalty": "overlong",
    "SandboxFusionReward": "sandbox_fusion",
    "DigitwiseReward": "digitwise",
}
"""Each lazily exported name and the module of this package that defines it."""

__all__ = [*_api, *_BUILT_IN]


def __getattr__(name: str) -> Any:
    if name not in _BUILT_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_BUILT_IN[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_BUILT_IN})
