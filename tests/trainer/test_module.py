"""VAPOModule (`vapo_lightning/module.py`) end to end on a tiny randomly initialised Llama,
offline: every parameter moves and the metrics are logged, bf16, resume, export, the baselines,
start-up checks and non-finite updates."""

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from tests.helpers import (
    changed,
    scalars,
    snapshot,
    tiny_data,
    tiny_module,
    tiny_trainer,
)
from vapo_lightning.callbacks import EntropyTracker, ValuePretraining
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.optim import fused_adamw
from vapo_lightning.rewards.base import RewardCallback


@pytest.mark.slow
def test_fit_updates_every_parameter_and_logs_expected_metrics(tok, tmp_path):
    L.seed_everything(0)
    module = tiny_module(tok)
    module.configure_model()
    policy0, critic0 = snapshot(module.policy), snapshot(module.critic)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[EntropyTracker()])
    trainer.fit(module, datamodule=tiny_data(tmp_path))

    assert trainer.global_step == 2  # rollout steps, not optimizer steps
    assert changed(policy0, module.policy) == set(policy0)
    assert changed(critic0, module.critic) == set(critic0)

    logged = scalars(tmp_path)
    expected = [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/nll_loss",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vf_explained_var",
        "critic/grad_norm",
        "critic/lr",
        "critic/values/mean",
        "critic/returns/mean",
        "critic/advantages/mean",
        "critic/score/mean",
        "response_length/mean",
        "response_length/max",
        "response_length/min",
        "response_length/clip_ratio",
        "prompt_length/mean",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/old_log_prob",
        "timing_s/values",
        "timing_s/adv",
        "timing_s/update_critic",
        "timing_s/update_actor",
        "timing_s/step",
        "perf/throughput",
        "perf/time_per_step",
        "actor/lambda_actor/mean",
        "warmup/active",
        "rollout/accuracy",
        "reward",
        "seq_len",
        "entropy",
        "value_loss",
        "policy_loss",
        "reward/errors",
        "val/accuracy",
        "val/reward_errors",
        "val/answer_share",
        "val/boxed_share",
        "rollout/answer_share",
        "rollout/zero_spread_groups",
        "val/accuracy/add",
        "val/accuracy/sum",
        "rollout/entropy",
    ]
    missing = [name for name in expected if name not in logged]
    assert not missing, missing
    assert [step for step, _ in logged["actor/pg_loss"]] == [0, 1]  # every rollout step
    assert [v for _, v in logged["rollout_step"]] == [1.0, 2.0]
    # Length-adaptive lambda of 12-token responses is clamped to 0 (l < 1/alpha = 20).
    assert all(v == 0.0 for _, v in logged["actor/lambda_actor/mean"])
    acc = [v for _, v in logged["rollout/accuracy"]]
    assert all(0.0 <= v <= 1.0 for v in acc)


@pytest.mark.slow
def test_bf16_mixed_precision_fit_updates_both_models(tok, tmp_path):
    """`--trainer.precision=bf16-mixed` (what a GPU user runs; here on the CPU, the same
    autocast): logits come out bf16, log-probs and values must still land in fp32 buffers."""
    L.seed_everything(0)
    module = tiny_module(tok)
    module.configure_model()
    policy0, critic0 = snapshot(module.policy), snapshot(module.critic)
    trainer = tiny_trainer(tmp_path, max_steps=2, precision="bf16-mixed")
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert trainer.global_step == 2
    assert changed(policy0, module.policy) == set(policy0)
    assert changed(critic0, module.critic) == set(critic0)
    assert torch.isfinite(trainer.callback_metrics["actor/pg_loss"])


