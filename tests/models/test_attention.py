"""The CPU-aware SDPA attention (`vapo_lightning.attention`): the same outputs and masks as
transformers' SDPA, an fp32 kernel under CPU autocast except while decoding on a CPU with AMX,
and nothing of it saved with the model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from tests.helpers import TINY_LLAMA
from vapo_lightning import attention
from vapo_lightning.attention import SDPA, decoding
from vapo_lightning.engines.sampler import sample_responses
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
        assert torch.equal(
            reloaded(input_ids=ids, attention_mask=mask).logits, policy(input_ids=ids, attention_mask=mask).logits
        )


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
    # Under CPU autocast (the fp32 branch with its own casts): a padded row still attends to
    # its own tokens only, and the output is close to fp32 (bf16 matmuls around it).
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        mixed_alone = policy(input_ids=ids[1:2, -2:]).logits.float()
    torch.testing.assert_close(mixed[1, -2:], mixed_alone[0], rtol=0.02, atol=0.02)
    torch.testing.assert_close(mixed, got, rtol=0.05, atol=0.05 * got.abs().max().item())


class KernelDtypes(TorchDispatchMode):
    """The dtypes SDPA's kernel really runs in (after autocast's casts), one set per call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[set[torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.seen.append({a.dtype for a in args[:3]})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_under_cpu_autocast_attention_runs_in_fp32_except_while_decoding(models, amx, monkeypatch):
    """The forwards that give pi_old (no grad) and the update's log-probs (grad) run the same
    fp32 kernel (the dtype checks; choosing by grad mode would fail them), and decoding's run in
    bf16 on a CPU with AMX, in fp32 on one without (either is simulated here, whatever this
    machine has). The logits-equality and gradient checks are sanity checks, not proof of the
    kernel."""
    monkeypatch.setattr(attention, "cpu_has_amx", lambda: amx)
    decode_dtype = torch.bfloat16 if amx else torch.float32
    policy, plain = models
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with KernelDtypes() as k:
            train = policy(input_ids=ids, attention_mask=mask).logits
        assert k.seen and all(s == {torch.float32} for s in k.seen)
        with KernelDtypes() as k, torch.no_grad():
            old = policy(input_ids=ids, attention_mask=mask).logits
        assert k.seen and all(s == {torch.float32} for s in k.seen)
        assert torch.equal(train.detach(), old)
        with KernelDtypes() as k, torch.no_grad(), decoding():
            policy(input_ids=ids, attention_mask=mask)
        assert k.seen and all(s == {decode_dtype} for s in k.seen)
        with KernelDtypes() as k:
            plain(input_ids=ids, attention_mask=mask)  # transformers' SDPA: bf16
        assert k.seen and all(s == {torch.bfloat16} for s in k.seen)
        with KernelDtypes() as k:
            sample_responses(policy, ids, mask, max_new_tokens=2, stop_token_ids=[2], pad_token_id=PAD)
        assert k.seen and all(s == {decode_dtype} for s in k.seen)  # as the sampler decodes
    loss = train.float().logsumexp(-1).mean()
    loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    policy(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).mean().backward()  # fp32
    for n, p in policy.named_parameters():  # bf16 matmuls: close to the fp32 gradients
        torch.testing.assert_close(got[n], p.grad, rtol=0.1, atol=0.05 * p.grad.abs().max().item())
    policy.zero_grad(set_to_none=True)


def test_only_standard_model_types_use_it():
    """Some architectures test the name "sdpa" in their own code: they keep it."""
    gpt2 = build_policy(
        ModelSpec(config={"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}), Tok()
    )
    assert gpt2.config._attn_implementation == "sdpa"


def reference_decode_attention(query, key, value, mask, scaling):
    """The obvious loop: every query head against its key head, row by row."""
    B, H, _, D = query.shape
    groups = H // key.shape[1]
    out = torch.empty(B, 1, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            k, v = key[b, h // groups].double(), value[b, h // groups].double()
            s = k @ query[b, h, 0].double() * scaling
            s[~mask[b, 0, 0]] = float("-inf")
            out[b, 0, h] = s.softmax(-1) @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_equals_the_per_head_loop(dtype):
    """On views of a larger cache buffer (the sampler's), a padded row, 3 query heads per key
    head (SmolLM2's 9 over 3)."""
    torch.manual_seed(0)
    B, H, kv_heads, T, D = 3, 6, 2, 7, 16
    buf_k, buf_v = (torch.randn(B, kv_heads, 20, D, dtype=dtype) for _ in range(2))
    key, value = buf_k[:, :, :T], buf_v[:, :, :T]
    query = torch.randn(B, H, 1, D, dtype=dtype)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[1, ..., :4] = False  # left padding
    got, _ = attention.grouped_decode_attention(query, key, value, mask, 0.3)
    want = reference_decode_attention(query, key, value, mask, 0.3)
    assert got.shape == (B, 1, H, D) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    additive = torch.zeros(B, 1, 1, T).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(attention.grouped_decode_attention(query, key, value, additive, 0.3)[0], got)


def test_shared_prefix_attention_equals_each_rows_own_cache():
    """Rows of unequal groups, unsorted, read their prompt's cache once (`SharedPrefix`): the
    same output as attention over each row's own copy of it followed by its own tokens; also
    once rows left the batch and a prompt lost all of its rows."""
    torch.manual_seed(0)
    G, kv_heads, H, P, T, D = 3, 2, 6, 5, 4, 16
    prefix_k, prefix_v = torch.randn(G, kv_heads, P, D), torch.randn(G, kv_heads, P, D)
    group = torch.tensor([0, 2, 0, 1, 2, 2, 0])
    B = len(group)
    own_k, own_v = torch.randn(B, kv_heads, T, D), torch.randn(B, kv_heads, T, D)
    query = torch.randn(B, H, 1, D)
    mask = torch.ones(B, 1, 1, P + T, dtype=torch.bool)
    mask[group == 1, ..., :2] = False  # prompt 1 is left-padded
    prefix = attention.SharedPrefix(prefix_k, prefix_v, group)
    whole_k, whole_v = torch.cat([prefix_k[group], own_k], 2), torch.cat([prefix_v[group], own_v], 2)
    got, _ = attention.grouped_decode_attention(query, own_k, own_v, mask, 0.3, prefix)
    want = reference_decode_attention(query, whole_k, whole_v, mask, 0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    keep = torch.tensor([1, 3, 4])  # rows of prompts 2, 1, 2: prompt 0 has none left
    prefix.select(keep)
    assert len(prefix.keys) == 2 and prefix.n == 2
    got, _ = attention.grouped_decode_attention(query[keep], own_k[keep], own_v[keep], mask[keep], 0.3, prefix)
    want = reference_decode_attention(query[keep], whole_k[keep], whole_v[keep], mask[keep], 0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_sampling_with_grouped_decoding_equals_transformers_sdpa(models):
    """Greedy responses of the sampler on the model with this attention (grouped decoding
    steps) and on the same weights with transformers' SDPA: the same tokens."""
    policy, plain = models
    ids, mask = batch()
    kwargs = dict(max_new_tokens=12, stop_token_ids=[], pad_token_id=PAD, temperature=0.0)
    ours = sample_responses(policy, ids, mask, **kwargs)
    theirs = sample_responses(plain, ids, mask, **kwargs)
    assert torch.equal(ours, theirs)
