"""Log-probs and entropies from the LM head's input (`vapo_lightning.head_logprobs`): equal
to a plain log_softmax of each row's full logits, with the gradients of every parameter (the
head's weight, tied or not, included), in every layout, at a temperature, under FSDP2; and
the (B, T, V) logits never exist."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from tests.update_helpers import grouped_rollout
from vapo_lightning import attention, head_logprobs, logprobs, packing
from vapo_lightning.head_logprobs import PLAIN_HEAD_MODELS, linear_token_stats, plain_head
from vapo_lightning.rollout import Rollout, _packed, token_logprobs

BASE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # peaked distributions, not near-uniform ones
}
EXTRA = {
    "qwen2_moe": {
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen3_moe": {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    "qwen3": {"head_dim": 8},
}
VOCAB, TAU = 96, 0.7
# name: (attention, responses per pack). "spans": the project's attention, which lays packs
# (of one response too) end to end; "sdpa": rows, or one pack per row with a block mask.
LAYOUTS = {
    "rows": ("sdpa", 1),
    "one pack per row": ("sdpa", 4),
    "rows end to end": ("spans", 1),
    "packs end to end": ("spans", 2),
}


CHUNK = 7  # rows per chunk in these tests: every forward and backward spans several


def small_chunks() -> None:
    logprobs.CPU_CHUNK_LOGITS, head_logprobs.CPU_MIN_ROWS = CHUNK * VOCAB, 1


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(logprobs, "CPU_CHUNK_LOGITS", CHUNK * VOCAB)
    monkeypatch.setattr(head_logprobs, "CPU_MIN_ROWS", 1)
    assert head_logprobs.rows_per_chunk(VOCAB, torch.device("cpu")) == CHUNK


def tiny(model_type: str = "llama", tied: bool = False, attn: str = "sdpa", vocab: int = VOCAB, **cfg):
    torch.manual_seed(0)
    extra = {**BASE, **EXTRA.get(model_type, {}), **cfg}
    config = AutoConfig.for_model(model_type, vocab_size=vocab, tie_word_embeddings=tied, **extra)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if attn == "spans":
        model.set_attn_implementation(attention.SDPA)
    return model


def reference(model, r: Rollout, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The slow, obvious way: each row alone, its full (1, L, V) logits, log_softmax in fp64."""
    rows_logp, rows_entropy = [], []
    for i in range(len(r)):
        row = r.select([i]).trimmed()
        L, T = row.input_ids.shape[1], row.response_mask.shape[1]
        out = model(input_ids=row.input_ids, attention_mask=row.attention_mask, position_ids=row.position_ids)
        ls = torch.log_softmax(out.logits[0, L - T - 1 : L - 1].double() / tau, -1)  # (T, V)
        rows_logp.append(ls.gather(-1, row.responses[0, :, None]).squeeze(-1))
        rows_entropy.append(-(ls.exp() * ls).sum(-1))
    logp = torch.nn.utils.rnn.pad_sequence(rows_logp, batch_first=True)
    entropy = torch.nn.utils.rnn.pad_sequence(rows_entropy, batch_first=True)
    width = r.response_mask.shape[1]
    return F.pad(logp, (0, width - logp.shape[1])), F.pad(entropy, (0, width - entropy.shape[1]))