@pytest.mark.slow
def test_bf16_fit_is_the_same_when_autocast_caches_casts(tok, tmp_path, monkeypatch):
    """Lightning < 2.6 runs training_step under an autocast that caches its bf16 casts of the
    weights; the step makes several optimizer steps (2 mini-batches here), and each must drop
    them, or the next mini-batch trains on the weights from before. Same seed, cache on or
    off (Lightning 2.6): the same parameters after two rollout steps."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fit(cache: bool) -> tuple[dict, dict]:
        monkeypatch.setattr(
            MixedPrecision,
            "autocast_context_manager",
            lambda self: torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=cache),
        )
        L.seed_everything(0)
        module = tiny_module(tok)
        module.configure_model()
        root = tmp_path / f"cache_{cache}"
        root.mkdir()
        trainer = tiny_trainer(root, max_steps=2, precision="bf16-mixed")
        trainer.fit(module, datamodule=tiny_data(root))
        assert module.algo.mini_batch_size < 16  # several optimizer steps per rollout
        return snapshot(module.policy), snapshot(module.critic)

    for uncached, cached in zip(fit(False), fit(True)):
        assert [k for k in uncached if not torch.equal(uncached[k], cached[k])] == []


@pytest.mark.slow
def test_resume_continues_at_the_right_rollout_step(tok, tmp_path):
    L.seed_everything(2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[ckpt])
    trainer.fit(tiny_module(tok, val_before_train=False), datamodule=tiny_data(tmp_path))
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2

    module = tiny_module(tok, val_before_train=False)
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path / "resumed", max_steps=3, callbacks=[ckpt2])
    trainer.fit(module, datamodule=tiny_data(tmp_path), ckpt_path="last")
    assert trainer.global_step == 3
    logged = scalars(tmp_path / "resumed")
    assert [v for _, v in logged["rollout_step"]] == [3.0]
    for name, p in module.policy.named_parameters():  # restored, then trained one more step
        assert not torch.equal(state["state_dict"][f"policy.{name}"], p.detach())


def test_hf_export_reloads_and_generates(tok, tmp_path):
    L.seed_everything(3)
    module = tiny_module(tok, hf_export_dir=str(tmp_path / "export"), val_before_train=False)
    tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_data(tmp_path))
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "policy")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export" / "policy")
    for name, p in module.policy.named_parameters():
        torch.testing.assert_close(policy.state_dict()[name], p.detach())
    ids = tokenizer(["What is 2 + 3?"], return_tensors="pt")
    out = policy.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "export" / "critic")
    assert critic.config.num_labels == 1


@pytest.mark.parametrize(
    "algorithm",
    [
        Algorithm(advantage="group", mini_batch_size=8, micro_batch_size=4, nll_coef=0.0),  # GRPO
        Algorithm(advantage="group", mini_batch_size=8, micro_batch_size=8, dynamic_sampling_rounds=2),  # DAPO
        Algorithm(
            loss_agg="sequence",
            length_adaptive_gae=False,
            decoupled_gae=False,
            clip_high=0.2,
            mini_batch_size=4,
            micro_batch_size=2,
            ppo_epochs=2,
            kl_coef=0.1,
            entropy_coef=0.01,
        ),
    ],
    ids=["grpo", "dapo", "ppo-with-kl-and-entropy"],
)
@pytest.mark.slow
def test_baselines_run_from_the_same_code(tok, tmp_path, algorithm):
    L.seed_everything(4)
    module = tiny_module(tok, algorithm=algorithm, val_before_train=False)
    module.configure_model()
    before = snapshot(module.policy)
    tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_data(tmp_path))
    assert (module.critic is None) == (algorithm.advantage == "group")
    assert changed(before, module.policy)


def test_reward_metrics_are_logged_summed_over_dynamic_sampling_rounds(tok, tmp_path):
    """A reward's `metrics` (counts over its last `score` call) reach TensorBoard with the
    step, summed over every round DAPO's dynamic sampling drew."""
    from vapo_lightning.rewards.base import RewardCallback

    class Counting(RewardCallback):
        def __init__(self):
            super().__init__()
            self.calls = self.samples = 0
            self.last = {}

        def score(self, samples):
            self.calls, self.samples = self.calls + 1, self.samples + len(samples)
            self.last = {"count/calls": 1.0, "count/samples": float(len(samples)), "count/none": 0.0}
            return [0.0] * len(samples)

        def metrics(self):
            return self.last

    L.seed_everything(3)
    counting = Counting()
    algorithm = Algorithm(advantage="group", mini_batch_size=8, micro_batch_size=8, dynamic_sampling_rounds=3)
    module = tiny_module(tok, algorithm=algorithm, val_before_train=False)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[counting], limit_val_batches=0)
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    logged = scalars(tmp_path)
    assert logged["count/calls"] == [(0, float(counting.calls))]
    assert logged["count/samples"] == [(0, float(counting.samples))]
    assert logged["count/none"] == [(0, 0.0)]  # a zero count is logged (every rank has the key)
    assert counting.samples >= 16


