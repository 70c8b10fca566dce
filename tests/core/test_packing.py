"""Shared-prompt forwards (`vapo_lightning.packing`): c responses to one prompt in one
sequence give each response the logits, values and gradients it has in its own row."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.helpers import TINY_LLAMA, tiny_module
from tests.update_helpers import NO_CLIP, G, N, P, Recorder, T, grouped_rollout
from vapo_lightning import attention, core, packing
from vapo_lightning.advantages import compute_advantages
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout, critic_values, policy_logits, token_logprobs
from vapo_lightning.updates import (
    Forwards,
    RankOps,
    compute_values,
    micro_batches,
    mini_batches,
    old_policy,
    update_actor,
    update_critic,
)

LAYOUTS = ["end to end", "one pack per row"]


def module_for(tok, micro: int = 4, layout: str = "end to end", **algorithm):
    """A tiny module whose models attend by spans (`packing.reads_spans`: packs end to end)
    or, `layout` "one pack per row", through torch's sdpa with the packs' block masks."""
    L.seed_everything(0)
    module = tiny_module(tok, algorithm=Algorithm(mini_batch_size=G * N, micro_batch_size=micro, **algorithm))
    module.configure_model()
    if layout == "one pack per row":
        for model in (module.policy, module.critic):
            model.set_attn_implementation("sdpa")
    for model in (module.policy, module.critic):
        assert packing.reads_spans(model, torch.device("cpu")) == (layout == "end to end")
    return module


def per_row(fn, model, r: Rollout) -> list[torch.Tensor]:
    """fn on each row alone (trimmed): the slow, obvious reference."""
    out = []
    for i in range(len(r)):
        row = r.select([i]).trimmed()
        out.append(fn(model, row)[0, : int(row.response_mask.sum())])
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("c", [2, 4])
def test_packed_logits_and_values_equal_each_row_alone(tok, c, layout):
    module = module_for(tok, layout=layout)
    r = grouped_rollout(module.policy.config.vocab_size)
    layout = packing.Layout(c)
    assert packing.pack(r.input_ids, r.attention_mask, T, c) is not None
    with torch.no_grad():
        logits, values = policy_logits(module.policy, r, layout), critic_values(module.critic, r, layout)
        want_logits = per_row(policy_logits, module.policy, r)
        want_values = per_row(critic_values, module.critic, r)
    assert logits.shape == (G * N, T, module.policy.config.vocab_size) and values.shape == (G * N, T)
    for i in range(G * N):
        n = len(want_values[i])
        torch.testing.assert_close(logits[i, :n], want_logits[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[i, :n], want_values[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("c", [2, 4])
def test_packed_log_probs_and_entropies_equal_each_row_alone(tok, c, layout):
    """Computed on the packs' positions (each predicting its pack's next token, a prompt's
    last position every response's first), they are each row's own, and so are their
    gradients."""
    module = module_for(tok, layout=layout)
    r = grouped_rollout(module.policy.config.vocab_size)
    layout, tau = packing.Layout(c), 0.7

    def row_by_row(model, row):  # the slow, obvious way: each row's logits, then the kernels
        logits = policy_logits(model, row)
        return torch.stack(
            [core.logprobs_from_logits(logits, row.responses, tau), core.entropy_from_logits(logits, tau)]
        )

    logprobs, entropy = token_logprobs(module.policy, r, tau, entropy_grad=True, layout=layout)
    mask = r.response_mask
    ((logprobs * mask).sum() + (entropy * mask).sum() / 3).backward()
    packed_grads = {n: p.grad.clone() for n, p in module.policy.named_parameters()}
    module.policy.zero_grad()
    total = 0
    for i in range(G * N):
        row = r.select([i]).trimmed()
        want = row_by_row(module.policy, row)[:, 0, : int(row.response_mask.sum())]
        n = want.shape[1]
        torch.testing.assert_close(logprobs[i, :n], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[i, :n], want[1], atol=1e-5, rtol=1e-5)
        total = total + want[0].sum() + want[1].sum() / 3
    total.backward()
    for n, p in module.policy.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
    assert token_logprobs(module.policy, r, tau, entropy=False, layout=layout)[1] is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_response_does_not_see_the_other_responses_of_its_pack(tok, layout):
    module = module_for(tok, layout=layout)
    r = grouped_rollout(module.policy.config.vocab_size)
    layout = packing.Layout(N)
    changed = Rollout(**{**r.__dict__, "input_ids": r.input_ids.clone()})
    changed.input_ids[1, P:] = (changed.input_ids[1, P:] + 1) % module.policy.config.vocab_size
    with torch.no_grad():
        a, b = policy_logits(module.policy, r, layout), policy_logits(module.policy, changed, layout)
    others = [0, 2, 3]
    torch.testing.assert_close(a[others], b[others], atol=1e-6, rtol=1e-6)
    assert (a[1] - b[1]).abs().max() > 1e-3


def test_rows_that_answer_different_prompts_are_not_packed(tok):
    module = module_for(tok)
    r = grouped_rollout(module.policy.config.vocab_size, same_prompt=False)
    assert packing.pack(r.input_ids, r.attention_mask, T, N) is None  # rows 0-3 differ
    assert packing.pack(r.input_ids[N:], r.attention_mask[N:], T, N) is not None
    layout = packing.Layout(N)  # the forward falls back to one row at a time: still each row's logits
    with torch.no_grad():
        logits = policy_logits(module.policy, r, layout)
        want = per_row(policy_logits, module.policy, r)
    torch.testing.assert_close(logits[1, : len(want[1])], want[1], atol=1e-5, rtol=1e-5)


def update_gradients(
    tok, pack: int, layout: str = "end to end", apart: bool = False, n: int = N, common: int = 0
) -> tuple[dict[str, torch.Tensor], Rollout, dict[str, torch.Tensor]]:
    """Both models' gradients of an update with no-grad pi_old and V_old passes (one
    mini-batch, micro-batches of 2), and those passes' estimates; `apart`: every row on its
    own (`Layout.shared_start` off)."""
    module = module_for(tok, micro=2, layout=layout)
    module.algo.mini_batch_size = G * n
    r = grouped_rollout(module.policy.config.vocab_size, n=n, common=common)
    layout, a, ops = packing.Layout(pack, not apart), module.algo, RankOps()
    fw = Forwards(a.micro_batch_size, layout=layout)
    old = old_policy("recompute", module.policy, None, r, fw, 1.0)
    values = compute_values(module.critic, r, fw)
    adv = compute_advantages(r, values, a, False, ops.global_sum)
    steps, batches = [], mini_batches(len(r), a.mini_batch_size, a.ppo_epochs, pack)
    update_critic(
        module.critic,
        Recorder("critic", module.critic, steps),
        r,
        values,
        adv.returns,
        batches,
        a,
        NO_CLIP,
        ops,
        Forwards.of(a, layout=layout),
    )
    update_actor(
        module.policy,
        Recorder("actor", module.policy, steps),
        r,
        old,
        adv.advantages,
        batches,
        a,
        1.0,
        NO_CLIP,
        ops,
        Forwards.of(a, layout=layout),
    )
    estimates = {"old_logprobs": old.logprobs, "entropy": old.entropy, "values": values, "advantages": adv.advantages}
    return {f"{name}.{n}": g for name, step in steps for n, g in step.items()}, r, estimates


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_update_with_shared_prompts_has_the_row_by_row_gradients(tok, layout):
    assert_same_update(update_gradients(tok, pack=2, layout=layout), update_gradients(tok, pack=1, apart=True))


def assert_same_update(packed, rows) -> None:
    (packed, _, est_packed), (rows, r_rows, est_rows) = packed, rows
    assert packed.keys() == rows.keys() and any(g.abs().sum() > 0 for g in rows.values())
    for k in rows:
        torch.testing.assert_close(packed[k], rows[k], atol=1e-6, rtol=1e-4)
    mask = r_rows.response_mask
    for field in ["old_logprobs", "entropy", "values", "advantages"]:
        torch.testing.assert_close(est_packed[field][mask], est_rows[field][mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n", "pack"), [(1, 1), (4, 2)])
def test_a_start_every_prompt_shares_is_laid_once_with_the_row_by_row_gradients(tok, n, pack):
    """Prompts that all begin with the same 3 tokens (a system prompt, a worked example): end
    to end, the start lies once at the row's head, each prompt continues it, and the update
    has each row's own gradients; with one response per prompt (vanilla PPO's rows) too."""
    r = grouped_rollout(64, n=n, common=3)
    packed = packing.pack(r.input_ids, r.attention_mask, T, pack, end_to_end=True)
    prompts = int(r.attention_mask[::pack, :P].sum())  # one copy per pack
    assert {s.shared for row in packed.spans for s in row} == {3}
    assert packed.input_ids.shape == (1, 3 + prompts - 3 * len(r) // pack + int(r.response_mask.sum()))
    assert packed.input_ids[0, :3].tolist() == r.input_ids[0, P - int(r.attention_mask[0, :P].sum()) :][:3].tolist()
    apart = packing.pack(r.input_ids, r.attention_mask, T, pack, end_to_end=True, share_start=False)
    assert {s.shared for row in apart.spans for s in row} == {0} and apart.input_ids.shape[1] == packed.input_ids.shape[
        1
    ] + 3 * (len(r) // pack - 1)
    shared = update_gradients(tok, pack=pack, n=n, common=3)
    assert_same_update(shared, update_gradients(tok, pack=1, apart=True, n=n, common=3))


def test_rows_kept_apart_are_not_laid_end_to_end(tok):
    """`algorithm.share_prompts: false` (`Layout.shared_start` off): each row its own forward."""
    module = module_for(tok)
    r = grouped_rollout(module.policy.config.vocab_size, n=1, common=3)
    forwards = []
    hook = module.critic.register_forward_pre_hook(
        lambda m, a, kw: forwards.append(kw["input_ids"].shape), with_kwargs=True
    )
    critic_values(module.critic, r, packing.Layout(1, shared_start=False))
    critic_values(module.critic, r, packing.Layout(1, shared_start=True))
    hook.remove()
    assert forwards[0] == r.input_ids.shape and forwards[1][0] == 1


def common_start_reference(prompts: list[list[int]]) -> int:
    """The slow, obvious way: the longest start all share, leaving each its last token."""
    if len(prompts) < 2:
        return 0
    k = 0
    while k < min(map(len, prompts)) - 1 and len({p[k] for p in prompts}) == 1:
        k += 1
    return k


@pytest.mark.parametrize(
    "prompts",
    [
        [[5, 6, 7], [5, 6, 8, 9]],
        [[5, 6], [5, 6, 7]],
        [[5], [5, 6]],
        [[4, 6], [5, 6]],
        [[5, 6, 7]],
        [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9]],
        [[7, 7, 7], [7, 7, 7]],
    ],
)
def test_common_start_equals_the_obvious_loop(prompts):
    width = max(map(len, prompts)) + 2
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    real = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    assert packing.common_start(ids, real) == common_start_reference(prompts)


def span_mask(spans: tuple, L: int) -> torch.Tensor:
    """(R, L, L) True where query i may see key j, by the definition: same pack, j <= i, and
    j in the row's shared start, the prompt or i's own response."""
    out = torch.zeros(len(spans), L, L, dtype=torch.bool)
    for row, packs in enumerate(spans):
        for span in packs:
            S = span.shared
            out[row, :S, :S] = True  # the shared start, over itself
            parts = [(span.first, span.P)] + [(s, s + n) for s, n in span.responses]
            for a, b in parts:
                out[row, a:b, :S] = True  # the start the prompt continues
                out[row, a:b, span.first : span.P] = True  # the prompt
                out[row, a:b, a:b] = True  # itself
        out[row] &= torch.ones(L, L, dtype=torch.bool).tril()
    return out


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize(("end_to_end", "common", "c"), [(False, 0, N), (True, 0, N), (True, 3, N), (True, 3, 1)])
def test_packed_attention_equals_one_masked_call(gqa, end_to_end, common, c):
    """Span by span against torch's sdpa over each whole row with the packs' mask (the slow,
    obvious way): outputs and gradients, packs one per row (padded) and end to end, after a
    start all prompts share, of c responses."""
    r = grouped_rollout(64, n=c, common=common)
    packed = packing.pack(r.input_ids, r.attention_mask, T, c, end_to_end)
    assert all(s.shared == common for row in packed.spans for s in row)
    R, L = packed.input_ids.shape
    mask = span_mask(packed.spans, L)
    seen = mask.any(-1)  # (R, L) queries inside a pack
    if not end_to_end:  # the block mask says the same (padding queries: never read)
        assert torch.equal(mask[seen], packed.attention_mask[:, 0][seen])
    g = torch.Generator().manual_seed(0)
    H, D = 6, 8
    q = torch.randn(R, H, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(R, H // gqa, L, D, generator=g, requires_grad=True) for _ in "kv")
    got = attention.packed_attention(q, k, v, packed.spans, scaling=0.3)  # (R, L, H, D)
    assert bool((got[~seen] == 0).all())
    weights = torch.randn(got.shape, generator=g)
    (got[seen] * weights[seen]).sum().backward()
    got_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1), attn_mask=mask[:, None], scale=0.3
    ).transpose(1, 2)
    (want[seen] * weights[seen]).sum().backward()
    torch.testing.assert_close(got[seen], want[seen], atol=1e-5, rtol=1e-5)
    for a, x in zip(got_grads, (q, k, v), strict=True):
        torch.testing.assert_close(a, x.grad, atol=1e-5, rtol=1e-5)


def test_packed_attentions_backward_adds_no_row_sized_zeros_per_span():
    """The spans are views of one split per tensor: a slice per span would give each its own
    backward node that writes a zero tensor the size of the whole row and adds to it, which
    is quadratic in the spans of a row (64 answers end to end: most of an update's time)."""
    r = grouped_rollout(64)
    packed = packing.pack(r.input_ids, r.attention_mask, T, N, end_to_end=True)
    L = packed.input_ids.shape[1]
    q, k, v = (torch.randn(1, 2, L, 4, requires_grad=True) for _ in "qkv")
    out = attention.packed_attention(q, k, v, packed.spans)
    nodes, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes.append(type(node).__name__)
            todo += [n for n, _ in node.next_functions]
    assert sum(len(row) for row in packed.spans) > 1
    assert not [n for n in nodes if n.startswith("SliceBackward")], sorted(set(nodes))
    assert nodes.count("SplitWithSizesBackward0") == 3  # one for each of q, k and v


def test_packs_end_to_end_leave_out_padding():
    """In one row, without a mask: the prompt once per pack, each response only as long as
    it is; the kept columns are exactly those that predict a response token."""
    r = grouped_rollout(64)
    packed = packing.pack(r.input_ids, r.attention_mask, T, N, end_to_end=True)
    prompts = int(r.attention_mask[::N, :P].sum())
    responses = int(r.response_mask.sum())
    assert packed.attention_mask is None and packed.input_ids.shape == (1, prompts + responses)
    assert len(packed.keep) == responses and bool((packed.input_ids[0, :P] != 0).any())
    assert packing.pack(r.input_ids, r.attention_mask, T, N).input_ids.shape[0] == G


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("empty", [[G - 1], [0, 1, 2]])
def test_a_pack_of_empty_responses_still_keeps_its_prompts_last_column(layout, empty):
    """A pack whose responses have no token (the last one, or every one): each pack's `first`
    still points at its own prompt's last token among the kept columns, never past them."""
    r = grouped_rollout(64)
    for g in empty:
        r.attention_mask[g * N : (g + 1) * N, P:] = 0
        r.response_mask[g * N : (g + 1) * N] = False
    packed = packing.pack(r.input_ids, r.attention_mask, T, N, end_to_end=layout == "end to end")
    R, K = packed.input_ids.shape[0], len(packed.keep)
    assert int(packed.first.max()) < R * K  # `first` indexes the R·K kept outputs
    for g, spans in enumerate(s for row in packed.spans for s in row):
        row, k = divmod(int(packed.first[g]), K)
        column = int(packed.keep[k])
        assert column == spans.P - 1 and packed.input_ids[row, column] == r.input_ids[g * N, P - 1]


def test_batches_keep_a_pack_together():
    for rows in mini_batches(24, 8, 2, pack=4):
        assert len(rows) == 8 and all(rows.view(-1, 4).diff(dim=-1).eq(1).all(-1))
        assert bool((rows.view(-1, 4)[:, 0] % 4 == 0).all())


def test_micro_batches_hold_whole_packs_grouped_by_length(tok):
    module = module_for(tok)
    r = grouped_rollout(module.policy.config.vocab_size)
    parts = list(micro_batches(r, 4, pack=2))
    assert sorted(torch.cat([rows for rows, _ in parts]).tolist()) == list(range(G * N))
    for rows, _ in parts:
        assert len(rows) == 4 and bool((rows.view(-1, 2)[:, 0] % 2 == 0).all())
    longest = [int(r.attention_mask[rows].sum(-1).max()) for rows, _ in parts]
    assert longest == sorted(longest)


@pytest.mark.parametrize(
    ("groups", "micro", "mini", "share", "want"),
    [
        ([0, 0, 0, 0, 1, 1, 1, 1], 4, 8, True, 4),  # whole groups per micro-batch
        ([0, 0, 0, 0, 1, 1, 1, 1], 8, 8, True, 4),
        ([0, 0, 0, 0, 1, 1, 1, 1], 2, 8, True, 2),  # a group split over micro-batches
        ([0, 0, 0, 0, 1, 1, 1, 1], 4, 8, False, 1),  # switched off
        ([0, 0, 0, 1, 1, 1], 2, 6, True, 1),  # n 3, micro 2: not multiples
        ([0, 1, 0, 1], 2, 4, True, 1),  # a prompt's responses not consecutive
        ([0, 0, 0, 1, 1, 1, 1, 1], 4, 8, True, 1),  # unequal groups
        ([0, 1, 2, 3], 4, 4, True, 1),  # n 1: nothing to share
    ],
)
def test_pack_size(groups, micro, mini, share, want):
    algo = Algorithm(mini_batch_size=mini, micro_batch_size=micro, share_prompts=share)
    assert packing.pack_size(torch.tensor(groups), algo) == want


def test_a_setup_where_responses_cannot_share_prompts_says_so():
    with pytest.warns(UserWarning, match="share_prompts"):
        Algorithm(mini_batch_size=12, micro_batch_size=4).check_batch(2, 6)


def test_the_cost_model_packs_only_where_it_saves_work():
    """Qwen2.5-7B's shapes: reasoning answers far longer than the prompt make a dense pack's
    (P + cT)² attention square cost more than the prompt it saves; long prompts and short
    answers pay."""
    from vapo_lightning.packing import dense_packing_saves_work

    qwen7b = {"params": 7.6e9, "layers": 28, "hidden": 3584}
    assert not dense_packing_saves_work(200, 4096, 8, **qwen7b)
    assert dense_packing_saves_work(1000, 100, 8, **qwen7b)
    # by hand, (200, 4096, 8): packed 2·7.6e9·32968 + 4·28·3584·32968² against c rows
    packed = 2 * 7.6e9 * 32968 + 4 * 28 * 3584 * 32968**2
    rows = 2 * 7.6e9 * 8 * 4296 + 4 * 28 * 3584 * 8 * 4296**2 / 2
    assert packed / rows == pytest.approx(1.70, abs=0.01)


def test_dense_packs_are_skipped_where_they_cost_more(tok):
    """An eager-attention policy (a 4-D mask, no spans): a rollout of short prompts and long
    answers runs row by row, one of long prompts and short answers in packs."""
    from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
    from vapo_lightning.rollout import _packed

    spec = ModelSpec(
        config={**TINY_LLAMA, "max_position_embeddings": 512}, tokenizer=str(tok), attn_implementation="eager"
    )
    policy = build_policy(spec, load_tokenizer(str(tok)))
    assert policy.config._attn_implementation == "eager"

    def rollout(P: int, T: int) -> Rollout:
        B = 4
        ids = torch.cat([torch.randint(3, 100, (1, P)).expand(B, P), torch.randint(3, 100, (B, T))], 1)  # one prompt
        r = Rollout(
            input_ids=ids,
            attention_mask=torch.ones(B, P + T, dtype=torch.long),
            response_mask=torch.ones(B, T, dtype=torch.bool),
            group_ids=torch.zeros(B, dtype=torch.long),
            truncated=torch.zeros(B, dtype=torch.bool),
        )
        return r

    assert _packed(policy, rollout(8, 200), packing.Layout(4)) is None
    assert _packed(policy, rollout(200, 4), packing.Layout(4)) is not None
