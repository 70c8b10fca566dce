"""LoRA (`vapo_lightning/lora.py`): only adapters and the value head train, the merged weights
are the peft model's, the reference policy is the base, LoRA checkpoints hold adapters and
resume exactly, export writes merged models and adapters, bad setups fail in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from tests.helpers import TINY_LLAMA, scalars, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.callbacks import ValuePretraining
from vapo_lightning.config import Algorithm, Generation, Optim, SetupError
from vapo_lightning.engines.native import NativeEngine, generate
from vapo_lightning.export import export_checkpoint
from vapo_lightning.lora import AdaptersOff, LoRA, is_lora, merged_weights, with_adapters
from vapo_lightning.models import ModelSpec, load_tokenizer

peft = pytest.importorskip("peft")

LORA = LoRA(r=4, alpha=8)


def tiny_llama(vocab: int = 300, tied: bool = True) -> AutoModelForCausalLM:
    cfg = dict(TINY_LLAMA)
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg, vocab_size=vocab, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg).eval()


def random_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """B starts at zero (an adapter that changes nothing): give every factor random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture
def policy_dir(tok, tmp_path):
    """A tiny pretrained-looking policy folder (random weights, saved): a LoRA base with a
    source, as a user's model has."""
    torch.manual_seed(3)
    model = tiny_llama(len(load_tokenizer(str(tok))))
    model.save_pretrained(tmp_path / "base")
    load_tokenizer(str(tok)).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def lora_module(policy_dir, **overrides):
    kwargs = {"policy": ModelSpec(name_or_path=str(policy_dir), lora=LORA)}
    return tiny_module(policy_dir, **{**kwargs, **overrides})


def test_merged_weights_are_the_base_plus_the_scaled_low_rank_update():
    torch.manual_seed(0)
    base = tiny_llama()
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    model = with_adapters(base, LORA, "policy")
    random_adapters(model)
    weights = dict(merged_weights(model))
    assert weights.keys() == plain.keys()  # the base's own names, nothing of peft's
    inner = model.get_base_model()
    for name, value in weights.items():
        module_name = name.removesuffix(".weight")
        if module_name.endswith("_proj"):  # every linear layer of the blocks has an adapter
            layer = inner.get_submodule(module_name)
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            expected = plain[name] + (LORA.alpha / LORA.r) * b @ a  # the slow, obvious way
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
        else:  # embeddings (tied to the LM head), norms
            assert torch.equal(value, plain[name]), name


def test_the_merged_model_gives_the_peft_models_logits_and_leaves_it_unmerged():
    torch.manual_seed(0)
    model = with_adapters(tiny_llama(), LORA, "policy")
    random_adapters(model)
    ids = torch.randint(0, 300, (3, 11))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        plain = tiny_llama()
        plain.load_state_dict(dict(merged_weights(model)))
        assert (adapted - plain(input_ids=ids).logits).abs().max() < 1e-4
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        assert (adapted - base).abs().max() > 0.1  # the adapters matter in this test
        assert torch.equal(model(input_ids=ids).logits, adapted)  # the trainer's copy: unmerged


def test_the_native_engine_samples_a_merged_copy_refreshed_after_each_change():
    """Greedy tokens from the engine equal the peft model's own before and after its adapters
    change (told by `policy_changed`); the trainer's copy stays unmerged."""
    torch.manual_seed(0)
    model = with_adapters(tiny_llama(), LORA, "policy").eval()
    random_adapters(model)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    engine = NativeEngine(model, tokenizer, [])
    greedy = Generation(n=1, max_new_tokens=12, temperature=0.0)
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11]]

    def own_greedy():  # the slow, obvious way: the peft model sampled directly
        return generate(model, prompts, greedy, 0, 1).responses

    engine.sync()
    before = engine.generate(prompts, greedy).responses
    assert torch.equal(before, own_greedy())
    assert engine.merged.model is not model and not is_lora(engine.merged.model)
    random_adapters(model, seed=1)  # an update
    assert not torch.equal(own_greedy(), before)  # (the change shows in greedy tokens)
    assert not engine.sync() and torch.equal(engine.generate(prompts, greedy).responses, before)
    engine.policy_changed()
    assert engine.sync() and torch.equal(engine.generate(prompts, greedy).responses, own_greedy())
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    assert not layer.merged and any(n.endswith("base_layer.weight") for n, _ in model.named_parameters())


