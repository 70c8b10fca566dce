"""DAPO's dynamic sampling (`model.algorithm.dynamic_sampling_rounds`): a group whose answers
all agree (all right or all wrong; or, with `dynamic_sampling_metric: reward`, all scored
alike) has no group-normalised advantage, so it is dropped and fresh prompts are sampled, for
a bounded number of rounds; then every rank keeps as many responses.

A function of how a round is drawn and how the ranks agree: the module hands it its sampler
and its collectives, and every rank runs as many rounds as the neediest (a sharded model's
sampling is collective).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from vapo_lightning import core
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout, cat_rollouts

__all__ = ["agreement", "sample_in_rounds"]


def agreement(r: Rollout, algo: Algorithm) -> Tensor:
    """(B,) what a kept group's answers must differ in: correctness, or the total reward."""
    return r.correct.float() if algo.dynamic_sampling_metric == "correct" else r.scores


def sample_in_rounds(
    draw: Callable[[list[dict]], Rollout],
    rows: list[dict],
    n: int,
    algo: Algorithm,
    any_rank_short: Callable[[bool], bool],
    more_prompts: Callable[[int], list[dict]],
    smallest: Callable[[int], int],
) -> tuple[Rollout, list[Rollout]]:
    """(the step's rollout, every round drawn): `draw` samples and scores n answers to each
    row; without dynamic sampling one round as drawn. With it, the informative groups of each
    round are kept until there are len(rows) × n answers or the rounds run out, on every rank
    as long as any rank is short (`any_rank_short`), with `more_prompts(k)` for each further
    round; then cut to the fewest any rank has (`smallest`), so every rank makes as many
    optimiser steps."""
    rounds, want = algo.dynamic_sampling_rounds, len(rows) * n
    kept: list[Rollout] = []
    seen: list[Rollout] = []
    for round_ in range(rounds + 1):
        r = draw(rows)
        seen.append(r)
        if not rounds:
            return r, seen
        informative = r.select(core.informative_groups(agreement(r, algo), r.group_ids))
        if len(informative):
            kept.append(informative)
        have = sum(len(x) for x in kept)
        if round_ == rounds or not any_rank_short(have < want):
            break
        rows = more_prompts(max(1, -(-(want - have) // n)))
    if not kept:  # every group uniform in every round: zero advantages
        what = "correctness" if algo.dynamic_sampling_metric == "correct" else "rewards"
        rank_zero_warn(f"dynamic sampling: every group's answers had equal {what} in {rounds + 1} rounds")
        kept = [seen[-1]]
    r = cat_rollouts(kept)
    return r.select(torch.arange(smallest(min(len(r), want)))), seen
