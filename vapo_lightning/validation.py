"""Validation metrics: mean@k accuracy of sampled (or greedy) answers, overall and per data
source, accumulated with torchmetrics across batches and ranks.

Scored with the same reward callbacks as training (a verifier's `correct_threshold`
decides "correct"), logged as `val/accuracy` and `val/accuracy/<data_source>`, with the shares
of answers the math rules read and of boxed ones (`val/answer_share`, `val/boxed_share`); with tools
also `val/tools/share_of_responses` and `val/tools/calls/mean`. The module's validation hooks
(`VAPOModule.validation_step`, `on_validation_epoch_end`) feed and read them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric, SumMetric

from vapo_lightning.metrics import answer_shares
from vapo_lightning.rollout import Rollout

__all__ = ["ValidationMetrics", "run_validation"]


class ValidationMetrics(torch.nn.Module):
    """One validation's accumulators (none of them in checkpoints)."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracy = MeanMetric()
        self.by_source = torch.nn.ModuleDict()
        self.tool_share, self.tool_calls = MeanMetric(), MeanMetric()
        self.reward_errors = SumMetric()
        self.answered, self.boxed = MeanMetric(), MeanMetric()  # `metrics.answer_shares`

    def update(self, r: Rollout) -> None:
        """Adds one scored validation batch."""
        self.reward_errors.update(float(r.reward_errors))
        correct = r.correct.float()
        self.accuracy.update(correct)
        shares = answer_shares("val", [s.response for s in r.samples])
        self.answered.update(shares["val/answer_share"], weight=len(r.samples))
        self.boxed.update(shares["val/boxed_share"], weight=len(r.samples))
        if r.tool_calls is not None:
            self.tool_share.update((r.tool_calls > 0).float())
            self.tool_calls.update(r.tool_calls.float())
        for source in sorted({s.data_source for s in r.samples}):
            pick = torch.tensor([s.data_source == source for s in r.samples], device=correct.device)
            self.source(source, correct.device).update(correct[pick])

    def source(self, name: str, device: torch.device | str = "cpu") -> MeanMetric:
        if name not in self.by_source:
            self.by_source[name] = MeanMetric().to(device)
        return self.by_source[name]

    def compute(self, known: Iterable[str], any_rank: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """The metrics over every rank's batches, then reset. `known`: the validation set's
        sources; `any_rank`: a 0/1 vector's maximum over ranks."""
        metrics = {"val/accuracy": self.accuracy.compute(), "val/reward_errors": self.reward_errors.compute(),
                   "val/answer_share": self.answered.compute(), "val/boxed_share": self.boxed.compute()}  # fmt: skip
        for metric in (self.accuracy, self.reward_errors, self.answered, self.boxed):
            metric.reset()
        if self.tool_share.update_count:
            metrics["val/tools/share_of_responses"] = self.tool_share.compute()
            metrics["val/tools/calls/mean"] = self.tool_calls.compute()
            self.tool_share.reset()
            self.tool_calls.reset()
        for source in self.sources_seen_on_any_rank(known, any_rank):
            metric = self.by_source[source]
            metrics[f"val/accuracy/{source}"] = metric.compute()  # syncs: same order on all ranks
            metric.reset()
        return metrics

    def sources_seen_on_any_rank(self, known: Iterable[str], any_rank: Callable[[Tensor], Tensor]) -> list[str]:
        """The sources that some rank scored, sorted, each with a metric here (empty on a
        rank that saw none of its rows): every rank syncs the same metrics in the same order,
        where rank-local ones would pair different sources, or hang."""
        known = sorted(set(known) | set(self.by_source))
        if not known:
            return []
        device = self.accuracy.device
        seen = torch.tensor(
            [float(s in self.by_source and self.by_source[s].update_count > 0) for s in known],
            device=device,
        )
        sources = [s for s, seen_somewhere in zip(known, any_rank(seen).tolist()) if seen_somewhere]
        for source in sources:
            self.source(source, device)
        return sources


def run_validation(module: Any, batches: Iterable[list[dict]], recorders: list[Any]) -> None:
    """`module.validation_step` over `batches` outside Lightning's validation loop (the score
    before training), calling the callbacks that record validation generations (`recorders`)
    as the loop would; a progress bar's validation hooks are not called (it has no validation
    bar then)."""
    for c in recorders:
        c.on_validation_epoch_start(module.trainer, module)
    for i, batch in enumerate(batches):
        module.validation_step(batch, i)
        for c in recorders:
            c.on_validation_batch_end(module.trainer, module, None, batch, i)
    for c in recorders:
        c.on_validation_epoch_end(module.trainer, module)