def test_the_reference_policy_is_the_base_with_adapters_off():
    torch.manual_seed(0)
    base = tiny_llama()
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        model = with_adapters(base, LORA, "policy")
        random_adapters(model)
        ref = AdaptersOff(model)
        assert torch.equal(ref(input_ids=ids).logits, before)
        assert (model(input_ids=ids).logits - before).abs().max() > 0.1


@pytest.mark.slow
def test_only_adapters_and_the_value_head_change_and_the_base_stays_bit_identical(tok, policy_dir, tmp_path):
    L.seed_everything(0)
    module = lora_module(policy_dir, algorithm=Algorithm(mini_batch_size=8, micro_batch_size=4, kl_coef=0.1))
    module.configure_model()
    assert isinstance(module.ref_policy, AdaptersOff) and module.ref_policy.model is module.policy
    before = {
        m: {n: p.detach().clone() for n, p in getattr(module, m).named_parameters()} for m in ("policy", "critic")
    }
    trained = {
        m: {n for n, p in getattr(module, m).named_parameters() if p.requires_grad} for m in ("policy", "critic")
    }
    assert all("lora_" in n for n in trained["policy"])
    head = "base_model.model.score.modules_to_save.default."
    assert {n for n in trained["critic"] if "lora_" not in n} == {head + "weight", head + "bias"}  # in full
    opts = module.configure_optimizers()[0]
    assert [sum(p.numel() for g in o.param_groups for p in g["params"]) for o in opts] == [
        sum(p.numel() for n, p in getattr(module, m).named_parameters() if n in trained[m])
        for m in ("policy", "critic")
    ]  # the optimisers hold the trainable parameters only
    tiny_trainer(tmp_path, max_steps=2).fit(module, datamodule=tiny_data(tmp_path))
    for m in ("policy", "critic"):
        moved = {n for n, p in getattr(module, m).named_parameters() if not torch.equal(p, before[m][n])}
        assert moved == trained[m], m  # every adapter factor moved (B from zero), nothing else
    logged = scalars(tmp_path)
    assert logged["actor/kl_loss"][-1][1] > 0  # the KL to the base: the adapters moved the policy


def test_a_critic_of_its_own_takes_its_own_lora_or_none(tok, policy_dir):
    module = lora_module(policy_dir, critic=ModelSpec(gradient_checkpointing=True))
    with pytest.warns(UserWarning, match="the critic trains in full beside the LoRA policy"):
        module.configure_model()
    assert hasattr(module.policy, "disable_adapter") and not hasattr(module.critic, "disable_adapter")
    assert all(p.requires_grad for p in module.critic.parameters())  # full fine-tuning
    module = lora_module(policy_dir, critic=ModelSpec(lora=LoRA(r=2, alpha=2)))
    module.configure_model()
    assert module.critic.peft_config["default"].r == 2 and module.policy.peft_config["default"].r == 4


def run(root: Path, data_dir: Path, policy_dir: Path, max_steps: int, ckpt_path=None, precision="32-true", **overrides):
    L.seed_everything(5)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(root, max_steps=max_steps, callbacks=[ckpt, ValuePretraining(steps=1)], precision=precision)
    module = lora_module(policy_dir, optim=Optim(actor_lr=1e-2, critic_lr=1e-2, warmup_steps=2), **overrides)
    trainer.fit(module, datamodule=tiny_data(data_dir), ckpt_path=ckpt_path)
    return module, scalars(root)


