"""Shared-prompt forwards: the responses to one prompt in one sequence, the prompt once.

Group sampling (§4.3) answers every prompt n times, and each forward of a rollout step
(pi_old, V_old, the critic's and the actor's updates) would otherwise run each prompt through
the model n times. A *pack* lays c responses to one prompt after a single copy of it,

    [prompt | response 1 | response 2 | ... | response c]

with a block mask: the prompt causal over itself, each response causal over itself and
seeing the whole prompt, never another response, and positions that restart after the
prompt for every response. Each response token sees exactly the context it had in its own
row, so the logits, the values and their gradients are the per-row ones up to the order of
float sums (the prompt's activations receive the sum of the c responses' gradients, as they
do across c rows). The work saved grows with the prompt's share of a row.

Packs sit one per row, padded to the longest, for an attention that takes a custom 4-D mask
(sdpa, eager; not flash-attention's varlen kernels, where `algorithm.share_prompts: false`
keeps rows apart). One masked call over a row computes every (query, key) pair of its
L x L square, most of which the mask then drops, and the linear layers run over its
padding. On the CPU the project's attention (`attention.SDPA`) reads the packs' `spans`
instead: the packs of a micro-batch lie end to end in one row, without padding or a mask,
and it attends span by span, each prompt over itself and each response over its prompt and
itself (`attention.packed_attention`). There a pack may hold one response (rows that share no
prompt: no padding either), and the tokens every prompt of the micro-batch starts with (a
system prompt, an instruction, a worked example) are laid once at the row's start, before
the first pack: each prompt continues them, as it does in its own row,

    [common start | rest of prompt 1 | its responses | rest of prompt 2 | its responses | ...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vapo_lightning.attention import SDPA
from vapo_lightning.config import Algorithm

__all__ = [
    "Layout",
    "Pack",
    "Spans",
    "common_start",
    "dense_packing_saves_work",
    "layout_for",
    "pack",
    "pack_size",
    "reads_spans",
    "takes_masks",
]

MASKED_ATTENTION = frozenset({"sdpa", "eager", SDPA})  # attentions that read a 4-D mask


@dataclass(frozen=True)
class Spans:
    """Where one pack lies in its row, in columns: its prompt `[first, P)` and its responses
    `[start, start + length)`, back to back after it; the prompt continues the row's columns
    `[0, shared)` (the start every prompt of the row has in common; 0: none)."""

    first: int
    P: int
    responses: tuple[tuple[int, int], ...]  # (start, length) of each response
    shared: int = 0

    @property
    def end(self) -> int:  # the column after the pack
        start, length = self.responses[-1]
        return start + length


@dataclass
class Pack:
    """c responses to each of G prompts as R rows of L tokens, each pack its prompt then its
    responses back to back: one pack per row, prompts right-aligned at column P and a block
    mask (R = G), or all packs end to end in one row for an attention that reads `spans`
    (R = 1, no mask, no padding)."""

    input_ids: Tensor  # (R, L)
    attention_mask: Tensor | None  # (R, 1, L, L) bool, True: attend; None: `spans` say it
    position_ids: Tensor  # (R, L)
    keep: Tensor  # (K,) columns whose outputs can predict a response token
    index: Tensor  # (B, T) where row b's token t is predicted, among the R·K kept outputs
    first: Tensor  # (G,) each prompt's last token (it predicts every first token), among them
    spans: tuple[tuple[Spans, ...], ...]  # (R,) the packs in each row

    @property
    def forward_kwargs(self) -> dict:
        """The model's inputs for this pack."""
        if self.attention_mask is None:
            return {"input_ids": self.input_ids, "position_ids": self.position_ids, "pack_spans": self.spans}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    @property
    def next_tokens(self) -> Tensor:  # (R, K) the token after each kept column
        return self.input_ids[:, self.keep + 1]

    def rows(self, out: Tensor) -> Tensor:
        """The (R, K, ...) outputs at `keep` in the per-row layout (B, T, ...)."""
        return out.flatten(0, 1)[self.index]