class Fixed(RewardCallback):
    """A verifier that calls every response right (`value` > 0) or wrong."""

    correct_threshold = 0.0

    def __init__(self, value: float):
        super().__init__(weight=0.0)
        self.value = value

    def score(self, samples):
        return [self.value] * len(samples)


@pytest.mark.slow
def test_two_verifiers_of_one_class_both_decide_correctness(tok, tmp_path):
    """Two reward callbacks of the same class (the same name) keep their own scores: a
    response is correct only when every verifier says so, whichever was listed last."""
    L.seed_everything(0)
    module = tiny_module(tok, val_before_train=False)
    callbacks = [Fixed(-1.0), Fixed(1.0)]
    tiny_trainer(tmp_path, max_steps=1, callbacks=callbacks, limit_val_batches=0).fit(
        module, datamodule=tiny_data(tmp_path)
    )
    assert [v for _, v in scalars(tmp_path)["rollout/accuracy"]] == [0.0]


def test_a_reward_that_is_no_reward_callback_is_refused(tok, tmp_path):
    class Plain(L.Callback):
        def score(self, samples):
            return [1.0] * len(samples)

    module = tiny_module(tok, val_before_train=False)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[Plain()], limit_val_batches=0)
    with pytest.raises(TypeError, match=r"Plain has a score\(\) method but is not a vapo_lightning"):
        trainer.fit(module, datamodule=tiny_data(tmp_path))


def test_metrics_over_ranks_sum_the_counts():
    """Across ranks: errors and a reward's counts are the run's sum, extremes their max / min,
    the rest the mean (checked on a gathered (world, K) tensor, as `all_gather` returns)."""
    from vapo_lightning.metrics import reduce_over_ranks

    ranks = [
        {
            "reward/errors": 1.0,
            "code/passed": 3.0,
            "response_length/max": 9.0,
            "actor/pg_loss": 1.0,
        },
        {
            "reward/errors": 2.0,
            "code/passed": 4.0,
            "response_length/max": 7.0,
            "actor/pg_loss": 3.0,
        },
    ]
    gathered = torch.tensor([[r[k] for k in sorted(r)] for r in ranks])
    out = reduce_over_ranks(sorted(ranks[0]), gathered, summed={"reward/errors", "code/passed"})
    assert out == {
        "actor/pg_loss": 2.0,
        "code/passed": 7.0,
        "response_length/max": 9.0,
        "reward/errors": 3.0,
    }


def test_validation_syncs_the_same_sources_in_the_same_order_on_every_rank(tok, monkeypatch):
    """Per-source accuracies are synced metric by metric: a rank must compute the sources
    another rank saw (even with no row of its own) and in sorted order, not in the order it
    met them (that would pair different sources across ranks, or hang)."""
    from types import SimpleNamespace

    module = tiny_module(tok)
    rows = [{"data_source": s} for s in ("zeta", "alpha", "mid", "unused")]
    trainer = SimpleNamespace(world_size=2, datamodule=SimpleNamespace(val_rows=rows))
    monkeypatch.setattr(type(module), "trainer", property(lambda self: trainer))
    by_source = module.val_metrics.by_source
    for source, value in (("zeta", 1.0), ("mid", 0.0)):  # met in this order on this rank
        module.val_metrics.source(source).update(torch.tensor([value]))
    other_rank = torch.tensor([1.0, 0.0, 0.0, 0.0])  # alpha, mid, unused, zeta: it saw alpha
    monkeypatch.setattr(module, "all_gather", lambda local: torch.stack([local, other_rank]))
    any_rank = lambda seen: module.all_gather(seen).amax(0)  # noqa: E731
    assert module.val_metrics.sources_seen_on_any_rank([r["data_source"] for r in rows], any_rank) == [
        "alpha",
        "mid",
        "zeta",
    ]
    assert "alpha" in by_source and "unused" not in by_source
    module.val_metrics.accuracy.update(torch.tensor([1.0]))
    metrics = module.compute_val_metrics()
    per_source = [k for k in metrics if k.startswith("val/accuracy/")]
    assert per_source == ["val/accuracy/alpha", "val/accuracy/mid", "val/accuracy/zeta"]
    assert float(metrics["val/accuracy/zeta"]) == 1.0 and float(metrics["val/accuracy/mid"]) == 0.0


