"""Policy and critic loading: from a config, from the policy, from a path (HF in and out)."""

import itertools

import pytest
import torch
from transformers import (
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from tests.helpers import TINY_LLAMA, build_tokenizer
from vapo_lightning.models import ModelSpec, build_critic, build_policy, load_tokenizer


def test_critic_from_policy_weights_from_a_causal_lm_path_and_from_a_saved_critic(tmp_path):
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    policy = build_policy(ModelSpec(config=TINY_LLAMA, tokenizer=str(tmp_path / "tok")), tok)
    assert policy.config.vocab_size == len(tok)

    critic = build_critic(None, policy, tok)  # the policy's backbone, a fresh small head
    for name, p in policy.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], p), name
    assert critic.score.weight.abs().max() < 0.2 and critic.config.classifier_dropout == 0.0

    policy.save_pretrained(tmp_path / "policy")  # a causal LM path: backbone loaded, head fresh
    from_path = build_critic(ModelSpec(name_or_path=str(tmp_path / "policy")), None, tok)
    assert torch.equal(from_path.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert from_path.score.weight.abs().max() < 0.2

    with torch.no_grad():
        critic.score.weight.fill_(0.5)  # a trained critic's head must survive a reload
    critic.save_pretrained(tmp_path / "critic")
    reloaded = build_critic(ModelSpec(name_or_path=str(tmp_path / "critic")), None, tok)
    assert torch.all(reloaded.score.weight == 0.5)
    assert isinstance(reloaded, type(AutoModelForTokenClassification.from_config(critic.config)))


def test_a_critic_from_a_language_model_says_its_head_is_new_in_one_line(tmp_path, capfd, caplog):
    """transformers' table of missing keys (`score.bias | MISSING`) is what a fresh value head
    looks like: one line says so instead; a reloaded critic says nothing."""
    import logging

    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    policy = build_policy(ModelSpec(config=TINY_LLAMA, tokenizer=str(tmp_path / "tok")), tok)
    policy.save_pretrained(tmp_path / "policy")
    with caplog.at_level(logging.INFO):
        critic = build_critic(ModelSpec(name_or_path=str(tmp_path / "policy")), None, tok)
    said = [r.getMessage() for r in caplog.records if "model.critic" in r.getMessage()]
    assert said == [
        f"model.critic: {tmp_path / 'policy'}'s backbone with a fresh value head (score.bias, score.weight)"
    ]
    assert "LOAD REPORT" not in capfd.readouterr().err
    critic.save_pretrained(tmp_path / "critic")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        build_critic(ModelSpec(name_or_path=str(tmp_path / "critic")), None, tok)
    assert not [r for r in caplog.records if "model.critic" in r.getMessage()]


def test_llama_without_classifier_dropout_in_its_config_loads_as_critic(tmp_path):
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=len(tok))
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "rm")
    critic = build_critic(ModelSpec(name_or_path=str(tmp_path / "rm")), None, tok)
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert values.shape == (1, 3, 1)


def test_meta_builds_have_the_loaded_architecture_and_read_no_weights(tmp_path, monkeypatch):
    """What fsdp ranks > 0 build: the same classes, names, shapes, dtypes, config, generation
    config, train/eval mode and weight tying as a real load, all on the meta device."""
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "ckpt")))
    cfg = LlamaConfig(
        **{k: v for k, v in TINY_LLAMA.items() if k != "model_type"},
        vocab_size=len(tok),
        tie_word_embeddings=True,
    )
    saved = LlamaForCausalLM(cfg)
    saved.generation_config.update(do_sample=True, top_p=0.7)  # a checkpoint's own defaults
    saved.save_pretrained(tmp_path / "ckpt")
    path = ModelSpec(name_or_path=str(tmp_path / "ckpt"))
    config = ModelSpec(config=TINY_LLAMA, tokenizer=str(tmp_path / "ckpt"))

    def real_and_meta(meta: bool) -> list[PreTrainedModel]:
        policy = build_policy(path, tok, meta=meta)
        return [
            policy,
            build_critic(None, policy, tok, meta=meta),  # backbone of the policy, fresh head
            build_critic(path, None, tok, meta=meta),  # a critic / reward model path
            build_policy(config, tok, meta=meta),  # random init from a config
            build_critic(config, None, tok, meta=meta),
        ]

    real = real_and_meta(meta=False)

    def no_weights(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained called by a meta build")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(no_weights))
    meta = real_and_meta(meta=True)

    assert real[0].generation_config.top_p == 0.7
    assert meta[0].generation_config.to_dict() == real[0].generation_config.to_dict()
    for r, m in zip(real, meta, strict=True):
        assert type(m) is type(r) and m.training == r.training
        assert m.config.to_dict() == r.config.to_dict()
        real_tensors = dict(itertools.chain(r.named_parameters(), r.named_buffers()))
        meta_tensors = dict(itertools.chain(m.named_parameters(), m.named_buffers()))
        assert all(t.is_meta for t in meta_tensors.values())
        assert not any(t.is_meta for t in real_tensors.values())
        assert {k: (t.shape, t.dtype) for k, t in meta_tensors.items()} == {
            k: (t.shape, t.dtype) for k, t in real_tensors.items()
        }
    assert meta[0].lm_head.weight is meta[0].model.embed_tokens.weight  # tied, as loaded
    assert real[0].lm_head.weight is real[0].model.embed_tokens.weight


def test_a_critic_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from vapo_lightning.tokenization import train_bpe

    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    policy = build_policy(ModelSpec(config=TINY_LLAMA, tokenizer=str(tmp_path / "tok")), tok)
    policy.save_pretrained(tmp_path / "same")
    tok.save_pretrained(tmp_path / "same")  # the policy's own tokenizer: accepted
    build_critic(ModelSpec(name_or_path=str(tmp_path / "same")), None, tok)

    policy.save_pretrained(tmp_path / "other")
    train_bpe(["a quite different corpus of words"] * 50, vocab_size=300).save_pretrained(tmp_path / "other")
    with pytest.raises(
        ValueError,
        match=r"model.critic: its tokenizer \(.*other\) is not the policy's \(.*tok\): \d+ of \d+ token ids differ",
    ):
        build_critic(ModelSpec(name_or_path=str(tmp_path / "other")), None, tok)


def test_gradient_checkpointing_reaches_the_critic_built_from_the_policy(tmp_path):
    """`model.policy.gradient_checkpointing` on a run whose critic is the policy's backbone
    (no critic spec): both models trade compute for activation memory, not the policy alone."""
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    for flag in (True, False):
        policy = build_policy(
            ModelSpec(config=TINY_LLAMA, tokenizer=str(tmp_path / "tok"), gradient_checkpointing=flag), tok
        )
        critic = build_critic(None, policy, tok)
        assert policy.is_gradient_checkpointing == critic.is_gradient_checkpointing == flag
