"""Validation: mean@k accuracy of sampled (or greedy) answers, overall and per data source.

Scored with the same reward callbacks as training (a verifier's `correct_threshold`
decides "correct"), accumulated with torchmetrics, logged as `val/accuracy` and
`val/accuracy/<data_source>`; with tools also `val/tools/share_of_responses` and
`val/tools/calls/mean`. Sampling uses a fixed seed per batch in a forked RNG, so
validation is reproducible and never perturbs the training random stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import MeanMetric, SumMetric

from vapo_lightning.callbacks import ValidationSamples
from vapo_lightning.metrics import PhaseTimer

__all__ = ["ValidationMixin"]


class ValidationMixin:
    """Mixed into VAPOModule; needs `sample`, `score`, `count_tool_use`, `val_gen` and
    `val_before_train`."""

    val_seed: int = 1234

    def _init_validation(self) -> None:
        self.val_accuracy = MeanMetric()
        self.val_accuracy_by_source = torch.nn.ModuleDict()
        self.val_tool_share, self.val_tool_calls = MeanMetric(), MeanMetric()
        self.val_reward_errors = SumMetric()

    @torch.no_grad()
    def validation_step(self, batch: list[dict], batch_idx: int) -> None:
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.val_seed + batch_idx)
            r = self.sample(batch, self.val_gen)
        self.count_tool_use(r, PhaseTimer())  # a failing tool is shown in validation too
        self.score(r)
        self.val_reward_errors.update(float(self.reward_errors))
        self.last_val_rollout = r  # for callbacks (ValidationSamples)
        correct = r.correct.float()
        self.val_accuracy.update(correct)
        if r.tool_calls is not None:
            self.val_tool_share.update((r.tool_calls > 0).float())
            self.val_tool_calls.update(r.tool_calls.float())
        for source in sorted({s.data_source for s in r.samples}):
            if source not in self.val_accuracy_by_source:
                self.val_accuracy_by_source[source] = MeanMetric().to(self.device)
            pick = torch.tensor([s.data_source == source for s in r.samples], device=correct.device)
            self.val_accuracy_by_source[source].update(correct[pick])

    def on_validation_epoch_end(self) -> None:
        metrics = self._compute_val_metrics()
        if not self.trainer.sanity_checking:
            self.log_dict(metrics, batch_size=1)
            self.log("val/acc", metrics["val/accuracy"], prog_bar=True, logger=False, batch_size=1)

    def _compute_val_metrics(self) -> dict[str, Any]:
        metrics = {
            "val/accuracy": self.val_accuracy.compute(),
            "val/reward_errors": self.val_reward_errors.compute(),
        }
        self.val_accuracy.reset()
        self.val_reward_errors.reset()
        if self.val_tool_share.update_count:
            metrics["val/tools/share_of_responses"] = self.val_tool_share.compute()
            metrics["val/tools/calls/mean"] = self.val_tool_calls.compute()
            self.val_tool_share.reset()
            self.val_tool_calls.reset()
        for source in self._sources_seen_on_any_rank():
            metric = self.val_accuracy_by_source[source]
            metrics[f"val/accuracy/{source}"] = metric.compute()  # syncs: same order on all ranks
            metric.reset()
        return metrics

    def _sources_seen_on_any_rank(self) -> list[str]:
        """The validation set's sources that some rank scored, sorted, each with a metric
        here (empty on a rank that saw none of its rows): every rank syncs the same metrics
        in the same order, where rank-local ones would pair different sources, or hang."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer else None
        known = sorted({row["data_source"] for row in getattr(dm, "val_rows", ())}
                       | set(self.val_accuracy_by_source))  # fmt: skip
        if not known:
            return []
        seen = torch.tensor([float(s in self.val_accuracy_by_source
                                   and self.val_accuracy_by_source[s].update_count > 0)
                             for s in known], device=self.device)  # fmt: skip
        if self._trainer is not None and self.trainer.world_size > 1:
            seen = self.all_gather(seen).reshape(-1, len(known)).amax(0)
        sources = [s for s, any_rank in zip(known, seen.tolist()) if any_rank]
        for source in sources:
            if source not in self.val_accuracy_by_source:
                self.val_accuracy_by_source[source] = MeanMetric().to(self.device)
        return sources

    def on_train_start(self) -> None:
        """Scores the validation set once before any update (logged at step 0)."""
        dm = getattr(self.trainer, "datamodule", None)
        if not self.val_before_train or dm is None or not getattr(dm, "has_val", False):
            return
        if self.trainer.global_step > 0:  # resumed: the run already scored its start
            return
        # Outside Lightning's validation loop, so the callbacks that record validation
        # generations are called here (a progress bar's validation hooks are not: it has no
        # validation bar now).
        recorders = [c for c in self.trainer.callbacks if isinstance(c, ValidationSamples)]
        for c in recorders:
            c.on_validation_epoch_start(self.trainer, self)
        for i, batch in enumerate(dm.val_dataloader()):
            self.validation_step(batch, i)
            for c in recorders:
                c.on_validation_batch_end(self.trainer, self, None, batch, i)
        for c in recorders:
            c.on_validation_epoch_end(self.trainer, self)
        metrics = {k: float(v) for k, v in self._compute_val_metrics().items()}
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=0)
        if self.trainer.is_global_zero:
            self.print(f"val/accuracy before training: {metrics['val/accuracy']:.3f}")
        self.initial_val_accuracy = metrics["val/accuracy"]
