"""Does the critic know anything? Measurements of a value function against the returns it
predicts (VAPO §4.1 rests on a critic that explains the return; EVPO, arXiv 2604.19485,
shows a critic whose explained variance is ≤ 0 only adds noise to the advantages).

Pure functions of (B, T) values, returns and masks, and of per-response rewards and group
ids. Sums that span data-parallel ranks go through `global_sum` (a sum over ranks; the
identity in one process), so every rank gets the number one process would get over the
concatenated batch, not an average of per-rank ratios.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "GlobalSum",
    "baseline_shares",
    "calibration",
    "check_critic",
    "explained_variance",
    "explained_variance_by_position",
    "first_values",
    "position_masks",
]

GlobalSum = Callable[[Tensor], Tensor]


def _local(x: Tensor) -> Tensor:
    return x.float()


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, global_sum: GlobalSum = _local) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over the valid tokens of every rank (1: a
    perfect critic, 0: no better than the mean return, < 0: worse); NaN where the returns
    do not vary (`core.explained_variance`'s rule). values, returns, mask: (B, T)."""
    m = mask.bool()
    y = torch.where(m, returns.float(), 0.0)
    e = torch.where(m, (returns - values).float(), 0.0)
    n, sy, syy, se, see = global_sum(torch.stack([m.sum().float(), y.sum(), (y * y).sum(), e.sum(), (e * e).sum()]))
    dof = (n - 1).clamp(min=1)
    var_y = (syy - sy * sy / n.clamp(min=1)) / dof
    var_e = (see - se * se / n.clamp(min=1)) / dof
    ev = 1.0 - var_e / var_y.clamp(min=1e-8)
    return torch.where(var_y >= 1e-8, ev, torch.full_like(ev, float("nan")))


def position_masks(mask: Tensor, tenths: tuple[int, ...] = (0, 5, 9)) -> dict[int, Tensor]:
    """For each k in `tenths`, the (B, T) mask of the response tokens in the k-th tenth of
    their own response: token t of a response of L tokens is in tenth floor(10 t / L). Tenth
    0 always holds the first token, tenth 9 the last (for L ≥ 10; shorter responses: the
    tenths their tokens reach)."""
    m = mask.bool()
    t = torch.cumsum(m.long(), -1) - 1  # the token's index within its response
    length = m.sum(-1, keepdim=True).clamp(min=1)
    tenth = torch.div(10 * t, length, rounding_mode="floor")
    return {k: m & (tenth == k) for k in tenths}


def explained_variance_by_position(
    values: Tensor, returns: Tensor, mask: Tensor, global_sum: GlobalSum = _local
) -> dict[str, Tensor]:
    """Explained variance over the first, middle and last tenth of every response: a critic
    that only learns once it reads the answer's numbers explains little at the first tenth
    and more at the last."""
    names = {0: "first_tenth", 5: "middle_tenth", 9: "last_tenth"}
    return {names[k]: explained_variance(values, returns, m, global_sum) for k, m in position_masks(mask).items()}


def _pearson(x: Tensor, y: Tensor) -> Tensor:
    x, y = x.float() - x.float().mean(), y.float() - y.float().mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return torch.where(denom > 1e-12, (x * y).sum() / denom.clamp(min=1e-12), torch.full_like(denom, float("nan")))


def first_values(values: Tensor, mask: Tensor) -> Tensor:
    """(B,) the value at each response's first token: V(s_0), the critic's guess of the
    return before a word of the answer is read."""
    first = mask.bool().long().argmax(-1)
    return values.gather(1, first[:, None])[:, 0]


def calibration(v0: Tensor, success: Tensor, group_ids: Tensor) -> Tensor:
    """Pearson correlation over prompts between the mean of V(s_0) over a prompt's responses
    and the prompt's empirical success rate over them (v0, success, group_ids: (B,)); NaN
    where either does not vary."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if len(inverse) else 0
    counts = torch.zeros(k).index_add_(0, inverse.cpu(), torch.ones(len(inverse)))
    mean_v = torch.zeros(k).index_add_(0, inverse.cpu(), v0.float().cpu()) / counts
    rate = torch.zeros(k).index_add_(0, inverse.cpu(), success.float().cpu()) / counts
    return _pearson(mean_v, rate)


def baseline_shares(
    values: Tensor, scores: Tensor, group_ids: Tensor, mask: Tensor, global_sum: GlobalSum = _local
) -> dict[str, Tensor]:
    """The share of the return's variance each baseline removes, over the valid tokens of
    the λ = γ = 1 return (the final reward R at every token): the critic's V(s_t)
    (``critic``: its explained variance) and the group's mean reward (``group_mean``:
    GRPO's baseline, the response's own reward included). A critic earns its place where
    ``critic`` > ``group_mean``. Groups must lie whole on one rank."""
    returns = scores[:, None].float().expand_as(values)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if len(inverse) else 0
    sums = torch.zeros(k, device=scores.device).index_add_(0, inverse, scores.float())
    counts = torch.zeros(k, device=scores.device).index_add_(0, inverse, torch.ones_like(scores, dtype=torch.float))
    group_mean = (sums / counts)[inverse][:, None].expand_as(values)
    return {
        "critic": explained_variance(values, returns, mask, global_sum),
        "group_mean": explained_variance(group_mean, returns, mask, global_sum),
    }


def check_critic(
    values: Tensor, returns: Tensor, scores: Tensor, success: Tensor, group_ids: Tensor, mask: Tensor
) -> dict[str, float]:
    """Every measurement above, in one process, as metric names: ``explained_var``,
    ``explained_var/<tenth>``, ``value_loss`` (mean 0.5 (V - R)^2 per token), ``calibration``,
    ``baseline_share/critic``, ``baseline_share/group_mean``."""
    m = mask.bool()
    sq = torch.where(m, (values - returns).float(), 0.0).square().sum()
    out = {
        "explained_var": explained_variance(values, returns, mask),
        **{f"explained_var/{k}": v for k, v in explained_variance_by_position(values, returns, mask).items()},
        "value_loss": 0.5 * sq / m.sum().clamp(min=1),
        **{f"baseline_share/{k}": v for k, v in baseline_shares(values, scores, group_ids, mask).items()},
        "calibration": calibration(first_values(values, mask), success, group_ids),
    }
    return {k: float(v) for k, v in out.items()}