def test_impossible_settings_fail_at_start_up(tok, tmp_path):
    with pytest.raises(ValueError, match=r"mini_batch_size=12 must divide the rollout batch"):
        module = tiny_module(tok, algorithm=Algorithm(mini_batch_size=12, micro_batch_size=4))
        tiny_trainer(tmp_path).fit(module, datamodule=tiny_data(tmp_path))
    with pytest.raises(ValueError, match=r"needs model.generation.n >= 2"):
        module = tiny_module(
            tok,
            algorithm=Algorithm(advantage="group", mini_batch_size=4, micro_batch_size=4),
            generation=Generation(n=1, max_new_tokens=8),
        )
        tiny_trainer(tmp_path).fit(module, datamodule=tiny_data(tmp_path))
    with pytest.raises(ValueError, match=r"micro_batch_size=3 must divide mini_batch_size=8"):
        Algorithm(mini_batch_size=8, micro_batch_size=3)


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_run(tok, tmp_path):
    """Same data order, RNG streams, optimiser/scheduler and warm-up state after a resume."""

    def run(root, max_steps, ckpt_path=None):
        L.seed_everything(5)
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        callbacks = [ckpt, ValuePretraining(steps=1)]
        trainer = tiny_trainer(root, max_steps=max_steps, callbacks=callbacks)
        module = tiny_module(tok, optim=Optim(actor_lr=1e-3, critic_lr=1e-3, warmup_steps=2))
        trainer.fit(module, datamodule=tiny_data(tmp_path), ckpt_path=ckpt_path)
        return module, scalars(root)

    full_module, full = run(tmp_path / "full", 4)
    run(tmp_path / "part", 2)
    (tmp_path / "part2").mkdir()
    (tmp_path / "part2" / "ckpt").symlink_to(tmp_path / "part" / "ckpt")
    resumed_module, resumed = run(tmp_path / "part2", 4, ckpt_path="last")
    for name, values in resumed.items():
        if name.startswith(("timing_s/", "perf/")) or name in ("epoch", "hp_metric"):
            continue
        expected = [v for step, v in full[name] if step >= 2]
        assert [v for _, v in values] == expected, name  # exactly: same samples, same arithmetic
    for (name, p), q in zip(full_module.policy.named_parameters(), resumed_module.policy.parameters()):
        assert torch.equal(p, q), name


def poison_actor_logits(monkeypatch, steps):
    """Makes the actor update's log-probs NaN on the given rollout steps (0-based)."""
    import vapo_lightning.updates as updates

    real = updates.token_logprobs

    def logprobs(policy, r, *args, **kwargs):
        lp, h = real(policy, r, *args, **kwargs)
        return (lp * float("nan"), h) if poison_actor_logits.step in steps else (lp, h)

    poison_actor_logits.step = 0
    monkeypatch.setattr(updates, "token_logprobs", logprobs)


class StepCounter(L.Callback):
    def on_train_batch_end(self, *args):
        poison_actor_logits.step += 1


@pytest.mark.slow
def test_non_finite_updates_are_skipped_and_counted(tok, tmp_path, monkeypatch):
    poison_actor_logits(monkeypatch, steps={0})
    L.seed_everything(6)
    module = tiny_module(tok, val_before_train=False)
    module.configure_model()
    before = snapshot(module.policy)
    tiny_trainer(tmp_path, max_steps=1, callbacks=[StepCounter()]).fit(module, datamodule=tiny_data(tmp_path))
    assert changed(before, module.policy) == set()  # the NaN update was not applied
    trainer = tiny_trainer(tmp_path / "2", max_steps=2, callbacks=[StepCounter()])
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    assert changed(before, module.policy) == set(before)  # training went on
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    logged = scalars(tmp_path)
    assert [v for _, v in logged["actor/update_skipped"]] == [1.0]
    assert [v for _, v in logged["critic/update_skipped"]] == [0.0]


