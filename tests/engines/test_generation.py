"""The rollout sampler against slow, obvious references: greedy decoding equals a loop of full
forwards without a cache (through cache growth and batch compaction), sampled tokens follow
softmax(logits / T) and the top-p nucleus, stop tokens and min_new_tokens behave."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TINY_LLAMA
from vapo_lightning.attention import SDPA, SharedPrefix
from vapo_lightning.engines import sampler
from vapo_lightning.engines.kv_cache import GrowingLayer
from vapo_lightning.engines.sampler import (
    inverse_cdf_draw,
    next_tokens,
    sample_responses,
)

PAD, EOS, V = 0, 2, 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    cfg.vocab_size, cfg.pad_token_id, cfg.eos_token_id = V, PAD, EOS
    cfg.initializer_range = 0.3  # peaked attention: outputs depend on positions and the cache
    return AutoModelForCausalLM.from_config(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17], [18, 19, 20, 21]]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new: int, stop: set[int], min_new: int = 0):
    """One prompt alone, a full forward over the whole sequence for every new token."""
    seq, out = list(prompt), []
    for t in range(max_new):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
        if t < min_new:
            logits[list(stop)] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


def rows(out: torch.Tensor) -> list[list[int]]:
    """Each row up to and including its first stop token (the rest must be padding)."""
    result = []
    for row in out.tolist():
        n = len(row)
        while n and row[n - 1] == PAD:
            n -= 1
        result.append(row[:n])
    return result


@pytest.mark.parametrize("compact_fraction", [0.01, 0.5, 1.0])
def test_greedy_equals_uncached_full_forwards(model, compact_fraction):
    """Stops: the most common greedy token of the free run, so rows end at different steps
    and (with a small compact_fraction) leave the batch one by one."""
    ids, mask = left_pad(PROMPTS)
    free = sample_responses(
        model, ids, mask, max_new_tokens=20, stop_token_ids=[EOS], pad_token_id=PAD, temperature=0.0
    )
    stop = int(free[:, 1:].flatten().mode().values)
    out = sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=20,
        stop_token_ids=[EOS, stop],
        pad_token_id=PAD,
        temperature=0.0,
        compact_fraction=compact_fraction,
    )
    want = [greedy_reference(model, p, 20, {EOS, stop}) for p in PROMPTS]
    assert rows(out) == want
    assert len({len(w) for w in want}) > 2  # rows really ended at different steps
    assert out.shape[1] == max(map(len, want))


def test_a_prompt_asked_n_times_is_prefilled_once(model, monkeypatch):
    """Group sampling repeats each prompt n times: the first forward sees each distinct
    prompt once, and every row still decodes from its own copy of the cache (greedy tokens
    equal each prompt's reference; sampled rows of one prompt differ)."""
    group = [PROMPTS[0], PROMPTS[2]] * 2 + [PROMPTS[0], PROMPTS[1]]  # 3 distinct of 6, unsorted
    ids, mask = left_pad(group)
    batches = []
    forward = type(model).forward
    monkeypatch.setattr(
        type(model), "forward", lambda self, **kw: (batches.append(len(kw["input_ids"])), forward(self, **kw))[1]
    )
    out = sample_responses(model, ids, mask, max_new_tokens=12, stop_token_ids=[EOS], pad_token_id=PAD, temperature=0.0)
    assert batches[:2] == [3, 6]
    assert rows(out) == [greedy_reference(model, p, 12, {EOS}) for p in group]
    torch.manual_seed(0)
    sampled = sample_responses(
        model, ids, mask, max_new_tokens=12, stop_token_ids=[EOS], pad_token_id=PAD, temperature=1.0
    )
    assert len({tuple(r) for r in rows(sampled)[::2]}) > 1  # rows 0, 2, 4: one prompt, three samples


@torch.no_grad()
def test_rows_of_one_prompt_share_its_cache(model, monkeypatch):
    """With the project's attention on the CPU, the rows of a prompt asked n times read one
    copy of its cache (`attention.SharedPrefix`): greedy tokens equal each prompt's reference
    through rows leaving the batch one by one, and sampled tokens, log-probs and entropies
    equal those of the rows' own copies (the same draws)."""
    shared_model = copy.deepcopy(model)
    shared_model.set_attn_implementation(SDPA)
    group = [PROMPTS[0], PROMPTS[2]] * 2 + [PROMPTS[0], PROMPTS[1], PROMPTS[2]]  # unequal groups
    ids, mask = left_pad(group)
    read = []
    scores = SharedPrefix.scores
    monkeypatch.setattr(SharedPrefix, "scores", lambda self, q: (read.append(len(self.keys)), scores(self, q))[1])
    free = sample_responses(
        shared_model, ids, mask, max_new_tokens=12, stop_token_ids=[EOS], pad_token_id=PAD, temperature=0.0
    )
    stop = int(free[:, 1:].flatten().mode().values)
    out = sample_responses(
        shared_model,
        ids,
        mask,
        max_new_tokens=12,
        stop_token_ids=[EOS, stop],
        pad_token_id=PAD,
        temperature=0.0,
        compact_fraction=0.01,
    )
    want = [greedy_reference(model, p, 12, {EOS, stop}) for p in group]
    assert rows(out) == want and len({len(w) for w in want}) > 2
    assert read and max(read) == 3  # three prompts' caches, each read once per step and layer
    kwargs = dict(
        max_new_tokens=12,
        stop_token_ids=[EOS, 3, 4],
        pad_token_id=PAD,
        temperature=0.8,
        compact_fraction=0.2,
        logprobs=True,
    )
    torch.manual_seed(0)
    got = sample_responses(shared_model, ids, mask, **kwargs)
    monkeypatch.setattr(sampler, "shares_prompt_cache", lambda *args: False)
    torch.manual_seed(0)
    copied = sample_responses(shared_model, ids, mask, **kwargs)
    assert torch.equal(got.tokens, copied.tokens)
    torch.testing.assert_close(got.logprobs, copied.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, copied.entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_long_forced_responses_equal_the_reference(model):
    """100 forced tokens (min_new_tokens): every position still matches full forwards."""
    ids, mask = left_pad(PROMPTS[:2])
    out = sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=100,
        min_new_tokens=100,
        stop_token_ids=[EOS],
        pad_token_id=PAD,
        temperature=0.0,
    )
    assert out.shape == (2, 100)
    for p, got in zip(PROMPTS[:2], out.tolist()):
        assert got == greedy_reference(model, p, 100, {EOS}, min_new=100)


@torch.no_grad()
def test_sampled_logprobs_equal_full_forwards(model):
    """`logprobs=True`: each sampled token's log softmax(logits / T), and the entropy of that
    softmax, equal one full forward over prompt and response (the trainer's recompute),
    through rows leaving the batch, top-p
    and min_new_tokens narrowing the draw (the log-prob is the untruncated distribution's, as
    the trainer's); 0 after each row's stop token."""
    ids, mask = left_pad(PROMPTS)
    torch.manual_seed(0)
    out, logprobs, entropy = sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=16,
        min_new_tokens=2,
        stop_token_ids=[EOS, 3, 4],
        pad_token_id=PAD,
        temperature=0.7,
        top_p=0.9,
        compact_fraction=0.01,
        logprobs=True,
    )
    assert logprobs.shape == entropy.shape == out.shape and logprobs.dtype == torch.float32
    lengths = [len(r) for r in rows(out)]
    assert len(set(lengths)) > 1  # rows ended at different steps
    for prompt, response, lp, h, n in zip(PROMPTS, out.tolist(), logprobs, entropy, lengths):
        logits = model(input_ids=torch.tensor([prompt + response[:n]])).logits[0, len(prompt) - 1 : -1]
        log_p = (logits / 0.7).log_softmax(-1)
        want = log_p.gather(-1, torch.tensor(response[:n])[:, None])[:, 0]
        torch.testing.assert_close(lp[:n], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[:n], -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=1e-5)
        assert (lp[n:] == 0).all() and (h[n:] == 0).all()
    torch.manual_seed(0)
    plain = sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=16,
        min_new_tokens=2,
        stop_token_ids=[EOS, 3, 4],
        pad_token_id=PAD,
        temperature=0.7,
        top_p=0.9,
        compact_fraction=0.01,
    )
    assert torch.equal(plain, out)  # the same draws with or without log-probs


