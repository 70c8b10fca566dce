"""Rollout generation: chunked `generate` equals one call, extra stop tokens end responses."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TINY_LLAMA
from vapo_lightning.config import Generation
from vapo_lightning.engines.native import generate
from vapo_lightning.rollout import policy_logits

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    cfg.vocab_size, cfg.pad_token_id, cfg.eos_token_id = 40, PAD, EOS
    return AutoModelForCausalLM.from_config(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def test_chunked_generation_equals_one_call(policy):
    one = generate(policy, PROMPTS, Generation(n=3, max_new_tokens=10, temperature=0), PAD, EOS)
    for size in (1, 5, 12):
        cfg = Generation(n=3, max_new_tokens=10, temperature=0, max_batch_size=size)
        chunked = generate(policy, PROMPTS, cfg, PAD, EOS)
        assert torch.equal(chunked.response_mask, one.response_mask)
        assert torch.equal(chunked.input_ids, one.input_ids)
        assert torch.equal(chunked.truncated, one.truncated)
        assert chunked.group_ids.tolist() == [g for g in range(4) for _ in range(3)]


def test_stop_token_ids_end_responses_like_eos(policy):
    cfg = Generation(n=1, max_new_tokens=12, temperature=0)
    free = generate(policy, PROMPTS, cfg, PAD, EOS)
    # Pick a token the greedy responses emit mid-way and declare it a stop token.
    row = int(free.response_lengths.argmax())
    stop = int(free.responses[row, 2])
    cut = generate(policy, PROMPTS, Generation(**{**cfg.__dict__, "stop_token_ids": [stop]}), PAD, EOS)
    for i in range(len(PROMPTS)):
        full = free.responses[i][free.response_mask[i]].tolist()
        got = cut.responses[i][cut.response_mask[i]].tolist()
        want = full[: full.index(stop) + 1] if stop in full else full
        assert got == want, i
        assert bool(cut.truncated[i]) == (stop not in full and bool(free.truncated[i]))
    assert (cut.responses[~cut.response_mask] == PAD).all()


def test_bad_generation_settings_are_rejected():
    with pytest.raises(ValueError, match="max_batch_size"):
        Generation(max_batch_size=0)


def test_policy_logits_are_the_response_positions_of_a_full_forward(policy):
    r = generate(policy, PROMPTS, Generation(n=2, max_new_tokens=6), PAD, EOS)
    T = r.response_mask.shape[1]
    with torch.no_grad():
        full = policy(input_ids=r.input_ids, attention_mask=r.attention_mask, position_ids=r.position_ids).logits
        logits = policy_logits(policy, r)
    assert logits.is_contiguous() and logits.shape == (len(r), T, full.shape[-1])
    torch.testing.assert_close(logits, full[:, -T - 1 : -1])


def test_an_eos_that_is_also_the_pad_token_stays_the_responses_last_action(policy):
    """SmolLM2's tokenizer pads with its EOS (`<|im_end|>`). The EOS the model chose is in
    the response mask, as when the two differ: a mask built from `!= pad` would drop it, and
    the policy would never be trained to stop."""
    cfg = Generation(n=2, max_new_tokens=12, temperature=0)
    free = generate(policy, PROMPTS, cfg, PAD, EOS)
    eos = int(free.responses[int(free.response_lengths.argmax()), 2])  # one it emits mid-way
    apart = generate(policy, PROMPTS, cfg, PAD, eos)
    same = generate(policy, PROMPTS, cfg, eos, eos)
    assert torch.equal(same.response_mask, apart.response_mask)
    assert torch.equal(same.responses[same.response_mask], apart.responses[apart.response_mask])
    ended = ~same.truncated
    assert ended.any()
    last = same.response_lengths[ended] - 1
    assert (same.responses[ended, last] == eos).all()
