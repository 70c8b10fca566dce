"""Reward callbacks: the plug-in API and the built-in math and code rewards."""

from vapo_lightning.rewards.base import (
    RewardCallback,
    RewardError,
    RewardOutcome,
    Sample,
    SampleError,
    combine_rewards,
)

__all__ = [
    "RewardCallback",
    "RewardError",
    "RewardOutcome",
    "Sample",
    "SampleError",
    "combine_rewards",
]