def test_growing_layer_keeps_what_was_written():
    """From 64 slots (no capacity given) the buffer doubles on the way to 277 positions."""
    layer, written = GrowingLayer(), []
    for step in [5, 1, 70, 1, 200]:
        k, v = torch.randn(3, 2, step, 4), torch.randn(3, 2, step, 4)
        written.append((k, v))
        keys, values = layer.update(k, v)
    assert torch.equal(keys, torch.cat([k for k, _ in written], 2))
    assert torch.equal(values, torch.cat([v for _, v in written], 2))
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, torch.cat([k for k, _ in written], 2)[[2, 0]])
    assert layer.get_seq_length() == 277


def test_min_new_tokens_and_padding_after_stop(model):
    ids, mask = left_pad(PROMPTS)
    free = sample_responses(model, ids, mask, max_new_tokens=3, min_new_tokens=2, stop_token_ids=[], pad_token_id=PAD)
    assert free.shape == (len(PROMPTS), 3)  # no stop tokens at all: every row runs to the end
    torch.manual_seed(1)
    out = sample_responses(
        model, ids, mask, max_new_tokens=12, min_new_tokens=6, stop_token_ids=[EOS, 7, 8, 9], pad_token_id=PAD
    )
    for row in out.tolist():
        assert not {7, 8, 9, EOS} & set(row[:6])
        ends = [i for i, t in enumerate(row) if t in {7, 8, 9, EOS}]
        if ends:
            assert all(t == PAD for t in row[ends[0] + 1 :])