@pytest.mark.slow
def test_a_lora_checkpoint_holds_adapters_and_resumes_exactly(tok, policy_dir, tmp_path):
    full_module, full = run(tmp_path / "full", tmp_path, policy_dir, 4)
    run(tmp_path / "part", tmp_path, policy_dir, 2)
    ckpt = torch.load(tmp_path / "part/ckpt/last.ckpt", weights_only=False, map_location="cpu")
    keys = ckpt["state_dict"].keys()
    assert keys and all("lora_" in k or ".modules_to_save." in k for k in keys), sorted(keys)[:5]
    assert set(ckpt["lora_base"]) == {"policy", "critic"}
    (tmp_path / "part2").mkdir()
    (tmp_path / "part2" / "ckpt").symlink_to(tmp_path / "part" / "ckpt")
    resumed_module, resumed = run(tmp_path / "part2", tmp_path, policy_dir, 4, ckpt_path="last")
    for name, values in resumed.items():
        if name.startswith(("timing_s/", "perf/")) or name in ("epoch", "hp_metric"):
            continue
        assert [v for _, v in values] == [v for step, v in full[name] if step >= 2], name
    for m in ("policy", "critic"):
        for (name, p), q in zip(getattr(full_module, m).named_parameters(), getattr(resumed_module, m).parameters()):
            assert torch.equal(p, q), name


def test_a_lora_checkpoint_refuses_a_full_model_config_and_other_base_weights(tok, policy_dir, tmp_path):
    run(tmp_path / "part", tmp_path, policy_dir, 1)
    last = str(tmp_path / "part/ckpt/last.ckpt")
    with pytest.raises(SetupError, match=r"holds LoRA adapters for the policy, but model\.policy\.lora is not set"):
        run(
            tmp_path / "full",
            tmp_path,
            policy_dir,
            2,
            ckpt_path=last,
            policy=ModelSpec(name_or_path=str(policy_dir)),
            critic=ModelSpec(lora=None),
        )
    other = AutoModelForCausalLM.from_pretrained(policy_dir)
    with torch.no_grad():
        other.model.norm.weight.add_(1e-3)
    other.save_pretrained(policy_dir)
    with pytest.raises(SetupError, match="policy's base weights differ from those its LoRA adapters"):
        run(tmp_path / "again", tmp_path, policy_dir, 2, ckpt_path=last)


def test_a_full_checkpoint_refuses_a_lora_config(tok, policy_dir, tmp_path):
    run(tmp_path / "full", tmp_path, policy_dir, 1, policy=ModelSpec(name_or_path=str(policy_dir)))
    with pytest.raises(SetupError, match=r"holds full weights for the policy, but model\.policy\.lora is set"):
        run(tmp_path / "lora", tmp_path, policy_dir, 2, ckpt_path=str(tmp_path / "full/ckpt/last.ckpt"))