@pytest.mark.slow
def test_consecutive_non_finite_updates_stop_with_a_good_checkpoint(tok, tmp_path, monkeypatch):
    poison_actor_logits(monkeypatch, steps=set(range(100)))
    L.seed_everything(7)
    algorithm = Algorithm(mini_batch_size=8, micro_batch_size=4, max_bad_steps=3)
    module = tiny_module(tok, algorithm=algorithm, val_before_train=False)
    module.configure_model()
    before = snapshot(module.policy)
    with pytest.raises(FloatingPointError, match=r"3 consecutive actor updates had a non-finite gradient"):
        tiny_trainer(tmp_path, max_steps=5, callbacks=[StepCounter()]).fit(module, datamodule=tiny_data(tmp_path))
    state = torch.load(tmp_path / "checkpoints" / "last_good.ckpt", weights_only=True)["state_dict"]
    for name, p in before.items():
        assert torch.equal(state[f"policy.{name}"], p), name


def test_an_undefined_explained_variance_is_not_logged_but_a_nan_loss_is():
    from vapo_lightning.metrics import drop_undefined

    m = {"critic/vf_explained_var": float("nan"), "actor/pg_loss": float("nan"), "reward": -1.0}
    assert set(drop_undefined(m)) == {"actor/pg_loss", "reward"}
    assert drop_undefined({"critic/vf_explained_var": 0.25}) == {"critic/vf_explained_var": 0.25}


@pytest.mark.slow
def test_a_phase_that_did_not_run_logs_zero_not_its_last_value(tok, tmp_path):
    """Value pretraining (step 1) updates no actor; the next step does: step 1's
    `timing_s/update_actor` is 0, and so is the next step's `timing_s/old_log_prob`, whose
    pi_old comes from the actor's first forward (one mini-batch a step), not step 1's value
    kept by Lightning. While value pretraining pi_old is a pass (its entropy is logged)."""
    from vapo_lightning.callbacks import ValuePretraining

    class Phases(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, *args):
            self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("timing_s/")})

    L.seed_everything(0)
    phases = Phases()
    module = tiny_module(tok, algorithm=Algorithm(mini_batch_size=16, micro_batch_size=4), val_before_train=False)
    tiny_trainer(
        tmp_path, max_steps=2, callbacks=[ValuePretraining(steps=1), phases, EntropyTracker()], limit_val_batches=0
    ).fit(module, datamodule=tiny_data(tmp_path))
    assert module.pi_old_source == "first_forward"
    first, second = phases.seen
    assert first["timing_s/old_log_prob"] > 0 and second["timing_s/old_log_prob"] == 0.0
    assert first["timing_s/values"] > 0 and second["timing_s/values"] > 0  # V_old: always a pass
    assert first["timing_s/update_actor"] == 0.0 and second["timing_s/update_actor"] > 0
    parts = sum(v for k, v in second.items() if k not in ("timing_s/step",))
    assert parts <= second["timing_s/step"] * 1.001