def test_sampled_tokens_follow_the_tempered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(V) * 2
    n, temperature = 40_000, 0.7
    draws = next_tokens(logits.expand(n, V), temperature, 1.0)
    freq = torch.bincount(draws, minlength=V) / n
    p = (logits / temperature).softmax(-1)
    assert (freq - p).abs().max() < 4 * (p * (1 - p) / n).sqrt().max()


@pytest.mark.slow
def test_inverse_cdf_draws_never_return_a_zero_probability_token():
    """Masked tokens (top-k's -inf) between and after the kept ones, a row whose whole mass is
    on the last token, and a peaked row: 50k draws each, none lands on a zero."""
    torch.manual_seed(0)
    probs = torch.zeros(4, 10)
    probs[0, [1, 4, 5]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 9] = 1.0
    probs[2, [0, 7]] = torch.tensor([1 - 1e-7, 1e-7])
    probs[3, 3] = 1.0
    draws = torch.stack([inverse_cdf_draw(probs) for _ in range(50_000)])
    for row in range(4):
        assert set(draws[:, row].unique().tolist()) <= set(probs[row].nonzero().flatten().tolist())
    assert (draws[:, 1] == 9).all() and (draws[:, 3] == 3).all()
    freq = torch.bincount(draws[:, 0], minlength=10)[[1, 4, 5]] / 50_000
    torch.testing.assert_close(freq, torch.tensor([0.2, 0.5, 0.3]), atol=0.01, rtol=0)


@pytest.mark.parametrize("block", [256, 7])
def test_inverse_cdf_draw_in_blocks_equals_one_cumulative_sum(block):
    """The two-level draw picks, for the same uniform numbers, the index the one-level
    float64 search over the whole row picks (49,152 tokens at T 0.4, some masked to 0 as
    top-k does; draws that land within 1e-9 of a boundary excepted)."""
    torch.manual_seed(0)
    probs = (torch.randn(64, 49_152) * 3 / 0.4).softmax(-1)
    probs[:, ::5] = 0.0
    probs[1, 100:] = 0.0  # the whole mass in the first block
    probs[2, :-1] = 0.0  # on the last token alone
    cdf = probs.double().cumsum(-1)
    for _ in range(8):  # 512 draws
        u = torch.rand(64, 1, dtype=torch.float64)
        target = u * cdf[:, -1:]
        want = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        got = inverse_cdf_draw(probs, u, block)
        near = ((cdf - target).abs() < 1e-9 * cdf[:, -1:]).any(-1)
        assert torch.equal(got[~near], want[~near]) and (probs[torch.arange(64), got] > 0).all()


