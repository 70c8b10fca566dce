"""`CriticProbe`: what the critic knows, on answers it never trained on.

The critic's `critic/vf_explained_var` is measured on the batch it is about to learn from;
a probe set measures it on a fixed set of held-out rollouts: answers sampled once, at the
start of the run, from the initial policy, to validation prompts (which no update sees).
The same answers every time, so the curve shows the critic learning, not the batch
changing. Logged as ``critic_probe/*`` (`critic_checks.check_critic`): explained variance,
by the tenth of the response, calibration of V(s_0) against each prompt's success rate,
and the return's variance the critic removes against the group mean's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from torch import Tensor

from vapo_lightning.advantages import monte_carlo_returns
from vapo_lightning.critic_checks import check_critic
from vapo_lightning.packing import ROWS, layout_for
from vapo_lightning.rollout import Rollout
from vapo_lightning.updates import Forwards, compute_values

__all__ = ["CriticProbe"]

PROBE_SEED = 4321  # the probe's answers: the same draws in every run
PROBE_FIELDS = ("input_ids", "attention_mask", "response_mask", "group_ids", "truncated", "scores", "correct")


class CriticProbe(L.Callback):
    """Scores the critic on `prompts` validation prompts × `n` answers each, sampled once at
    the start from the initial policy at the run's generation settings: before training
    (step 0) and every `every_n_steps` rollout steps.

    Args:
        prompts: validation prompts in the probe (the first ones of data.val).
        n: answers to each (None: the run's `generation.n`); ≥ 2 for the calibration.
        every_n_steps: rollout steps between probes.
    """

    def __init__(self, prompts: int = 32, n: int | None = None, every_n_steps: int = 1) -> None:
        if prompts < 1 or (n is not None and n < 1) or every_n_steps < 1:
            raise ValueError("CriticProbe: prompts, n and every_n_steps must be >= 1")
        self.prompts, self.n, self.every_n_steps = prompts, n, every_n_steps
        self.probe: Rollout | None = None
        self.returns: Tensor | None = None  # (B, T) the probe's λ = 1 returns, the critic's targets
        self.layout = ROWS  # how the probe's rows go through the critic

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        dm = getattr(trainer, "datamodule", None)
        if pl_module.critic is None or dm is None or not getattr(dm, "val_rows", None):
            raise ValueError("CriticProbe needs a critic (advantage='gae') and validation data (data.val)")
        if self.probe is None:  # (a resumed run has the first run's probe, from its checkpoint)
            self.probe = self.sample(trainer, pl_module, dm.val_rows[: self.prompts])
        r = self.probe
        self.returns = monte_carlo_returns(r.scores, r.response_mask, pl_module.algo.gamma)
        self.layout = layout_for(r.group_ids, pl_module.algo)
        if trainer.global_step == 0:  # (a resumed run scored its start already)
            self.write(trainer, pl_module)

    def sample(self, trainer: L.Trainer, pl_module: Any, rows: list[dict]) -> Rollout:
        """The probe's answers and rewards; every rank draws the same (one seed), so every
        rank holds the whole probe and no measurement needs the others."""
        gen = replace(pl_module.gen, n=self.n or pl_module.gen.n)
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), trainer.precision_plugin.forward_context():
            torch.manual_seed(PROBE_SEED)
            r = pl_module.sample(rows, gen)
        pl_module.engine(gen).release(keep_weights=True)
        pl_module.compute_rewards(r)
        return r

    def state_dict(self) -> dict[str, Any]:
        r = self.probe
        return {} if r is None else {"probe": {k: getattr(r, k).cpu() for k in PROBE_FIELDS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "probe" in state:
            probe = state["probe"]
            self.probe = Rollout(
                **{k: probe[k] for k in PROBE_FIELDS if k not in ("scores", "correct")},
                scores=probe["scores"],
                correct=probe["correct"],
            )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.write(trainer, pl_module)

    def write(self, trainer: L.Trainer, pl_module: Any) -> None:
        """Logged as validation is: at the number of rollout steps done (0: before training)."""
        metrics = self.measure(trainer, pl_module)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @torch.no_grad()
    def measure(self, trainer: L.Trainer, pl_module: Any) -> dict[str, float]:
        """The critic's checks on the probe (every rank the whole probe: a forward of the
        critic on each, as a sharded critic needs)."""
        r = self.probe
        with trainer.precision_plugin.forward_context():
            values = compute_values(pl_module.critic, r, Forwards(pl_module.algo.micro_batch_size, layout=self.layout))
        checks = check_critic(values, self.returns, r.scores, r.correct, r.group_ids, r.response_mask)
        return {f"critic_probe/{k}": v for k, v in checks.items() if math.isfinite(v)}  # (NaN: undefined)
