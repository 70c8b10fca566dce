"""VAPOModule: the policy and the critic, trained by VAPO with manual optimisation.

One `training_step` is one rollout step of the paper's algorithm box, one path, one line per
phase: rollout (group sampling, by an engine) -> reward -> pi_old -> V_old -> advantages
(length-adaptive GAE) and the critic's targets (decoupled GAE) -> critic updates -> actor
updates, each `ppo_epochs` × mini-batches × micro-batches with global token normalisers;
each phase's result is the next one's argument. The math lives in
`core` and `advantages`, the model passes in `updates`, the sampling in `engines`, DAPO's
rounds in `dynamic_sampling`, the validation hooks in `validation`; this file orchestrates.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from vapo_lightning.advantages import compute_advantages, has_actor_gradient
from vapo_lightning.config import Algorithm, Generation, Optim, SetupError
from vapo_lightning.critic_checks import explained_variance
from vapo_lightning.distributed import (
    builds_on_meta,
    parallelize,
    save_pretrained,
)
from vapo_lightning.dynamic_sampling import sample_in_rounds
from vapo_lightning.engines import RolloutEngine, check_generation, make_engine
from vapo_lightning.lora import AdaptersOff, base_dtype, is_lora
from vapo_lightning.memory_plan import check_memory
from vapo_lightning.metrics import PhaseTimer, drop_undefined, reduce_over_ranks, step_metrics
from vapo_lightning.models import (
    ModelSpec,
    add_adapters,
    build_critic,
    build_policy,
    check_torch_compile,
    compile_in_place,
    load_tokenizer,
)
from vapo_lightning.optim import adamw_with_warmup
from vapo_lightning.packing import layout_for
from vapo_lightning.rewards.base import RewardCallback, check_callbacks, score_rollout
from vapo_lightning.rollout import Rollout, with_round_counts
from vapo_lightning.run_state import RunStateHooks
from vapo_lightning.tools.base import Tool, from_spec, show_errors, spec
from vapo_lightning.updates import (
    Forwards,
    RankOps,
    Step,
    compute_values,
    count_bad_steps,
    mini_batches,
    old_policy,
    update_actor,
    update_critic,
)
from vapo_lightning.validation import ValidationHooks, ValidationMetrics

__all__ = ["VAPOModule"]


class VAPOModule(ValidationHooks, RunStateHooks, L.LightningModule):
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
        torch_compile: `torch.compile` the policy and the critic for every forward but the
            sampler's (`models.compile_in_place`): faster updates, after a compile per model
            at the first step and at the first new batch shape.
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
            for cls, v in [
                (ModelSpec, policy),
                (ModelSpec, critic),
                (Algorithm, algorithm),
                (Generation, generation),
                (Optim, optim),
                (Generation, val_generation),
            ]
        )
        self.policy_spec, self.critic_spec = policy, critic
        self.algo = algorithm or Algorithm()
        self.gen = generation or Generation()
        self.optim = optim or Optim()
        self.val_gen = val_generation or Generation(n=1, temperature=0.0, max_new_tokens=self.gen.max_new_tokens)
        self.gen.engine = self.gen.engine or "native"
        self.val_gen.engine = self.val_gen.engine or self.gen.engine  # validation follows
        self.tools = [from_spec(t) for t in tools or []]
        self.val_before_train = val_before_train
        self.hf_export_dir = hf_export_dir
        if torch_compile:
            check_torch_compile()
        self.torch_compile = torch_compile
        hparams = {
            "policy": policy,
            "critic": critic,
            "algorithm": self.algo,
            "generation": self.gen,
            "optim": self.optim,
            "val_generation": self.val_gen,
            "tools": [spec(t) for t in self.tools],
            "val_before_train": val_before_train,
            "hf_export_dir": hf_export_dir,
            "torch_compile": torch_compile,
        }
        # Plain dicts, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters({k: asdict(v) if is_dataclass(v) else v for k, v in hparams.items()})
        self.automatic_optimization = False
        if not (policy.tokenizer or policy.name_or_path):
            raise SetupError("model.policy: give name_or_path (a folder or hub id), or a config and a tokenizer")
        self.tokenizer = load_tokenizer(policy.tokenizer or policy.name_or_path)
        self.policy = self.critic = self.ref_policy = None
        # Value pretraining (§4.1): the first `value_pretraining_steps` rollout steps train the
        # critic alone (`callbacks.ValuePretraining` sets the three at setup).
        self.value_pretraining_steps = 0
        self.value_pretraining_threshold: float | None = None  # explained variance ending it early
        self.value_pretraining_save_dir: str | None = None
        self.pi_old_source = "recompute"  # one of updates.OLD_LOGPROB_SOURCES, set at setup
        self.engines: dict[str, RolloutEngine] = {}  # by name, made on first use
        self.longest_prompt = 0  # tokens, of the datamodule's prompts (`setup`)
        self.last_rollout: Rollout | None = None  # for callbacks (TrainingSamples)
        self.last_step: Step | None = None  # for callbacks (EntropyTracker)
        self.last_val_rollout: Rollout | None = None  # for callbacks (ValidationSamples)
        self.bad_updates = {"actor": 0, "critic": 0}  # consecutive non-finite updates
        self.checkpoint_step = 0  # the rollout step of a loaded checkpoint
        self._tool_errors_shown: set[tuple[str, str]] = set()
        self.val_metrics = ValidationMetrics()

    # ------------------------------------------------------------------ setup

    def configure_model(self) -> None:
        if self.policy is None:
            # fsdp: ranks > 0 build on the meta device; `parallelize` sends them rank 0's weights
            meta = builds_on_meta(self)
            self.policy = build_policy(self.policy_spec, self.tokenizer, meta=meta)
            if self.algo.uses_critic:
                self.critic = build_critic(self.critic_spec, self.policy, self.tokenizer, meta=meta)
            base = base_dtype(str(self._trainer.precision)) if self._trainer is not None else None
            self.policy, self.critic = add_adapters(self.policy, self.critic, self.policy_spec, self.critic_spec, base)
            if self.algo.kl_coef > 0:  # LoRA: the base itself, adapters off (no second copy)
                lora = is_lora(self.policy)
                self.ref_policy = (
                    AdaptersOff(self.policy) if lora else copy.deepcopy(self.policy).requires_grad_(False).eval()
                )
        parallelize(self)  # --trainer.strategy=ddp|fsdp: replicate / shard each model
        if self.torch_compile:  # in place: same parameters and state_dict keys, hooks included
            compile_in_place(self.policy, self.critic)

    def configure_optimizers(self) -> Any:
        o, models = self.optim, [(self.policy, self.optim.actor_lr), (self.critic, self.optim.critic_lr)]
        pairs = [
            adamw_with_warmup([p for p in m.parameters() if p.requires_grad], lr, o)  # LoRA: adapters
            for m, lr in models
            if m is not None
        ]
        return [opt for opt, _ in pairs], [sched for _, sched in pairs]

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        prompts = getattr(dm, "prompts_per_step", None) if stage == "fit" else None
        self.algo.check_batch(prompts, self.gen.n)
        batch = None if prompts is None else prompts * self.gen.n
        self.pi_old_source = self.algo.old_logprob_source(batch, reference_policy=self.algo.kl_coef > 0)
        rows = [*getattr(dm, "train_rows", []), *getattr(dm, "val_rows", [])]
        self.longest_prompt = max((len(row["prompt_ids"]) for row in rows), default=0)
        config = self.policy.config if self.policy is not None else self.policy_spec.hf_config()
        check_generation(config, self.longest_prompt, self.gen, self.val_gen, self.algo)
        check_callbacks(self.trainer.callbacks)
        for tool in self.tools:
            tool.setup()  # (a sandbox pool per process)

    @property
    def trained_models(self) -> dict[str, Any]:  # by state-dict prefix
        return {"policy": self.policy, "critic": self.critic}

    @property
    def reward_callbacks(self) -> list[RewardCallback]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, RewardCallback)]

    # ------------------------------------------------------------------ the algorithm box

    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        algo, timer, (actor_opt, critic_opt) = self.algo, PhaseTimer(), self.optimizer_pair()
        index = self._rollout_steps_before  # this rollout step's, from 0
        pretraining = self.value_pretraining_at(index)  # only the critic learns (§4.1)
        with timer("step"):
            r = self.rollout_and_score(batch, timer, pretraining)  # 1. n responses per prompt, rewards (§4.3)
            fw = Forwards.of(algo, self.global_max, layout_for(r.group_ids, algo))  # micro-batches, packs
            ops, max_norm, temperature = self.rank_ops, self.optim.max_grad_norm, self.logprob_temperature
            source = "recompute" if pretraining else self.pi_old_source  # one for the run
            with timer("old_log_prob") if source == "recompute" or self.ref_policy is not None else nullcontext():
                old = old_policy(source, self.policy, self.ref_policy, r, fw, temperature)  # 2. pi_old, pi_ref
            values = None
            if self.critic is not None:
                with timer("values"):  # 3. V_old
                    values = compute_values(self.critic, r, fw)
            with timer("adv"):  # 4. decoupled, length-adaptive GAE (§4.1-4.2), or the group baseline
                adv = compute_advantages(r, values, algo, pretraining, self.global_sum)
            batches = mini_batches(len(r), algo.mini_batch_size, algo.ppo_epochs, fw.layout.pack)
            stats: dict[str, list[float]] = {}
            if self.critic is not None:
                with timer("update_critic"):  # 5. the critic toward the decoupled returns (§4.1)
                    stats |= update_critic(
                        self.critic, critic_opt, r, values, adv.returns, batches, algo, max_norm, ops, fw
                    )
            # 6. the actor: Clip-Higher, token-level and LM loss (§4.2-4.3); no rank with a
            # gradient: no step.
            if not pretraining and self.global_sum(has_actor_gradient(r, adv.advantages, algo)) > 0:
                with timer("update_actor"):  # (and pi_old as it read it: on-policy, its first forward's)
                    actor_stats, old = update_actor(
                        self.policy, actor_opt, r, old, adv.advantages, batches, algo, temperature, max_norm, ops, fw
                    )
                stats |= actor_stats
            self.after_updates(stats)
        self.last_rollout, self.last_step = r, Step(r, old, values, adv)
        self.log_step(self.last_step, stats, timer, pretraining)
        if pretraining:
            self.end_value_pretraining(index, self.last_step)
        self._count_rollout_as_one_step()

    def value_pretraining_at(self, step: int) -> bool:
        """Whether rollout step `step` (0-based) trains the critic alone (§4.1, §5.1)."""
        return step < self.value_pretraining_steps

    def end_value_pretraining(self, index: int, step: Step) -> None:
        """After a value-pretraining step: the phase ends after its last step, or early once
        the critic's explained variance on this step's rollout (V_old against the returns,
        over every rank's tokens) reaches `value_pretraining_threshold`; the warmed-up critic
        is then saved to `value_pretraining_save_dir` (collective: every rank calls)."""
        done, threshold = index + 1, self.value_pretraining_threshold  # rollout steps done
        ev = None
        if threshold is not None:
            mask = step.rollout.response_mask
            ev = float(explained_variance(step.values, step.advantages.returns, mask, self.global_sum))
        if done < self.value_pretraining_steps and (ev is None or ev < threshold):
            return
        self.value_pretraining_steps = done
        why = f"explained variance {ev:.3f} >= {threshold}" if ev is not None and ev >= threshold else f"{done} steps"
        rank_zero_info(f"value pretraining done after {why}; the actor starts learning")
        if self.value_pretraining_save_dir:
            save_pretrained(self.critic, self.tokenizer, self.value_pretraining_save_dir, self.trainer.is_global_zero)

    def rollout_and_score(self, batch: list[dict], timer: PhaseTimer, pretraining: bool) -> Rollout:
        """Samples n responses per prompt and scores them (group sampling, §4.3); with DAPO's
        dynamic sampling, in rounds until the groups that disagree fill the batch
        (`dynamic_sampling`)."""
        with timer("weight_sync"):  # vLLM: the policy's new weights into the engine
            self.engine(self.gen).sync()

        def draw(rows: list[dict]) -> Rollout:
            with timer("gen"):
                r = self.sample(rows, self.gen)
            if self.tools:
                timer.move(r.tool_seconds, "gen", "tools")
            with timer("reward"):
                self.compute_rewards(r)
            return r

        r, rounds = sample_in_rounds(
            draw,
            batch,
            self.gen.n,
            self.algo,
            any_rank_short=lambda short: self.global_sum(float(short)) > 0,
            more_prompts=self.trainer.datamodule.sample_prompts,
            smallest=lambda k: -self.global_max(-k),
        )
        self.engine(self.gen).release(keep_weights=pretraining)  # the models train next
        return with_round_counts(r, rounds)

    def engine(self, gen: Generation) -> RolloutEngine:
        """The engine `gen` names, made on first use (after a checkpoint was restored, so a
        resumed run's engine starts from the resumed weights)."""
        if gen.engine not in self.engines:
            longest = self.longest_prompt + max(self.gen.max_new_tokens, self.val_gen.max_new_tokens)
            self.engines[gen.engine] = make_engine(
                gen,
                self.policy,
                self.tokenizer,
                self.tools,
                max_model_len=longest,
                precision=str(self.trainer.precision),
                local_rank=self.trainer.local_rank,
                logprobs=self.algo.reads_rollout_logprobs,
            )
        return self.engines[gen.engine]

    def sample(self, rows: list[dict], gen: Generation) -> Rollout:
        """n responses per prompt row from the engine `gen` names, with their `Sample`s; a
        failing tool is shown once per kind (and counted in `tools/errors`)."""
        engine = self.engine(gen)
        engine.sync()  # (validation after an update: the engine's copy may be stale)
        r = engine.sample(rows, gen, reproducible=not self.training)
        show_errors(r.tool_errors, self._tool_errors_shown)
        return r

    def compute_rewards(self, r: Rollout) -> None:
        """Reward callbacks -> R per response (`r.scores`, placed on the last token by GAE),
        and whether every verifier counts it correct (`r.correct`)."""
        score_rollout(r, self.reward_callbacks, self.device)

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the rollouts were sampled from, which log-probs
        and entropies are taken under (greedy sampling, 0: the plain softmax, 1)."""
        return self.gen.temperature or 1.0

    @property
    def rank_ops(self) -> RankOps:  # Lightning's backward, sums over ranks
        unsharded = getattr(self.trainer.strategy, "accumulate_unsharded", False)
        return RankOps(self.manual_backward, self.global_sum, self.trainer.world_size, unsharded)

    def global_max(self, count: int) -> int:
        """The largest of a count over data-parallel ranks (micro-batches by tokens)."""
        if self.trainer.world_size == 1:
            return int(count)
        return int(self.trainer.strategy.reduce(torch.tensor(float(count), device=self.device), reduce_op="max"))

    def global_sum(self, x: torch.Tensor | float) -> torch.Tensor:
        """The sum over data-parallel ranks of a number or tensor (a normaliser of the
        token-level loss, §4.2; a count): the one place scalars are reduced, and always on
        the module's device (NCCL reduces no CPU tensor)."""
        x = torch.as_tensor(x, device=self.device).float().to(self.device)
        return self.trainer.strategy.reduce(x, reduce_op="sum") if self.trainer.world_size > 1 else x

    def optimizer_pair(self) -> tuple[Any, Any]:  # (actor, critic); no critic: None
        opts = self.optimizers()
        return (opts[0], opts[1]) if isinstance(opts, list) else (opts, None)

    def after_updates(self, stats: dict[str, list[float]]) -> None:
        """Steps the schedulers, tells the engines of a changed policy, and stops the run
        after `max_bad_steps` non-finite updates in a row, leaving a checkpoint of the last
        good state (no bad update was ever applied)."""
        scheds = self.lr_schedulers()
        actor_sched, *critic_sched = scheds if isinstance(scheds, list) else [scheds]
        if self.critic is not None:
            critic_sched[0].step()
        if "actor/update_skipped" in stats:  # the actor stepped (not frozen, had a signal)
            actor_sched.step()
        if any(s == 0 for s in stats.get("actor/update_skipped", [])):
            for engine in self.engines.values():  # a new policy: an engine's copy is stale
                engine.policy_changed()
        for name in count_bad_steps(self.bad_updates, stats, self.algo.max_bad_steps):
            path = Path(self.trainer.default_root_dir, "checkpoints", "last_good.ckpt")
            self.trainer.save_checkpoint(path)
            raise FloatingPointError(
                f"{self.bad_updates[name]} consecutive {name} updates had a non-finite gradient "
                f"(NaN/inf in logits, losses or gradients); stopped. The last good state is in "
                f"{path}: lower model.optim learning rates or model.optim.max_grad_norm, check "
                f"rewards and data, then resume with --ckpt_path {path}."
            )

    # ------------------------------------------------------------------ Lightning hooks

    def on_fit_start(self) -> None:
        if self.device.type == "cuda":
            check_memory(self)  # one line of the plan; a plan over the device refuses
        if self.trainer.world_size > 1 and self.trainer.ckpt_path is None:
            # Lightning seeds every rank alike: give each rank its own sampling noise.
            torch.manual_seed(torch.initial_seed() + self.trainer.global_rank)
        self.engine(self.gen).sync()  # vLLM: start the engine with the (possibly resumed) weights

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._rollout_steps_before = self.trainer.global_step

    def teardown(self, stage: str) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
        for tool in self.tools:
            tool.close()

    def on_train_end(self) -> None:
        if self.hf_export_dir:
            self.export_hf(self.hf_export_dir)

    # ------------------------------------------------------------------ logging and export

    def log_step(self, step: Step, stats: dict[str, list[float]], timer: PhaseTimer, pretraining: bool) -> None:
        actor_opt, critic_opt = self.optimizer_pair()
        r = step.rollout
        m = step_metrics(
            step,
            stats,
            timer,
            actor_lr=actor_opt.param_groups[0]["lr"],
            critic_lr=critic_opt.param_groups[0]["lr"] if critic_opt else None,
            value_pretraining=pretraining,
            tools=bool(self.tools),
            global_sum=self.global_sum,
        )
        m["rollout_step"] = float(self._rollout_steps_before + 1)
        names = sorted(m)
        local = torch.tensor([float(m[k]) for k in names], device=self.device)
        every = self.all_gather(local) if self.trainer.world_size > 1 else local[None]  # (world, K)
        m = drop_undefined(
            reduce_over_ranks(
                names, every, summed={"reward/errors", "tools/errors", "rollout/responses_sampled", *r.reward_metrics}
            )
        )
        shown = {"reward", "rollout/accuracy", "rollout_step", "reward/errors"}  # progress bar
        logged = {k: v for k, v in m.items() if k not in shown}
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=1)
        self.log_dict({k: m[k] for k in shown}, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)

    def export_hf(self, directory: str | Path) -> None:
        """Saves policy (with tokenizer) and critic with `save_pretrained` (safetensors).
        Sharded weights are gathered to full tensors and written by rank 0; every rank calls."""
        directory, zero = Path(directory), self.trainer.is_global_zero
        save_pretrained(self.policy, self.tokenizer, directory / "policy", zero)
        if self.critic is not None:
            save_pretrained(self.critic, self.tokenizer, directory / "critic", zero)