def weights(r: Rollout, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-token weights of the log-probs and the entropies in a loss, 0 off the mask."""
    g = torch.Generator().manual_seed(seed)
    mask = r.response_mask.double()
    return torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask, torch.rand(mask.shape, generator=g) * mask


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same_grads(got: dict, want: dict) -> None:
    """Equal up to fp32 rounding: 1e-5 of each gradient's largest entry (or 1e-5), 1e-4 relative."""
    assert got.keys() == want.keys() and len(want) > 0
    for name, g in want.items():
        atol = 1e-5 * max(1.0, float(g.abs().max()))
        msg = lambda m, name=name: f"{name}: {m}"  # noqa: E731
        torch.testing.assert_close(got[name], g.to(got[name].dtype), atol=atol, rtol=1e-4, msg=msg)


@pytest.mark.parametrize("tau", [1.0, TAU])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_linear_token_stats_equal_a_log_softmax_of_the_logits(tau, entropy_grad, chunk):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)  # (N, H)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)  # (V, H)
    labels, a, b = torch.randint(0, 50, (37,), generator=g), torch.randn(37, generator=g), torch.randn(37, generator=g)
    logp, h = linear_token_stats(x, w, labels, tau, entropy_grad=entropy_grad, chunk_rows=chunk)
    ((logp * a).sum() + (h * b).sum() if entropy_grad else (logp * a).sum()).backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ls = torch.log_softmax(x @ w.T / tau, -1)
    want_logp, want_h = ls.gather(-1, labels[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    ((want_logp * a).sum() + (want_h * b).sum() if entropy_grad else (want_logp * a).sum()).backward()
    torch.testing.assert_close(logp, want_logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(h, want_h, atol=1e-12, rtol=1e-12)
    assert h.requires_grad == entropy_grad
    torch.testing.assert_close(got[0], x.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got[1], w.grad, atol=1e-12, rtol=1e-12)
    assert linear_token_stats(x, w, labels, tau, entropy=False, chunk_rows=chunk)[1] is None


def test_under_autocast_the_logits_are_the_linear_layers():
    """bf16 autocast (the CPU's bf16-mixed): each chunk's logits are `F.linear`'s, in bf16, so
    the statistics are those of the whole logits; the gradients, from bf16 matmuls (W's summed
    over chunks in fp32), are as close to the exact ones as the whole logits' are."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g, requires_grad=True)
    w = (torch.randn(200, 32, generator=g) * 0.3).requires_grad_()
    labels, a = torch.randint(0, 200, (300,), generator=g), torch.randn(300, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, h = linear_token_stats(x, w, labels, TAU, entropy_grad=True, chunk_rows=64)
        (logp * a + h).sum().backward()
        got = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        logits = F.linear(x, w)  # (N, V) bf16
        ls = torch.log_softmax(logits.float() / TAU, -1)
        want_logp, want_h = ls.gather(-1, labels[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
        (want_logp * a + want_h).sum().backward()
    assert logits.dtype == torch.bfloat16 and logp.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)
    # Exact: fp64 from the bf16-rounded inputs.
    x64, w64 = (t.detach().bfloat16().double().requires_grad_() for t in (x, w))
    ls = torch.log_softmax(x64 @ w64.T / TAU, -1)
    ((ls.gather(-1, labels[:, None]).squeeze(-1) * a).sum() - (ls.exp() * ls).sum()).backward()
    for ours, theirs, exact in zip(got, (x.grad, w.grad), (x64.grad, w64.grad), strict=True):
        error, their_error = (ours - exact).norm() / exact.norm(), (theirs - exact).norm() / exact.norm()
        assert error < 2**-7 and error < 1.5 * their_error, (error, their_error)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_log_probs_entropies_and_gradients_equal_the_full_logits(layout, tied):
    attn, c = LAYOUTS[layout]
    model = tiny(tied=tied, attn=attn)
    r, lay = grouped_rollout(VOCAB), packing.Layout(c)
    assert plain_head(model) is model.lm_head  # the hidden-state path is taken
    assert (_packed(model, r, lay) is None) == (layout == "rows")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    a, b = weights(r)
    logp, h = token_logprobs(model, r, TAU, entropy_grad=True, layout=lay)
    ((logp * a).sum() + (h * b).sum()).backward()
    got = grads(model)
    want_logp, want_h = reference(model, r, TAU)
    ((want_logp * a).sum() + (want_h * b).sum()).backward()
    mask = r.response_mask
    assert logp.dtype == h.dtype == torch.float32 and logp.shape == h.shape == mask.shape
    torch.testing.assert_close(logp[mask], want_logp[mask].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[mask], want_h[mask].float(), atol=1e-5, rtol=1e-5)
    assert_same_grads(got, grads(model))
    assert "lm_head.weight" in got or tied


@pytest.mark.parametrize("layout", ["rows", "packs end to end"])
def test_without_the_entropy_or_its_gradient(layout):
    attn, c = LAYOUTS[layout]
    model = tiny(attn=attn)
    r, lay = grouped_rollout(VOCAB), packing.Layout(c)
    a, _ = weights(r)
    want_logp, want_h = reference(model, r, TAU)
    (want_logp * a).sum().backward()
    want = grads(model)
    mask = r.response_mask
    for entropy in (False, True):
        logp, h = token_logprobs(model, r, TAU, entropy=entropy, entropy_grad=False, layout=lay)
        assert (h is None) == (not entropy)
        if entropy:
            assert not h.requires_grad
            torch.testing.assert_close(h[mask], want_h[mask].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logp[mask], want_logp[mask].float(), atol=1e-5, rtol=1e-5)
        (logp * a).sum().backward()
        assert_same_grads(grads(model), want)


@pytest.mark.parametrize("model_type", sorted(PLAIN_HEAD_MODELS))
def test_every_plain_head_model_gives_its_logits_statistics(model_type):
    """Each model type listed returns its head's output as its logits, unchanged: the
    statistics from the head's input are those of its logits (and so their gradients)."""
    model = tiny(model_type, num_hidden_layers=1)
    r = grouped_rollout(VOCAB)
    assert plain_head(model) is model.get_output_embeddings()
    a, b = weights(r)
    logp, h = token_logprobs(model, r, TAU, entropy_grad=True)
    ((logp * a).sum() + (h * b).sum()).backward()
    got = grads(model)
    want_logp, want_h = reference(model, r, TAU)
    ((want_logp * a).sum() + (want_h * b).sum()).backward()
    mask = r.response_mask
    torch.testing.assert_close(logp[mask], want_logp[mask].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[mask], want_h[mask].float(), atol=1e-5, rtol=1e-5)
    assert_same_grads(got, grads(model))


def test_models_whose_logits_are_not_the_plain_heads_keep_the_logits_path():
    model = tiny()
    assert plain_head(model) is model.lm_head
    softcapped = tiny("gemma2", head_dim=8)  # tanh soft-capping after the head
    assert plain_head(softcapped) is None
    biased = tiny()
    biased.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert plain_head(biased) is None
    compiled = tiny()
    compiled.compile()  # (compiles at its first call: none here)
    assert plain_head(compiled) is None
    assert plain_head(object()) is None
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules="all-linear"))
    assert plain_head(lora) is lora.get_output_embeddings()  # frozen, not adapted: plain
    on_head = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert plain_head(on_head) is None  # peft's wrapper around the head


def test_a_lora_policy_takes_the_adapters_gradients_through_its_frozen_head():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    r = grouped_rollout(VOCAB)
    a, b = weights(r)
    logp, h = token_logprobs(model, r, TAU, entropy_grad=True)
    ((logp * a).sum() + (h * b).sum()).backward()
    got = grads(model)
    want_logp, want_h = reference(model, r, TAU)
    ((want_logp * a).sum() + (want_h * b).sum()).backward()
    assert all("lora_" in n for n in got)
    assert_same_grads(got, grads(model))


def test_a_chunk_holds_enough_rows_to_amortise_reading_the_head(monkeypatch):
    monkeypatch.undo()  # (the module's own sizes)
    cpu, gpu = torch.device("cpu"), torch.device("meta")  # (any device but the CPU)
    assert head_logprobs.rows_per_chunk(151_936, cpu) == 128  # (2^20 logits: 6 rows)
    assert head_logprobs.rows_per_chunk(151_936, gpu) == 512  # (2^26 logits: 441 rows)
    assert head_logprobs.rows_per_chunk(500, cpu) == 2**20 // 500
    assert head_logprobs.rows_per_chunk(32_000, gpu) == 2**26 // 32_000


class LargestWithVocab(TorchDispatchMode):
    """Records the largest numel of any op's output with a dimension of `vocab` and none of
    `hidden` (so the head's weight (V, H), its views and gradient do not count)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.largest, self.ops = vocab, hidden, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.vocab in t.shape and self.hidden not in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("layout", ["rows", "packs end to end"])
def test_the_full_logits_never_exist(monkeypatch, layout):
    """A small vocabulary and long answers: no tensor of (B, T, V) elements in the forward or
    the backward, only (chunk, V) ones; through the logits (the negative control), one."""
    attn, c = LAYOUTS[layout]
    V, H, T, chunk = 500, 32, 96, 8
    monkeypatch.setattr(logprobs, "CPU_CHUNK_LOGITS", chunk * V)
    monkeypatch.setattr(head_logprobs, "CPU_MIN_ROWS", 1)
    assert head_logprobs.rows_per_chunk(V, torch.device("cpu")) == chunk
    model = tiny(attn=attn, vocab=V)
    B = 4
    ids = torch.randint(3, V, (B, 6 + T), generator=torch.Generator().manual_seed(0))
    ids[:, :6] = ids[:1, :6]  # one prompt, answered 4 times
    r = Rollout(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(B, T, dtype=torch.bool),
        group_ids=torch.zeros(B, dtype=torch.long),
        truncated=torch.zeros(B, dtype=torch.bool),
    )

    def largest() -> LargestWithVocab:
        with LargestWithVocab(V, H) as seen:
            logp, h = token_logprobs(model, r, TAU, entropy_grad=True, layout=packing.Layout(c))
            (logp.sum() + h.sum()).backward()
        assert "aten::scatter_add_" in seen.ops or "aten.scatter_add_" in seen.ops  # (the backward's)
        return seen

    assert 0 < largest().largest <= chunk * V
    monkeypatch.setattr(head_logprobs, "plain_head", lambda model: None)
    assert largest().largest >= B * T * V


def _fsdp_rank(rank: int, init: str, out: str) -> None:
    """One of 2 gloo ranks: FSDP2 on every layer and the root (the head's weight in the root's
    unit, resharded after the forward), each rank's half of the rollout, the full gradients;
    in bf16 (FSDP2's mixed precision), also those through the logits, on the same shards."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    small_chunks()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from vapo_lightning.distributed import shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    results = {}
    for name, (tied, layout, bf16) in FSDP_CASES.items():
        attn, c = LAYOUTS[layout]
        model = tiny(tied=tied, attn=attn)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        shard(model, mesh, mp_policy or MixedPrecisionPolicy(), reshard_after_forward=True)
        r = grouped_rollout(VOCAB)
        half = r.select(list(range(rank * len(r) // 2, (rank + 1) * len(r) // 2)))
        a, b = (x[rank * len(r) // 2 : (rank + 1) * len(r) // 2] for x in weights(r))
        assert plain_head(model) is model.lm_head
        for path in ("hidden", "logits") if bf16 else ("hidden",):
            if path == "logits":
                head_logprobs.plain_head = lambda model: None  # (this process only)
            logp, h = token_logprobs(model, half, TAU, entropy_grad=True, layout=packing.Layout(c))
            ((logp * a).sum() + (h * b).sum()).backward()  # FSDP2 averages over the 2 ranks
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            results[name, path] = {"grads": grads, "logp": logp.detach(), "entropy": h.detach()}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


# name: (tied head, layout, bf16 mixed precision)
FSDP_CASES = {
    "untied, rows": (False, "rows", False),
    "tied, packs end to end": (True, "packs end to end", False),
    "tied, bf16": (True, "rows end to end", True),
}


@pytest.mark.slow
def test_under_fsdp2_the_gradients_are_one_process_full_logits_ones():
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'init')}", os.path.join(tmp, "out.pt")
        mp.start_processes(_fsdp_rank, args=(init, out), nprocs=2, start_method="spawn")
        results = torch.load(out)
    for name, (tied, layout, bf16) in FSDP_CASES.items():
        model = tiny(tied=tied, attn=LAYOUTS[layout][0])
        r = grouped_rollout(VOCAB)
        a, b = weights(r)
        want_logp, want_h = reference(model, r, TAU)
        ((want_logp * a).sum() + (want_h * b).sum()).backward()
        want = {n: g / 2 for n, g in grads(model).items()}  # the mean over ranks of their sums
        got = results[name, "hidden"]
        if bf16:  # as close to the fp32 gradients as the bf16 logits path's, on the same shards
            through_logits = results[name, "logits"]["grads"]
            for n, g in want.items():
                error, their_error = ((x[n] - g).norm() / g.norm() for x in (got["grads"], through_logits))
                assert error < 2**-4 and error < 1.5 * their_error, (n, error, their_error)
            continue
        half, mask = len(r) // 2, r.response_mask[: len(r) // 2]
        torch.testing.assert_close(got["logp"][mask], want_logp[:half][mask].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["entropy"][mask], want_h[:half][mask].float(), atol=1e-5, rtol=1e-5)
        assert_same_grads(got["grads"], want)
        assert ("lm_head.weight" in want) != tied