def test_top_p_keeps_the_smallest_nucleus_renormalised():
    torch.manual_seed(0)
    logits = torch.randn(V) * 2
    p = logits.softmax(-1)
    order = p.argsort(descending=True)
    # the smallest prefix of the sorted probabilities whose mass reaches 0.8
    k = int((p[order].cumsum(0) < 0.8).sum()) + 1
    nucleus = set(order[:k].tolist())
    n = 40_000
    draws = next_tokens(logits.expand(n, V), 1.0, 0.8)
    assert set(draws.unique().tolist()) == nucleus
    q = torch.zeros(V)
    q[order[:k]] = p[order[:k]] / p[order[:k]].sum()
    freq = torch.bincount(draws, minlength=V) / n
    assert (freq - q).abs().max() < 4 * (q * (1 - q) / n).sqrt().max() + 1e-9


def test_sampling_end_to_end_matches_the_model_distribution(model):
    """First sampled token of 20k copies of one prompt ~ softmax(model logits / T)."""
    ids, mask = left_pad([PROMPTS[2]])
    n, temperature = 20_000, 1.3
    torch.manual_seed(3)
    out = sample_responses(
        model,
        ids.expand(n, -1),
        mask.expand(n, -1),
        max_new_tokens=1,
        stop_token_ids=[EOS],
        pad_token_id=PAD,
        temperature=temperature,
    )
    with torch.no_grad():
        p = (model(input_ids=ids).logits[0, -1] / temperature).softmax(-1)
    freq = torch.bincount(out[:, 0], minlength=V) / n
    assert (freq - p).abs().max() < 4 * (p * (1 - p) / n).sqrt().max()


def record_in_forwards(monkeypatch, model, probe) -> list:
    """Calls `probe()` at every forward of `model`; returns the list the values land in."""
    seen, forward = [], model.forward

    def recording_forward(*args, **kwargs):
        seen.append(probe())
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording_forward)
    return seen


def test_sampling_records_no_autograd_graph(model, monkeypatch):
    """`sample_responses` is also called directly (benchmarks): its forwards must run without
    autograd whatever the caller's grad mode, or the KV cache would hold a graph of every step."""
    grad_modes = record_in_forwards(monkeypatch, model, torch.is_grad_enabled)
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    assert torch.is_grad_enabled()
    sample_responses(model, ids, mask, max_new_tokens=3, temperature=0.0, stop_token_ids=[], pad_token_id=PAD)
    assert grad_modes and not any(grad_modes)


def test_decoding_never_uses_cudnn_attention(model, monkeypatch):
    """cuDNN's attention re-planned at nearly every decoding step once rows had left the batch
    (42.8 vs 5.0 ms per step on an H200 in bf16): the sampler's forwards run without it, the
    other kernels stay as the caller set them, and the flags come back even after an error."""
    allowed = record_in_forwards(monkeypatch, model, torch.backends.cuda.cudnn_sdp_enabled)
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default
    sample_responses(model, ids, mask, max_new_tokens=3, temperature=0.0, stop_token_ids=[], pad_token_id=PAD)
    assert allowed and not any(allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored for training

    torch.backends.cuda.enable_flash_sdp(False)  # a caller's choice the sampler must keep
    flash = []

    def failing_forward(*args, **kwargs):
        flash.append(torch.backends.cuda.flash_sdp_enabled())
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "forward", failing_forward)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            sample_responses(model, ids, mask, max_new_tokens=3, temperature=0.0, stop_token_ids=[], pad_token_id=PAD)
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert flash == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.fixture
def cache_dtypes(monkeypatch) -> list[tuple[torch.dtype, torch.dtype]]:
    """(keys, values) dtypes of every KV cache layer the sampler sets up while the test runs."""
    dtypes, init = [], GrowingLayer.lazy_initialization

    def recording_init(self, k, v):
        init(self, k, v)
        dtypes.append((self._k.dtype, self._v.dtype))

    monkeypatch.setattr(GrowingLayer, "lazy_initialization", recording_init)
    return dtypes


@pytest.mark.slow
def test_autocast_decoding_keeps_the_cache_in_the_autocast_dtype(model, monkeypatch, cache_dtypes):
    """Under bf16 autocast the keys reach the cache in fp32 (rotary embedding) and SDPA cast
    the whole cache to bf16 at every step. Stored in bf16 once: half the bytes, and the same
    greedy tokens as the fp32 cache that SDPA casts itself. Without autocast: fp32. On a CPU
    with AMX, simulated here whatever this machine has (else: the next test)."""
    import vapo_lightning.attention as attention
    import vapo_lightning.engines.kv_cache as generation

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: True)

    def keys() -> set[torch.dtype]:
        return {k for k, _ in cache_dtypes}

    greedy_decode(model, tokens=30)
    assert cache_dtypes and keys() == {torch.float32}
    cache_dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = greedy_decode(model, tokens=30)
        assert cache_dtypes and keys() == {torch.bfloat16}
        monkeypatch.setattr(generation, "cache_dtype", lambda k: k.dtype)  # the old fp32 cache
        cache_dtypes.clear()
        slow = greedy_decode(model, tokens=30)
        assert keys() == {torch.float32}
    assert torch.equal(fast, slow)