@pytest.mark.slow
def test_the_actor_is_not_updated_on_a_batch_without_signal(tok, tmp_path, monkeypatch):
    """GRPO on a batch whose every group scored alike has a zero gradient: no actor forward
    and backward, no optimiser step (AdamW's weight decay would still move the weights). The
    positive-example LM loss is signal enough: a correct response there keeps the update."""
    import vapo_lightning.module as module_file

    calls = []
    real = module_file.update_actor
    monkeypatch.setattr(module_file, "update_actor", lambda *a, **k: calls.append(1) or real(*a, **k))
    for value, nll_coef, expected in [(-1.0, 0.1, 0), (1.0, 0.0, 0), (1.0, 0.1, 1)]:
        L.seed_everything(0)
        algorithm = Algorithm(advantage="group", mini_batch_size=16, micro_batch_size=4, nll_coef=nll_coef)
        module = tiny_module(
            tok,
            algorithm=algorithm,
            val_before_train=False,
            optim=Optim(actor_lr=1e-3, weight_decay=0.1, warmup_steps=0),
        )
        module.configure_model()
        before, calls[:] = snapshot(module.policy), []
        trainer = L.Trainer(
            max_steps=1,
            default_root_dir=tmp_path / str(value) / str(nll_coef),
            callbacks=[Fixed(value)],
            limit_val_batches=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(module, datamodule=tiny_data(tmp_path))
        assert len(calls) == expected, (value, nll_coef)
        assert bool(changed(before, module.policy)) == bool(expected)
        assert (trainer.callback_metrics["timing_s/update_actor"] > 0) == bool(expected)


def test_both_optimisers_use_the_fused_adamw_kernel_for_plain_parameters(tok):
    """AdamW's fused kernel, not torch's per-tensor default, and the same step as that default."""
    module = tiny_module(tok)
    module.configure_model()
    (actor, critic), _ = module.configure_optimizers()
    assert actor.defaults["fused"] and critic.defaults["fused"]
    assert len(actor.param_groups[0]["params"]) == len(list(module.policy.parameters()))
    models = [copy.deepcopy(module.policy) for _ in range(2)]
    for model, fused in zip(models, (True, False), strict=True):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 0.1 + p.detach() * 0.01
        opt.step()
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not fused_adamw([])


@pytest.mark.slow
def test_pi_old_from_the_rollout_skips_the_policy_pass(tok, tmp_path, monkeypatch):
    """`old_logprobs='rollout'` (verl's bypass mode), two mini-batches a step: no no-grad
    pass of the policy, the ratio is taken against the sampler's log-probs, and in fp32 the
    update is the recompute's (the same draws, log-probs equal to 1e-5): same parameters
    after two rollout steps."""
    import vapo_lightning.updates as updates

    def fit(old_logprobs: str, root) -> tuple[dict, dict, int]:
        passes = []
        compute = updates.compute_log_probs
        monkeypatch.setattr(updates, "compute_log_probs", lambda *a, **k: (passes.append(1), compute(*a, **k))[1])
        root.mkdir()
        L.seed_everything(0)
        module = tiny_module(tok, algorithm=Algorithm(mini_batch_size=8, micro_batch_size=4, old_logprobs=old_logprobs))
        trainer = tiny_trainer(root, max_steps=2, limit_val_batches=0)
        trainer.fit(module, datamodule=tiny_data(root))
        assert module.pi_old_source == old_logprobs  # 16 responses, 2 mini-batches
        return snapshot(module.policy), scalars(root), len(passes)

    bypass, logged, bypass_passes = fit("rollout", tmp_path / "rollout")
    recompute, _, recompute_passes = fit("recompute", tmp_path / "recompute")
    assert (bypass_passes, recompute_passes) == (0, 2)
    assert [v for _, v in logged["timing_s/old_log_prob"]] == [0.0, 0.0]
    assert "training/rollout_probs_diff_mean" not in logged  # nothing to compare
    assert all(v > 0 for _, v in logged["actor/entropy"])  # pi_old's, from the sampler
    for k in recompute:
        torch.testing.assert_close(bypass[k], recompute[k], atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(bypass[k], recompute[k]) for k in recompute)  # two paths, not one


def test_pi_old_from_the_rollout_is_a_checked_setting():
    with pytest.raises(ValueError, match="old_logprobs='engine'"):
        Algorithm(old_logprobs="engine")


@pytest.mark.parametrize("metric", ["correct", "reward"])
def test_dynamic_sampling_filters_on_correctness_not_on_shaping_rewards(tok, tmp_path, metric):
    """Every answer wrong, told apart only by a shaping reward (as DAPO's overlong penalty or a
    format bonus do): on correctness (the default, the DAPO paper's and verl's) no group has a
    signal, so all 3 rounds are drawn in full; on the total reward the groups whose lengths
    differ were kept (fewer fresh prompts drawn)."""
    from vapo_lightning.rewards.base import RewardCallback

    class AllWrong(RewardCallback):
        correct_threshold = 0.0

        def score(self, samples):
            return [-1.0] * len(samples)

    class Shaping(RewardCallback):  # not a verifier: varies with the answer's length
        def score(self, samples):
            return [-len(s.response_ids) / 100 for s in samples]

    L.seed_everything(3)
    algorithm = Algorithm(
        advantage="group",
        mini_batch_size=8,
        micro_batch_size=8,
        dynamic_sampling_rounds=2,
        dynamic_sampling_metric=metric,
    )
    module = tiny_module(tok, algorithm=algorithm, val_before_train=False)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[AllWrong(), Shaping()], limit_val_batches=0)
    trainer.callbacks = [cb for cb in trainer.callbacks if type(cb).__name__ != "ParityReward"]
    trainer.fit(module, datamodule=tiny_data(tmp_path))
    logged = scalars(tmp_path)
    ((_, sampled),) = logged["rollout/responses_sampled"]  # 4 prompts × 4 a round
    assert sampled == 48.0 if metric == "correct" else sampled < 48.0
    assert logged["rollout/all_or_none_correct_groups"] == [(0, 1.0)]