@pytest.mark.slow
def test_export_writes_merged_models_and_on_request_the_adapters(tok, policy_dir, tmp_path):
    module, _ = run(tmp_path / "run", tmp_path, policy_dir, 2)
    written = export_checkpoint(tmp_path / "run/ckpt/last.ckpt", tmp_path / "out", adapters=True)
    assert [p.name for p in written] == ["policy", "policy_adapter", "critic", "critic_adapter"]
    ids = torch.randint(0, 200, (2, 10))
    with torch.no_grad():
        expected = module.policy(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out/policy").eval()
        assert (plain(input_ids=ids).logits - expected).abs().max() < 1e-4
        assert not (tmp_path / "out/policy/adapter_config.json").exists()
        with module.policy.disable_adapter():
            assert (module.policy(input_ids=ids).logits - expected).abs().max() > 1e-3  # it learned
        base = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "out/policy_adapter").eval()
        assert (adapted(input_ids=ids).logits - expected).abs().max() < 1e-4
        values = module.critic(input_ids=ids).logits
        critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "out/critic").eval()
        assert (critic(input_ids=ids).logits - values).abs().max() < 1e-4
    config = json.loads((tmp_path / "out/policy/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_under_mixed_precision_each_frozen_base_is_kept_in_the_compute_dtype(tok, policy_dir, tmp_path):
    """bf16-mixed: each base in bf16 (2 bytes a parameter, not 4), the adapters and the value
    head in fp32 with their AdamW states; the run resumes exactly, refuses a resume in another
    precision, and exports the merged weights it trained."""
    full_module, full = run(tmp_path / "full", tmp_path, policy_dir, 3, precision="bf16-mixed")
    for m in ("policy", "critic"):
        model = getattr(full_module, m)
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}, m
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}, m
    states = [s for o in full_module.trainer.optimizers for s in o.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    run(tmp_path / "part", tmp_path, policy_dir, 2, precision="bf16-mixed")
    last = tmp_path / "part/ckpt/last.ckpt"
    assert torch.load(last, weights_only=False)["lora_base_dtype"] == {"policy": "bfloat16", "critic": "bfloat16"}
    resumed_module, resumed = run(
        tmp_path / "part2", tmp_path, policy_dir, 3, ckpt_path=str(last), precision="bf16-mixed"
    )
    assert [v for _, v in resumed["actor/pg_loss"]] == [v for step, v in full["actor/pg_loss"] if step >= 2]
    for m in ("policy", "critic"):
        for (name, p), q in zip(getattr(full_module, m).named_parameters(), getattr(resumed_module, m).parameters()):
            assert torch.equal(p, q), name
    with pytest.raises(
        SetupError, match=r"trained on its base in bfloat16, this run keeps it in float32: .*\(bf16-mixed\)"
    ):
        run(tmp_path / "fp32", tmp_path, policy_dir, 3, ckpt_path=str(last))
    export_checkpoint(tmp_path / "full/ckpt/last.ckpt", tmp_path / "out")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out/policy")
    merged = dict(merged_weights(full_module.policy))
    assert plain.model.norm.weight.dtype == torch.bfloat16  # the base's dtype, as trained
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, merged[name]), name


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (
            LoRA(target_modules=["no_such_layer"]),
            r"model\.policy\.lora: peft cannot put adapters on LlamaForCausalLM with target_modules=\['no_such_layer'\]: .*its linear layers: .*q_proj",
        ),
        (
            LoRA(target_modules=["input_layernorm"]),
            r"model\.policy\.lora: peft cannot put adapters on LlamaForCausalLM with target_modules=\['input_layernorm'\]",
        ),
    ],
)
def test_bad_lora_setup_fails_in_one_line_before_any_step(tok, policy_dir, tmp_path, lora, message):
    module = tiny_module(policy_dir, policy=ModelSpec(name_or_path=str(policy_dir), lora=lora))
    with pytest.raises(SetupError, match=message) as error:
        tiny_trainer(tmp_path).fit(module, datamodule=tiny_data(tmp_path))
    assert "\n" not in str(error.value)
    assert not scalars(tmp_path)  # no step, no validation ran


def test_a_policy_without_a_source_fails_in_one_line(tok):
    with pytest.raises(SetupError, match=r"model\.policy: give name_or_path"):
        tiny_module(tok, policy=ModelSpec(lora=LORA))


def test_lora_settings_are_checked():
    with pytest.raises(SetupError, match=r"lora\.r must be >= 1"):
        LoRA(r=0)
    with pytest.raises(SetupError, match=r"lora\.dropout must be in \[0, 1\)"):
        LoRA(dropout=1.0)


@pytest.mark.slow
def test_tools_value_pretraining_and_extra_critic_steps_run_with_lora(tok, policy_dir, tmp_path):
    from tests.tool_helpers import EverySpace

    L.seed_everything(0)
    algo = Algorithm(mini_batch_size=8, micro_batch_size=4, critic_updates_per_step=2)
    module = lora_module(policy_dir, tools=[EverySpace(fail_over=2)], algorithm=algo)
    module.configure_model()
    frozen = {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    tiny_trainer(tmp_path, max_steps=3, callbacks=[ValuePretraining(steps=1)]).fit(
        module, datamodule=tiny_data(tmp_path)
    )
    logged = scalars(tmp_path)
    assert min(v for _, v in logged["tools/calls/mean"]) > 0  # the policy called the tool
    assert len(logged["critic/grad_norm"]) == 3 and len(logged["actor/grad_norm"]) == 2  # (means per step)
    assert all(torch.equal(p, frozen[n]) for n, p in module.policy.named_parameters() if n in frozen)