def test_without_amx_cpu_decoding_keeps_an_fp32_cache(model, monkeypatch, cache_dtypes):
    """CPUs without AMX decode in fp32 under bf16 autocast (`attention.decodes_in_autocast_dtype`):
    keys and values are cached in fp32 (tests/models/test_attention.py: the kernel runs in fp32)."""
    import vapo_lightning.attention as attention

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = greedy_decode(model, tokens=30)
    assert cache_dtypes and set(cache_dtypes) == {(torch.float32, torch.float32)}
    # Forced: 30 tokens each, no stop token (PAD itself is a token a random model may pick).
    assert out.shape == (len(PROMPTS), 30) and not bool((out == EOS).any())


class CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts dtype casts (`aten._to_copy`) whose input is one of `params`' storage."""

    def __init__(self, params) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr(): name for name, p in params}
        self.casts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            name = self.ptrs[args[0].data_ptr()]
            self.casts[name] = self.casts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def greedy_decode(model, tokens: int = 10) -> torch.Tensor:
    """Greedy responses to PROMPTS, forced to `tokens` tokens each."""
    ids, mask = left_pad(PROMPTS)
    return sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        stop_token_ids=[EOS],
        pad_token_id=PAD,
        temperature=0.0,
    )


def cast_weights(model) -> set[str]:
    """The weights autocast casts in a forward (the embedding is a lookup, not cast)."""
    return {n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}


def test_autocast_sampler_casts_each_weight_once_per_call(model):
    """Lightning's bf16-mixed autocast runs with the cast cache off, so each forward casts
    every fp32 weight again: the sampler turns the cache on for its loop (one cast per weight
    per call, not per token) and restores the flag."""
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with CastCounter(model.named_parameters()) as counter:
            greedy_decode(model)
        assert not torch.is_autocast_cache_enabled()
    assert cast_weights(model) <= set(counter.casts), sorted(cast_weights(model) - set(counter.casts))
    assert max(counter.casts.values()) == 1, counter.casts


def test_autocast_sampler_leaves_no_casts_behind(model):
    """Its casts, made under no_grad, leave with the call: in a caller's region that caches
    casts, the next (training) forward casts every weight afresh, with autograd history."""
    ids, mask = left_pad(PROMPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        greedy_decode(model)
        with CastCounter(model.named_parameters()) as counter:
            model(input_ids=ids, attention_mask=mask)
    assert cast_weights(model) <= set(counter.casts), sorted(cast_weights(model) - set(counter.casts))


@pytest.fixture
def head(model):
    """The LM head's weight, restored after the test changes it in place."""
    weight = model.get_output_embeddings().weight
    saved = weight.detach().clone()
    yield weight
    with torch.no_grad():
        weight.copy_(saved)


def test_autocast_sampler_drops_its_casts(model, head):
    """The cached casts leave with the call: in one autocast region (a training step that
    samples, updates, samples again), the second call decodes with the updated weights."""
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        before = greedy_decode(model)
        with torch.no_grad():  # an optimizer step that changes every greedy choice
            head.copy_(torch.randn_like(head))
        after = greedy_decode(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = greedy_decode(model)  # a new region: nothing cached
    assert not torch.equal(before, fresh)
    assert torch.equal(after, fresh)


def test_autocast_sampler_ignores_casts_cached_before_an_update(model, head):
    """A caller's autocast region with the cache on (Lightning < 2.6, plain torch.autocast)
    may hold casts from a forward before an in-place update: the sampler drops them on entry."""
    ids, mask = left_pad(PROMPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=mask)  # a training forward: casts cached
        with torch.no_grad():
            head.copy_(torch.randn_like(head))
        after = greedy_decode(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = greedy_decode(model)
    assert torch.equal(after, fresh)
