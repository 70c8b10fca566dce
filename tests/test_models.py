"""Policy and critic loading: from a config, from the policy, from a path (HF in and out)."""

import torch
from transformers import AutoModelForTokenClassification, LlamaConfig, LlamaForCausalLM

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


def test_llama_without_classifier_dropout_in_its_config_loads_as_critic(tmp_path):
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    cfg = LlamaConfig(
        **{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=len(tok)
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "rm")
    critic = build_critic(ModelSpec(name_or_path=str(tmp_path / "rm")), None, tok)
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert values.shape == (1, 3, 1)
