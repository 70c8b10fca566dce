"""The CPU-aware SDPA attention (`vapo_lightning.attention`): the same outputs and masks as
transformers' SDPA, fp32 inputs to the kernel under CPU autocast while autograd records, and
nothing of it saved with the model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import TINY_LLAMA
from vapo_lightning.attention import SDPA
from vapo_lightning.models import ModelSpec, build_critic, build_policy

PAD = 0


class Tok:
    """What build_policy / build_critic read of a tokenizer."""

    pad_token_id, eos_token_id, bos_token_id = PAD, 2, 1

    def __len__(self) -> int:
        return 40


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    policy = build_policy(ModelSpec(config={**TINY_LLAMA, "initializer_range": 0.3}), Tok())
    plain = build_policy(ModelSpec(config=TINY_LLAMA), Tok())
    plain.load_state_dict(policy.state_dict())
    plain.set_attn_implementation("sdpa")
    return policy, plain


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows of different lengths: the padding mask matters."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    ids = torch.tensor([[PAD] * (6 - len(p)) + p for p in prompts])
    return ids, (ids != PAD).long()


def test_built_models_use_it_and_do_not_save_it(models, tmp_path):
    policy, _ = models
    critic = build_critic(None, policy, Tok())
    assert policy.config._attn_implementation == SDPA
    assert critic.config._attn_implementation == SDPA
    policy.save_pretrained(tmp_path)
    assert SDPA not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # without this package's name
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits,
                           policy(input_ids=ids, attention_mask=mask).logits)  # fmt: skip


def test_fp32_outputs_and_padding_masks_equal_transformers_sdpa(models):
    policy, plain = models
    ids, mask = batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = plain(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        alone = policy(input_ids=ids[1:2, -2:]).logits  # row 1 without its padding
    assert torch.equal(got, want)
    torch.testing.assert_close(got[1, -2:], alone[0], rtol=1e-5, atol=1e-5)


def test_under_cpu_autocast_the_kernel_gets_fp32_only_while_autograd_records(models, monkeypatch):
    policy, plain = models
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        # the dtypes the kernel runs in: autocast casts q, k, v to bf16 inside the call
        bf16 = torch.is_autocast_enabled("cpu")
        seen.append({torch.bfloat16} if bf16 else {q.dtype, k.dtype, v.dtype})
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = policy(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).mean()
        assert seen and all(s == {torch.float32} for s in seen)
        seen.clear()
        with torch.no_grad():  # decoding, no-grad forwards: bf16 (faster forward)
            policy(input_ids=ids, attention_mask=mask)
        assert seen and all(s == {torch.bfloat16} for s in seen)
        seen.clear()
        plain(input_ids=ids, attention_mask=mask)  # transformers' SDPA: bf16 either way
        assert seen and all(s == {torch.bfloat16} for s in seen)
    loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    policy(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).mean().backward()  # fp32
    for n, p in policy.named_parameters():  # bf16 matmuls: close to the fp32 gradients
        torch.testing.assert_close(got[n], p.grad, rtol=0.1, atol=0.05 * p.grad.abs().max().item())
    policy.zero_grad(set_to_none=True)