def reads_spans(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model` attends by `Pack.spans` on `device`: the project's attention, on the
    CPU, not compiled (spans are Python ints, which would specialise a graph to each pack)."""
    config = getattr(model, "config", None)
    compiled = getattr(model, "_compiled_call_impl", None) is not None
    return getattr(config, "_attn_implementation", None) == SDPA and device.type == "cpu" and not compiled


def takes_masks(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention reads a custom 4-D mask."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in MASKED_ATTENTION


def dense_packing_saves_work(prompt: float, answer: float, c: int, params: float, layers: int, hidden: int) -> bool:
    """Whether one dense-mask pack of c answers of `answer` tokens after a `prompt`-token
    prompt costs fewer FLOPs than c rows of prompt + answer, for a model of `params`
    parameters, `layers` layers of width `hidden`. The linear layers cost 2·params FLOPs a
    token: P + cT tokens packed against c(P + T). Attention costs 4·layers·hidden FLOPs a
    (query, key) pair (QKᵀ and AV): a masked call computes the pack's whole (P + cT)² square,
    where c causal rows cost c(P + T)²/2. Prompts longer than answers: packing saves; long
    reasoning answers (P 200, T 4096, c 8 at 7 B): the pack's attention, about (cT)² against
    the rows' cT²/2, costs more than the prompt's linear layers save."""
    packed = 2 * params * (prompt + c * answer) + 4 * layers * hidden * (prompt + c * answer) ** 2
    rows = 2 * params * c * (prompt + answer) + 4 * layers * hidden * c * (prompt + answer) ** 2 / 2
    return packed < rows


@dataclass(frozen=True)
class Layout:
    """How a rollout's rows go through a model's forward: runs of `pack` consecutive rows (the
    responses to one prompt) as one sequence, the prompt once (1: every row on its own); and,
    where the model reads spans, whether the packs (of one response, too) lie end to end after
    the start their prompts share, laid once (`shared_start`; False: not)."""

    pack: int = 1
    shared_start: bool = True


ROWS = Layout()  # every row on its own (where a model reads spans: end to end, the start once)


def layout_for(group_ids: Tensor, algo: Algorithm) -> Layout:
    """The layout of a rollout whose groups are `group_ids` (B,) under `algo`'s switches."""
    return Layout(pack_size(group_ids, algo), algo.share_prompts)


def pack_size(group_ids: Tensor, algo: Algorithm) -> int:
    """Responses per pack for a rollout whose groups are `group_ids` (B,): c = min(n,
    micro_batch_size) when `algo.share_prompts`, every prompt's n responses are consecutive
    rows and c divides n, the micro-batch and the mini-batch (packs never straddle a group
    or a batch); 1 (every row on its own) otherwise."""
    runs, counts = torch.unique_consecutive(group_ids.cpu(), return_counts=True)
    n = int(counts[0]) if len(counts) else 1
    if not algo.share_prompts or n < 2 or not bool((counts == n).all()) or len(runs.unique()) != len(runs):
        return 1
    c = min(n, algo.micro_batch_size)
    return c if n % c == 0 and algo.micro_batch_size % c == 0 and algo.mini_batch_size % c == 0 else 1


def common_start(prompts: Tensor, real: Tensor) -> int:
    """How many tokens all G ≥ 2 left-padded prompts (G, P) (`real`: their tokens, the rest
    padding) start with, leaving each at least its last token of its own (the one that
    predicts its responses' first tokens); 0 for one prompt."""
    lengths = real.sum(-1)
    if len(prompts) < 2:
        return 0
    shortest = max(int(lengths.min()) - 1, 0)
    columns = torch.arange(shortest, device=prompts.device)
    starts = prompts.gather(1, (prompts.shape[1] - lengths)[:, None] + columns[None])  # (G, shortest) left-aligned
    differs = (starts != starts[:1]).any(0)
    return int(differs.float().argmax()) if bool(differs.any()) else shortest


def pack(
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    c: int,
    end_to_end: bool = False,
    share_start: bool = True,
) -> Pack | None:
    """The packed form of B = G·c rows (B, P + T), left-padded prompts and right-padded
    responses, whose consecutive runs of c rows share one prompt (the first P columns); None
    when they do not (or c < 2 with one pack per row). `end_to_end`: all packs in one row
    (`Pack`), after the start their prompts have in common (`common_start`; not with
    `share_start` off)."""
    B, width = input_ids.shape
    T = response_length
    P = width - T
    if c < (1 if end_to_end else 2) or B % c or P < 1:
        return None
    G, dev = B // c, input_ids.device
    prompts, prompt_mask = input_ids[:, :P].view(G, c, P), attention_mask[:, :P].view(G, c, P)
    if not (bool((prompts == prompts[:, :1]).all()) and bool((prompt_mask == prompt_mask[:, :1]).all())):
        return None
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as `Rollout.position_ids`
    real_prompt = prompt_mask[:, 0].bool()  # (G, P)
    prompt_len = real_prompt.sum(-1)  # (G,)
    extent = attention_mask[:, P:].sum(-1).view(G, c)  # each response's tokens (right-padded)
    answers = extent.sum(-1)  # (G,) response tokens of each pack
    # Each pack keeps at least its prompt's last column (`first`), even with no response token.
    kept = answers.clamp(min=1)
    shared = common_start(prompts[:, 0], real_prompt) if end_to_end and share_start else 0
    if end_to_end:  # the shared start at [0, shared), then pack g at [col0, col0 + size)
        size = prompt_len - shared + answers
        row, col0 = torch.zeros_like(size), shared + size.cumsum(0) - size
        R, L = 1, shared + int(size.sum())
        keep = torch.cat(
            [
                torch.arange(a - 1, a + n - 1, device=dev)
                for a, n in zip((col0 + prompt_len - shared).tolist(), kept.tolist(), strict=True)
            ]
        )
        base = kept.cumsum(0) - kept  # where each pack's kept outputs begin among the K
    else:  # pack g in row g, its prompt ending at column P
        row, col0 = torch.arange(G, device=dev), P - prompt_len
        R, L = G, P + int(kept.max())
        keep = torch.arange(P - 1, L - 1, device=dev)
        base = row * (L - P)
    after_prompt = col0 + prompt_len - shared  # (G,) where each pack's first response begins
    start = after_prompt[:, None] + extent.cumsum(-1) - extent  # (G, c)
    ids = input_ids.new_zeros(R, L)
    pos = positions.new_zeros(R, L)
    block = torch.full((R, L), -2, device=dev)  # -1: a prompt; k: response k; -2: padding
    g_prompt = torch.arange(G, device=dev)[:, None].expand(G, P)[real_prompt]
    i = real_prompt.long().cumsum(-1) - 1  # (G, P) each real token's index in its prompt
    at = torch.where(i < shared, i, col0[:, None] + i - shared)[real_prompt]  # the shared start: once
    ids[row[g_prompt], at] = prompts[:, 0][real_prompt]
    pos[row[g_prompt], at] = positions[::c, :P][real_prompt]
    block[row[g_prompt], at] = -1
    t = torch.arange(T, device=dev)
    inside = t[None] < extent.view(B, 1)  # (B, T) real response tokens
    g_token = (torch.arange(B, device=dev) // c)[:, None].expand(B, T)[inside]
    at = (start.view(B, 1) + t[None])[inside]
    ids[row[g_token], at] = input_ids[:, P:][inside]
    pos[row[g_token], at] = positions[:, P:][inside]
    block[row[g_token], at] = (torch.arange(B, device=dev) % c)[:, None].expand(B, T)[inside]
    # Row b's token t is predicted at the token before it: the prompt's last for t = 0.
    before = torch.where(t[None] == 0, 0, (start - after_prompt[:, None]).view(B, 1) + t[None])
    index = torch.where(inside, base.repeat_interleave(c)[:, None] + before, 0)
    spans = [[] for _ in range(R)]
    columns = (row.tolist(), col0.tolist(), after_prompt.tolist(), start.tolist(), extent.tolist())
    for r, a, p, s, n in zip(*columns, strict=True):
        spans[r].append(Spans(a, p, tuple(zip(s, n, strict=True)), shared))
    mask = None
    if not end_to_end:
        i = torch.arange(L, device=dev)
        sees = (i[:, None] >= i[None, :]) & (block[:, None, :] != -2)  # causal, real keys only
        sees &= (block[:, None, :] == -1) | (block[:, :, None] == block[:, None, :])  # (G, L, L)
        mask = sees[:, None]  # (a padding query sees nothing: torch's sdpa gives it zeros)
    return Pack(ids, mask, pos, keep, index, base, tuple(map(tuple, spans)))
