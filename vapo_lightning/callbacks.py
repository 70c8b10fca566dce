"""Built-in callbacks: value pretraining (VAPO §4.1), entropy tracking, training and
validation samples to JSONL (and TensorBoard) and the progress bar.

Callbacks change the module's state and log; they never compute losses.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.utilities import rank_zero_warn

from vapo_lightning import core

__all__ = [
    "EntropyTracker",
    "StepLog",
    "TrainingSamples",
    "ValidationSamples",
    "ValuePretraining",
    "progress_bar",
]


class _RolloutBar:
    """Shows ``step k/max_steps``, seconds per rollout step (a rate in it/s reads 0.00 for
    steps of minutes), reward, accuracy and reward errors; no epoch, no v_num."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        step = items.pop("rollout_step", None)
        if step is not None:
            limit = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
            seconds = trainer.callback_metrics.get("timing_s/step")
            per_step = {} if seconds is None else {"s/step": f"{float(seconds):.1f}"}
            items = {"step": f"{int(step)}{limit}", **per_step, **items}
        return items

    @property
    def total_train_batches(self) -> int | float:
        """Lightning's total for a run that ends by max_steps counts the steps left from now,
        while the bar counts this epoch's batches from 0: a resumed run read ``3/0``. The
        batches this epoch already did count in the total too."""
        total, epoch = super().total_train_batches, self.trainer.num_training_batches
        if total < epoch:
            total = min(epoch, total + self.trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        return total


class RolloutRichBar(_RolloutBar, RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'Rollouts':{len(self.validation_description)}}"


class RolloutTQDMBar(_RolloutBar, TQDMProgressBar):
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("Rollouts")


class StepLog(L.Callback):
    """One line per rollout step on stdout, for a run whose output goes to a file or a pipe,
    where no progress bar shows: a slow step can be told from a hang.

        [04:31:02] step 3/30  51.2 s  reward 0.120  accuracy 0.188  length 84  gen 26.1 s, ...
    """

    PHASES = ("gen", "reward", "old_log_prob", "values", "update_critic", "update_actor")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not trainer.is_global_zero:
            return
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        limit = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        phases = ", ".join(f"{k} {m[f'timing_s/{k}']:.1f} s" for k in self.PHASES if m.get(f"timing_s/{k}", 0) > 0)
        parts = [
            f"step {trainer.global_step}{limit}",
            f"{m.get('timing_s/step', float('nan')):.1f} s",
            f"reward {m.get('reward', float('nan')):.3f}",
            f"accuracy {m.get('rollout/accuracy', float('nan')):.3f}",
            f"length {m.get('response_length/mean', float('nan')):.0f}",
        ]
        if m.get("warmup/active"):
            parts.append("value pretraining")
        print(
            f"[{datetime.datetime.now():%H:%M:%S}] " + "  ".join(parts) + (f"  ({phases})" if phases else ""),
            flush=True,
        )


def progress_bar() -> L.Callback:
    """The progress bar Lightning would pick (rich when installed), showing rollout steps."""
    return RolloutRichBar() if _RICH_AVAILABLE else RolloutTQDMBar()


class ValuePretraining(L.Callback):
    """Value pretraining (VAPO §4.1, §5.1): for the first `steps` rollout steps only the
    critic learns, on lambda = 1 Monte-Carlo targets, from the fixed initial policy.

    The phase is the module's (`VAPOModule.value_pretraining_at`, decided from the rollout
    step's index and logged as `warmup/active`); this callback is where a config asks for it,
    and hands the settings to the module once, at setup.

    Args:
        steps: rollout steps of warm-up (paper: 50).
        explained_variance_threshold: end early once the critic's explained variance on a
            fresh rollout reaches this (None: always run `steps`).
        save_dir: save the warmed-up critic here (HF format); a later run loads it with
            `--model.critic.name_or_path=<save_dir>` and leaves this callback out.
    """

    def __init__(
        self,
        steps: int = 50,
        explained_variance_threshold: float | None = None,
        save_dir: str | None = None,
    ) -> None:
        if steps < 0:
            raise ValueError("ValuePretraining.steps must be >= 0")
        self.steps = steps
        self.threshold = explained_variance_threshold
        self.save_dir = save_dir

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not pl_module.algo.uses_critic:
            raise ValueError("ValuePretraining needs a critic: remove it for advantage='group' (GRPO/DAPO)")
        pl_module.value_pretraining_steps = self.steps  # (a resumed run: its checkpoint's)
        pl_module.value_pretraining_threshold = self.threshold
        pl_module.value_pretraining_save_dir = self.save_dir


class EntropyTracker(L.Callback):
    """Per-token entropy of the sampled responses: mean, by response-length bucket, and a
    TensorBoard histogram; warns once on collapse or blow-up.

    Collapse is judged against the run's own early entropy (the mean of its first
    `reference_steps` rollout steps): a task whose answers are short and certain has a low
    entropy from the start, so a fixed threshold would fire on a run that learns well.

    Args:
        length_buckets: upper bounds (tokens) of the response-length buckets.
        collapse_fraction: warn when the mean entropy falls below this fraction of the early
            entropy (None: not judged this way).
        reference_steps: rollout steps whose mean entropy is the early entropy.
        collapse_below: also warn below this absolute entropy, in nats (None: not judged).
        blowup_above: warn when it rises above this (nats).
        histogram_every: log a histogram every this many rollout steps (0: never).
    """

    def __init__(
        self,
        length_buckets: Sequence[int] = (32, 128, 512, 2048),
        collapse_fraction: float | None = 0.1,
        reference_steps: int = 5,
        collapse_below: float | None = None,
        blowup_above: float = 5.0,
        histogram_every: int = 1,
    ) -> None:
        self.length_buckets = sorted(length_buckets)
        self.collapse_fraction, self.reference_steps = collapse_fraction, max(1, reference_steps)
        self.collapse_below, self.blowup_above = collapse_below, blowup_above
        self.histogram_every = histogram_every
        self.early: list[float] = []  # mean entropy of the first `reference_steps` steps
        self.warned: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        return {"early": self.early, "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.early, self.warned = list(state["early"]), set(state["warned"])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = pl_module.last_step
        if step.old.entropy is None:  # on-policy, a step without actor update: not taken
            return
        r, ent = step.rollout, step.old.entropy
        mask = r.response_mask
        mean = float(core.masked_mean(ent, mask))
        metrics = {"rollout/entropy": mean}
        lengths, lower = r.response_lengths, 0
        for upper in self.length_buckets:
            rows = (lengths > lower) & (lengths <= upper)
            if rows.any():
                metrics[f"rollout/entropy_by_length/{lower + 1}-{upper}"] = float(
                    core.masked_mean(ent[rows], mask[rows])
                )
            lower = upper
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self._warn(mean, trainer.global_step)
        step = trainer.global_step
        if self.histogram_every and step % self.histogram_every == 0:
            for logger in trainer.loggers:
                exp = getattr(logger, "experiment", None)
                if hasattr(exp, "add_histogram"):
                    exp.add_histogram("rollout/entropy_tokens", ent[mask.bool()].float().cpu(), step)

    def _collapsed(self, mean: float) -> str | None:
        """Why `mean` counts as a collapse (None: it does not)."""
        if len(self.early) < self.reference_steps:
            self.early.append(mean)
            return None
        early = sum(self.early) / len(self.early)
        if self.collapse_fraction is not None and mean < self.collapse_fraction * early:
            return (
                f"below {self.collapse_fraction:g} × this run's early entropy ({early:.4f} nats, "
                f"the mean of its first {len(self.early)} rollout steps)"
            )
        if self.collapse_below is not None and mean < self.collapse_below:
            return f"below collapse_below={self.collapse_below} nats"
        return None

    def _warn(self, mean: float, step: int) -> None:
        collapse = self._collapsed(mean)
        if collapse and "collapse" not in self.warned:
            self.warned.add("collapse")
            rank_zero_warn(
                f"entropy collapse: mean token entropy of the sampled responses is {mean:.4f} "
                f"nats at rollout step {step}, {collapse}. The policy is nearly deterministic: "
                "exploration has stopped; consider a larger clip_high, a lower learning rate or "
                "an entropy bonus."
            )
        if mean > self.blowup_above and "blow-up" not in self.warned:
            self.warned.add("blow-up")
            rank_zero_warn(
                f"entropy blow-up: mean token entropy of the sampled responses is {mean:.4f} nats "
                f"at rollout step {step} (threshold {self.blowup_above}). Sampling is close to "
                "uniform noise: lower the learning rate or check the rewards."
            )


class ValidationSamples(L.Callback):
    """Writes every validation generation to a JSONL file, one object per response:
    ``step, data_source, prompt, response, response_tokens, reward, correct, ground_truth``
    (``response_tokens``: the response's length in tokens, its last one and any tool
    observations included), and the row's
    ``difficulty`` where the data has one, ``tool_calls`` in runs with tools.

    Args:
        path: the file; each validation run appends to it (under several processes, rank r
            writes ``<path>.rank<r>``). None: ``val_samples.jsonl`` in the trainer's
            ``default_root_dir``.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._file: Any = None

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = self.path or Path(trainer.default_root_dir) / "val_samples.jsonl"
        if trainer.world_size > 1:
            path = path.with_name(f"{path.name}.rank{trainer.global_rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        r = getattr(pl_module, "last_val_rollout", None)
        if self._file is None or r is None:
            return
        calls = [None] * len(r) if r.tool_calls is None else r.tool_calls.tolist()
        for sample, reward, correct, n_calls in zip(r.samples, r.scores.tolist(), r.correct.tolist(), calls):
            row = {
                "step": trainer.global_step,
                "data_source": sample.data_source,
                "prompt": sample.prompt,
                "response": sample.response,
                "response_tokens": len(sample.response_ids),
                "reward": reward,
                "correct": bool(correct),
                "ground_truth": sample.ground_truth,
            }
            if "difficulty" in sample.extra_info:
                row["difficulty"] = sample.extra_info["difficulty"]
            if n_calls is not None:
                row["tool_calls"] = n_calls
            self._file.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TrainingSamples(L.Callback):
    """A few responses of every rollout step, as they were scored: appended to a JSONL file
    (``step, prompt, response, reward``, each reward callback's own score under ``scores``,
    ``correct, ground_truth, tokens, truncated``) and shown in TensorBoard's text tab
    (``rollout/samples``). `vapo fit` adds it (k 4) unless the config lists it.

    Args:
        k: responses per step, the first response of each of the first k prompts; 0: off.
        path: the file. None: ``train_samples.jsonl`` in the trainer's ``default_root_dir``.
            Rank 0 writes (its share of the batch).
    """

    def __init__(self, k: int = 4, path: str | None = None) -> None:
        if k < 0:
            raise ValueError(f"TrainingSamples.k must be >= 0, got {k}")
        self.k, self.path = k, None if path is None else Path(path)

    def rows(self, step: int, r: Any) -> list[dict]:
        """The first response of each of the first `k` groups of rollout `r`."""
        firsts = {}
        for i, g in enumerate(r.group_ids.tolist()):
            firsts.setdefault(g, i)
        lengths, out = r.response_lengths.tolist(), []
        for i in list(firsts.values())[: self.k]:
            s = r.samples[i]
            scores = {name: float(r.reward_parts[i, j]) for j, name in enumerate(r.reward_names)}
            out.append(
                {
                    "step": step,
                    "prompt": s.prompt,
                    "response": s.response,
                    "reward": float(r.scores[i]),
                    "scores": scores,
                    "correct": bool(r.correct[i]),
                    "ground_truth": s.ground_truth,
                    "tokens": lengths[i],
                    "truncated": bool(r.truncated[i]),
                }
            )
        return out

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        r = getattr(pl_module, "last_rollout", None)
        if not self.k or r is None or not trainer.is_global_zero:
            return
        step = trainer.global_step  # the rollout steps done, this one included
        rows = self.rows(step, r)
        path = self.path or Path(trainer.default_root_dir) / "train_samples.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
        text = "\n\n".join(as_markdown(row) for row in rows)
        for logger in trainer.loggers:
            exp = getattr(logger, "experiment", None)
            if hasattr(exp, "add_text"):
                exp.add_text("rollout/samples", text, step)


def as_markdown(row: dict) -> str:
    """One sample for TensorBoard's text tab: a heading line, prompt and response verbatim."""
    scores = ", ".join(f"{k} {v:g}" for k, v in row["scores"].items())
    verdict = "correct" if row["correct"] else "wrong"
    cut = ", truncated" if row["truncated"] else ""
    block = lambda text: "\n".join("    " + line for line in str(text).splitlines())  # noqa: E731
    return (
        f"**reward {row['reward']:g}** ({scores}), {verdict}, {row['tokens']} tokens{cut}; "
        f"ground truth `{row['ground_truth']}`\n\n{block(row['prompt'])}\n\n"
        f"{block(row['response'])}"
    )
