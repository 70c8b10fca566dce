"""VAPOModule: the policy and the critic, trained by VAPO with manual optimisation.

One `training_step` is one rollout step of the paper's algorithm box:
rollout (group sampling) -> reward -> old log-probs and values -> decoupled, length-adaptive
GAE -> `ppo_epochs` × mini-batches × micro-batches of critic and actor updates with global
token normalisers. The math lives in `core`; this file only orchestrates.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Container
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from vapo_lightning import core
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.distributed import builds_on_meta, parallelize, save_pretrained
from vapo_lightning.engines import RolloutEngines
from vapo_lightning.metrics import ALIASES, PhaseTimer, rollout_metrics
from vapo_lightning.models import ModelSpec, build_critic, build_policy, load_tokenizer
from vapo_lightning.rewards.base import RewardCallback, combine_rewards
from vapo_lightning.rollout import (
    Rollout,
    cat_rollouts,
    critic_values,
    policy_logits,
)
from vapo_lightning.tools.base import Tool, from_spec, spec
from vapo_lightning.updates import PPOUpdates, as_list
from vapo_lightning.validation import ValidationMixin

__all__ = ["VAPOModule"]


class VAPOModule(PPOUpdates, RolloutEngines, ValidationMixin, L.LightningModule):
    """Policy + critic trained with VAPO (arXiv 2504.05118), or PPO / GRPO / DAPO by switches.

    Args:
        policy: the actor: a path / hub id, or a config for a random init.
        critic: the critic's own source (e.g. a reward model or a warmed-up critic);
            None: the policy's backbone with a fresh value head.
        algorithm: VAPO's techniques and PPO's knobs (see `Algorithm`).
        generation: how rollouts are sampled (group size n, temperature, lengths).
        optim: AdamW learning rates, warm-up, gradient clipping.
        val_generation: how validation samples (k = n samples per prompt, mean@k).
        tools: tools the policy may call mid-response (`vapo_lightning.tools`), in training
            and validation rollouts; observations are context, never actions.
        val_before_train: score the validation set once before the first update.
        hf_export_dir: at the end of fit, save policy (with tokenizer) and critic here in
            Hugging Face format (`<dir>/policy`, `<dir>/critic`).
        torch_compile: `torch.compile` the policy and the critic (whole models; verl's
            use_torch_compile compiles only its entropy function) for every forward except
            the sampler's, whose KV cache grows at each step (it runs
            eager). Fuses the elementwise work of the updates: one actor update 1.24× (fp32)
            and 1.36× (bf16) faster on a CPU (`benchmarks/results/compile_cpu.md`), after a
            compile of tens of seconds per model at the first step and at the first new
            batch shape.
    """

    def __init__(
        self,
        policy: ModelSpec,
        critic: ModelSpec | None = None,
        algorithm: Algorithm | None = None,
        generation: Generation | None = None,
        optim: Optim | None = None,
        val_generation: Generation | None = None,
        tools: list[Tool] | None = None,
        val_before_train: bool = True,
        hf_export_dir: str | None = None,
        torch_compile: bool = False,
    ) -> None:
        super().__init__()
        # Dicts are accepted too (hyper-parameters of a checkpoint, `load_from_checkpoint`).
        policy, critic, algorithm, generation, optim, val_generation = (
            cls(**v) if isinstance(v, dict) else v
            for cls, v in [(ModelSpec, policy), (ModelSpec, critic), (Algorithm, algorithm),
                           (Generation, generation), (Optim, optim), (Generation, val_generation)]
        )  # fmt: skip
        self.policy_spec, self.critic_spec = policy, critic
        self.algo = algorithm or Algorithm()
        self.gen = generation or Generation()
        self.optim = optim or Optim()
        self.val_gen = val_generation or Generation(
            n=1, temperature=0.0, max_new_tokens=self.gen.max_new_tokens
        )
        self.gen.engine = self.gen.engine or "native"
        self.val_gen.engine = self.val_gen.engine or self.gen.engine  # validation follows
        self.tools = [from_spec(t) for t in tools or []]
        self.val_before_train = val_before_train
        self.hf_export_dir = hf_export_dir
        if torch_compile and not hasattr(torch.compiler, "set_stance"):
            raise ValueError(
                f"model.torch_compile needs torch >= 2.6 (torch.compiler.set_stance keeps the "
                f"sampler eager); this is torch {torch.__version__}. Upgrade torch, or set it false "
                "(load_from_checkpoint(..., torch_compile=False) for a compiled run's checkpoint)."
            )
        self.torch_compile = torch_compile
        hparams = {"policy": policy, "critic": critic, "algorithm": self.algo, "generation": self.gen,
                   "optim": self.optim, "val_generation": self.val_gen, "tools": [spec(t) for t in self.tools],
                   "val_before_train": val_before_train,
                   "hf_export_dir": hf_export_dir, "torch_compile": torch_compile}  # fmt: skip
        # Plain dicts, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(
            {k: asdict(v) if is_dataclass(v) else v for k, v in hparams.items()}
        )
        self.automatic_optimization = False
        self.tokenizer = load_tokenizer(policy.tokenizer or policy.name_or_path)
        self.policy = self.critic = self.ref_policy = None
        self.actor_frozen = False  # set by ValuePretraining: only the critic learns
        self.last_rollout: Rollout | None = None  # for callbacks (EntropyTracker)
        self.bad_updates = {"actor": 0, "critic": 0}  # consecutive non-finite updates
        self.tool_errors, self._tool_errors_shown = 0, set()
        self._init_validation()
        self._init_engines()

    # ------------------------------------------------------------------ setup

    def configure_model(self) -> None:
        if self.policy is None:
            # fsdp: ranks > 0 build on the meta device; `parallelize` sends them rank 0's weights
            meta = builds_on_meta(self)
            self.policy = build_policy(self.policy_spec, self.tokenizer, meta=meta)
            if self.algo.uses_critic:
                self.critic = build_critic(self.critic_spec, self.policy, self.tokenizer, meta=meta)
            if self.algo.kl_coef > 0:
                self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval()
        parallelize(self)  # --trainer.strategy=ddp|fsdp: replicate / shard each model
        if self.torch_compile:  # in place: same parameters and state_dict keys, hooks included
            # Policy and critic share one code object (transformers' forward wrapper), and each
            # needs a few graphs (grad / no grad, static then dynamic shapes, small / large
            # batches): past dynamo's default limit (8) they would fall back to eager (one
            # warning). Process-wide, and left raised.
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, name, max(getattr(cfg, name), 64))
            for model in (self.policy, self.critic):
                if model is not None:
                    model.compile()

    def configure_optimizers(self) -> Any:
        o = self.optim
        models = [(self.policy, o.actor_lr)] + ([(self.critic, o.critic_lr)] if self.critic else [])
        optimizers = [
            torch.optim.AdamW(m.parameters(), lr=lr, betas=o.betas, weight_decay=o.weight_decay)
            for m, lr in models
        ]
        warmup = lambda step: min(1.0, (step + 1) / (o.warmup_steps + 1))  # noqa: E731
        schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, warmup) for opt in optimizers]
        return optimizers, schedulers

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        per_step = getattr(dm, "prompts_per_step", None)
        if stage == "fit" and per_step is not None:
            batch = per_step * self.gen.n
            if batch % self.algo.mini_batch_size:
                raise ValueError(
                    f"model.algorithm.mini_batch_size={self.algo.mini_batch_size} must divide the rollout "
                    f"batch data.prompts_per_step × model.generation.n = {per_step} × {self.gen.n} = {batch}"
                )
        self.check_generation(dm)  # context, engine setup (`engines.RolloutEngines`)
        self.check_reward_callbacks()
        for tool in self.tools:
            tool.setup()  # (a sandbox pool per process)
        if self.algo.advantage == "group" and self.gen.n < 2:
            raise ValueError(
                "model.algorithm.advantage='group' (GRPO/DAPO) needs model.generation.n >= 2"
            )

    @property
    def reward_callbacks(self) -> list[RewardCallback]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, RewardCallback)]

    def check_reward_callbacks(self) -> None:
        """A callback with a `score` method that is no `RewardCallback` would be skipped
        without a word (its reward never reaching the sum): refuse it before any work."""
        for cb in self.trainer.callbacks:
            if callable(getattr(cb, "score", None)) and not isinstance(cb, RewardCallback):
                raise TypeError(
                    f"trainer.callbacks: {type(cb).__qualname__} has a score() method but is not "
                    "a vapo_lightning.rewards.RewardCallback, so its reward would be ignored; "
                    "subclass RewardCallback"
                )

    # ------------------------------------------------------------------ the algorithm box

    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        timer = PhaseTimer()
        with timer("step"):
            r = self.rollout_and_score(batch, timer)  # group sampling + rewards
            if not self.is_one_pass(r):  # else the updates' own forwards give pi_old, V_old
                with timer("old_log_prob"):
                    self.compute_old_logprobs(r)  # log pi_old, entropy (no grad)
                with timer("values"):
                    self.compute_values(r)  # V_old(s_t) (no grad)
                with timer("adv"):
                    self.compute_advantages(r)  # decoupled, length-adaptive GAE
            stats = self.update(r, timer)  # critic, then actor unless value pretraining
        self.last_rollout = r
        self.log_step(r, stats, timer)
        self._count_rollout_as_one_step()

    def rollout_and_score(self, batch: list[dict], timer: PhaseTimer) -> Rollout:
        """Samples n responses per prompt and scores them. DAPO's dynamic sampling keeps only
        groups whose rewards differ, drawing fresh prompts for a bounded number of rounds."""
        rounds, n = self.algo.dynamic_sampling_rounds, self.gen.n
        kept, rows, want, errors = [], batch, len(batch) * n, 0
        reward_metrics: Counter[str] = Counter()
        self.tool_errors = 0
        with timer("weight_sync"):  # vLLM: the policy's new weights into the engine
            self.sync_engine()
        for round_ in range(rounds + 1):
            with timer("gen"):
                r = self.sample(rows)
            self.count_tool_use(r, timer)
            with timer("reward"):
                self.score(r)
            errors += self.reward_errors
            reward_metrics.update(self.reward_metrics)
            if not rounds:
                self.release_engine()  # the models train next (a GPU engine sleeps)
                return r
            informative = r.select(core.informative_groups(r.scores, r.group_ids))
            if len(informative):
                kept.append(informative)
            have = sum(len(x) for x in kept)
            # Every rank runs as many rounds as the neediest one (sharded generate is collective).
            if round_ == rounds or self.global_sum(torch.tensor(float(have < want))) == 0:
                break
            rows = self.trainer.datamodule.sample_prompts(max(1, -(-(want - have) // n)))
        self.reward_errors, self.reward_metrics = errors, dict(reward_metrics)
        if not kept:  # every group uniform in every round: zero advantages, nothing to select
            rank_zero_warn(f"dynamic sampling: all groups had equal rewards in {rounds + 1} rounds")
            kept = [r]
        self.release_engine()
        r = cat_rollouts(kept)
        size = torch.tensor(min(len(r), want), device=self.device)
        if self.trainer.world_size > 1:  # equal batches: the same number of optimiser steps
            size = self.all_gather(size).min()
        return r.select(torch.arange(int(size)))

    def count_tool_use(self, r: Rollout, timer: PhaseTimer) -> None:
        """Tool time leaves `timing_s/gen` for `timing_s/tools`; each failed call counts in
        `tools/errors`, and each kind of failure is shown once, with its message."""
        if not self.tools:
            return
        timer.totals["tools"] += r.tool_seconds
        timer.totals["gen"] -= r.tool_seconds
        self.tool_errors += len(r.tool_errors)
        for tool, kind, message in r.tool_errors:
            if (tool, kind) not in self._tool_errors_shown:
                self._tool_errors_shown.add((tool, kind))
                rank_zero_warn(
                    f"tool {tool!r} failed ({kind}): {message} (counted in tools/errors)"
                )

    def score(self, r: Rollout) -> None:
        """Reward callbacks -> R per response (placed on the last token in `compute_advantages`)."""
        callbacks = self.reward_callbacks
        outcome = combine_rewards(callbacks, r.samples)
        r.scores = torch.tensor(outcome.rewards, dtype=torch.float32, device=self.device)
        verifiers = [
            (cb.correct_threshold, scores)
            for cb, scores in zip(callbacks, outcome.per_callback.values())
            if cb.correct_threshold is not None
        ]
        if verifiers:
            correct = [
                all(scores[i] > threshold for threshold, scores in verifiers) for i in range(len(r))
            ]
            r.correct = torch.tensor(correct, device=self.device)
        else:
            r.correct = r.scores > 0
        self.reward_errors = outcome.errors
        self.reward_metrics = outcome.metrics

    @torch.no_grad()
    def compute_old_logprobs(self, r: Rollout) -> None:
        self.policy.eval()
        temperature = self.logprob_temperature
        r.old_logprobs, r.entropy = self.per_token(r), self.per_token(r)
        r.ref_logprobs = self.per_token(r) if self.ref_policy is not None else None
        for idx, micro in self.micro_batches(r):
            logits = policy_logits(self.policy, micro)
            T = logits.shape[1]
            r.old_logprobs[idx, :T] = core.logprobs_from_logits(
                logits, micro.responses, temperature
            )
            r.entropy[idx, :T] = core.entropy_from_logits(logits, temperature)
            if self.ref_policy is not None:
                ref_logits = policy_logits(self.ref_policy, micro)
                r.ref_logprobs[idx, :T] = core.logprobs_from_logits(
                    ref_logits, micro.responses, temperature
                )

    @torch.no_grad()
    def compute_values(self, r: Rollout) -> None:
        if self.critic is None:
            return
        self.critic.eval()
        r.values = self.per_token(r)
        for idx, micro in self.micro_batches(r):
            v = critic_values(self.critic, micro)
            r.values[idx, : v.shape[1]] = v

    @torch.no_grad()
    def compute_advantages(self, r: Rollout) -> None:
        a, mask = self.algo, r.response_mask
        if a.advantage == "gae":
            r.lam_actor = self.actor_lambda(r)
            rewards = core.sparse_rewards(r.scores, mask)
            adv, _ = core.gae(rewards, r.values, mask, a.gamma, r.lam_actor)
            r.returns = self.critic_targets(r)
        else:  # GRPO / DAPO: group-normalised outcome advantage on every token
            adv = (
                core.group_normalized_advantages(r.scores, r.group_ids, a.group_std)[:, None] * mask
            )
        r.advantages = self.whiten(adv, mask) if a.whiten_advantages else adv

    def actor_lambda(self, r: Rollout) -> Tensor:
        """Per-response lambda of the actor's GAE: length-adaptive (§4.2, Eq. 5) or fixed."""
        a = self.algo
        if a.length_adaptive_gae:
            return core.length_adaptive_lam(r.response_lengths, a.alpha).to(r.scores)
        return torch.full_like(r.scores, a.lam_actor)

    @torch.no_grad()
    def critic_targets(self, r: Rollout) -> Tensor:
        """The critic's regression targets, GAE returns (B, T). Decoupled GAE (§4.1): with
        lam_critic (1: Monte-Carlo), and always Monte-Carlo while value pretraining (§4.1,
        §5.1); without decoupling, with the actor's lambda."""
        a = self.algo
        lam = (
            1.0
            if self.actor_frozen
            else (a.lam_critic if a.decoupled_gae else self.actor_lambda(r))
        )
        rewards = core.sparse_rewards(r.scores, r.response_mask)
        return core.gae(rewards, r.values, r.response_mask, a.gamma, lam)[1]

    def whiten(self, x: Tensor, mask: Tensor) -> Tensor:
        """`core.masked_whiten` with statistics over the valid tokens of all ranks."""
        n, s, ss = self.global_sum(
            torch.stack([mask.sum().to(x), core.masked_sum(x, mask), core.masked_sum(x * x, mask)])
        )
        mean = s / n
        var = (ss - n * mean * mean) / (n - 1).clamp(min=1)
        return torch.where(mask, (x - mean) * torch.rsqrt(var + 1e-8), torch.zeros_like(x))

    def _count_rollout_as_one_step(self) -> None:
        """Under manual optimisation Lightning counts every `optimizer.step()` as a global
        step; users count rollout steps (max_steps, checkpoint and logging intervals), so one
        rollout advances `trainer.global_step` by exactly one."""
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        target = self._rollout_steps_before + 1
        progress.total.ready = progress.total.completed = target

    def on_fit_start(self) -> None:
        if self.trainer.world_size > 1 and self.trainer.ckpt_path is None:
            # Lightning seeds every rank alike: give each rank its own sampling noise.
            torch.manual_seed(torch.initial_seed() + self.trainer.global_rank)
        self.sync_engine()  # vLLM: start the engine with the (possibly resumed) weights

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Random streams (one per rank) and counters, so a resumed run samples exactly what
        the uninterrupted run would have (data order: `ResumableDataLoader`)."""
        states = [rng_state()]
        if self.trainer.world_size > 1:  # collective: every rank dumps the checkpoint
            states = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(states, rng_state())
        checkpoint["vapo"] = {"rng": states, "bad_updates": self.bad_updates}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("vapo")
        if state is not None:
            states = state["rng"]
            set_rng_state(states[self.global_rank] if self.global_rank < len(states) else states[0])
            self.bad_updates = state["bad_updates"]
        self.policy_version += 1  # restored weights: an engine made before must load them

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._rollout_steps_before = self.trainer.global_step

    # ------------------------------------------------------------------ logging and export

    def log_step(self, r: Rollout, stats: dict[str, float], timer: PhaseTimer) -> None:
        m = {**stats, **rollout_metrics(r, timer)}
        lrs = [opt.param_groups[0]["lr"] for opt in as_list(self.optimizers())]
        m.update(
            {
                "actor/lr": lrs[0],
                "warmup/active": float(self.actor_frozen),
                "reward/errors": self.reward_errors,
                **self.reward_metrics,
            }
        )
        if self.tools:
            m["tools/errors"] = self.tool_errors
        if len(lrs) > 1:
            m["critic/lr"] = lrs[1]
        m.update({alias: m[name] for alias, name in ALIASES.items() if name in m})
        m["rollout_step"] = float(self._rollout_steps_before + 1)
        m = self.reduce_metrics(m, summed={"reward/errors", "tools/errors", *self.reward_metrics})
        shown = {"reward", "rollout/accuracy", "rollout_step", "reward/errors"}  # progress bar
        self.log_dict(
            {k: v for k, v in m.items() if k not in shown},
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        self.log_dict(
            {k: m[k] for k in shown}, on_step=True, on_epoch=False, batch_size=1, prog_bar=True
        )

    def reduce_metrics(self, m: dict[str, Any], summed: Container[str] = ()) -> dict[str, float]:
        """One all-gather for all metrics: max / min for the extremes, the sum over ranks for
        the counts in `summed` (errors: the run's, not one rank's), mean for the rest."""
        names = sorted(m)
        local = torch.tensor([float(m[k]) for k in names], device=self.device)
        if self.trainer.world_size == 1:
            return dict(zip(names, local.tolist()))
        every = self.all_gather(local)  # (world, K)
        ops = {"/max": torch.amax, "/min": torch.amin}

        def reduce(k: str, column: Tensor) -> Tensor:
            return column.sum() if k in summed else ops.get(k[k.rfind("/") :], torch.mean)(column)

        return {k: float(reduce(k, every[:, i])) for i, k in enumerate(names)}

    def teardown(self, stage: str) -> None:
        self.close_engine()
        for tool in self.tools:
            tool.close()

    def on_train_end(self) -> None:
        if self.hf_export_dir:
            self.export_hf(self.hf_export_dir)

    def export_hf(self, directory: str | Path) -> None:
        """Saves policy (with tokenizer) and critic with `save_pretrained` (safetensors).
        Sharded weights are gathered to full tensors and written by rank 0; every rank calls."""
        directory, zero = Path(directory), self.trainer.is_global_zero
        save_pretrained(self.policy, self.tokenizer, directory / "policy", zero)
        if self.critic is not None:
            save_pretrained(self.critic, self.tokenizer, directory / "critic", zero)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
