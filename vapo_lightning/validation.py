"""Validation metrics: mean@k accuracy of sampled (or greedy) answers, overall and per data
source, accumulated with torchmetrics across batches and ranks.

Scored with the same reward callbacks as training (a verifier's `correct_threshold`
decides "correct"), logged as `val/accuracy` and `val/accuracy/<data_source>`, with the shares
of answers the math rules read and of boxed ones (`val/answer_share`, `val/boxed_share`); with tools
also `val/tools/share_of_responses` and `val/tools/calls/mean`. The module's validation hooks
(`ValidationHooks`, which `VAPOModule` takes its validation from) feed and read them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric, SumMetric

from vapo_lightning.callbacks import ValidationSamples
from vapo_lightning.metrics import answer_shares
from vapo_lightning.rollout import Rollout

__all__ = ["ValidationHooks", "ValidationMetrics", "run_validation"]

VAL_SEED = 1234  # validation samples the same draws at every validation


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
        metrics = {
            "val/accuracy": self.accuracy.compute(),
            "val/reward_errors": self.reward_errors.compute(),
            "val/answer_share": self.answered.compute(),
            "val/boxed_share": self.boxed.compute(),
        }
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


class ValidationHooks:
    """`VAPOModule`'s Lightning hooks of validation: the score before training, each
    validation batch sampled in a forked, seeded RNG, the metrics over ranks, and the engine
    given back its memory after. Reads the module's `sample`, `compute_rewards`, `val_gen`,
    `val_metrics` and `engines`."""

    def on_train_start(self) -> None:
        """Scores the validation set once before any update (logged at step 0)."""
        dm = getattr(self.trainer, "datamodule", None)
        if not self.val_before_train or dm is None or not getattr(dm, "has_val", False):
            return
        if self.trainer.global_step > 0:  # resumed: the run already scored its start
            return
        recorders = [c for c in self.trainer.callbacks if isinstance(c, ValidationSamples)]
        run_validation(self, dm.val_dataloader(), recorders)
        metrics = {k: float(v) for k, v in self.compute_val_metrics().items()}
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=0)
        if self.trainer.is_global_zero:
            self.print(f"val/accuracy before training: {metrics['val/accuracy']:.3f}")
        self.initial_val_accuracy = metrics["val/accuracy"]

    @torch.no_grad()
    def validation_step(self, batch: list[dict], batch_idx: int) -> None:
        """Samples (in a forked RNG, seeded per batch: the same draws at every validation,
        the training stream untouched) and scores one batch of validation prompts."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(VAL_SEED + batch_idx)
            r = self.sample(batch, self.val_gen)
        self.compute_rewards(r)
        self.last_val_rollout = r  # for callbacks (ValidationSamples)
        self.val_metrics.update(r)

    def on_validation_epoch_end(self) -> None:
        metrics = self.compute_val_metrics()
        if not self.trainer.sanity_checking:
            self.log_dict(metrics, batch_size=1)
            self.log("val/acc", metrics["val/accuracy"], prog_bar=True, logger=False, batch_size=1)

    def compute_val_metrics(self) -> dict[str, Any]:
        dm = getattr(self.trainer, "datamodule", None)
        known = {row["data_source"] for row in getattr(dm, "val_rows", ())}
        if self.trainer.world_size == 1:
            return self.val_metrics.compute(known, any_rank=lambda seen: seen)
        return self.val_metrics.compute(known, lambda seen: self.all_gather(seen).reshape(-1, len(seen)).amax(0))

    def on_validation_end(self) -> None:
        """Training goes on after validation: the engine gives its memory back, keeping its
        weights (the policy did not change)."""
        if self.val_gen.engine in self.engines:
            self.engines[self.val_gen.engine].release(keep_weights=True)
