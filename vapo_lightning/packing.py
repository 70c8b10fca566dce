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
do across c rows). The work saved grows with the prompt's share of a row: the model
passes of a rollout step of configs/smollm2.yaml (prompts of ~115 tokens, answers of ~77)
take a third less time (`benchmarks/results/real_model_passes.md`).

It needs an attention that takes a custom 4-D mask (sdpa, eager; not flash-attention's
varlen kernels, where `algorithm.share_prompts: false` keeps rows apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vapo_lightning.config import Algorithm

__all__ = ["Pack", "pack", "pack_size", "takes_masks"]

MASKED_ATTENTION = frozenset({"sdpa", "eager", "vapo_sdpa"})  # attentions that read a 4-D mask


@dataclass
class Pack:
    """c responses to each of G prompts as G sequences of L tokens: the prompt's P columns,
    then the c responses back to back (each only as long as it is), then padding."""

    input_ids: Tensor  # (G, L)
    attention_mask: Tensor  # (G, 1, L, L) bool, True: attend
    position_ids: Tensor  # (G, L)
    keep: Tensor  # (L - P,) positions P-1 .. L-2: every output that can predict a response token
    index: Tensor  # (B, T) where row b's token t is predicted, among `keep` (0 past its end)

    def rows(self, out: Tensor) -> Tensor:
        """The (G, L - P, ...) outputs at `keep` in the per-row layout (B, T, ...)."""
        B = self.index.shape[0]
        group = torch.arange(B, device=out.device) // (B // out.shape[0])
        return out[group[:, None], self.index]


def takes_masks(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention reads a custom 4-D mask."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in MASKED_ATTENTION


def pack_size(group_ids: Tensor, algo: Algorithm) -> int:
    """Responses per pack for a rollout whose groups are `group_ids` (B,): c = min(n,
    micro_batch_size) when `algo.share_prompts`, every prompt's n responses are consecutive
    rows and c divides n, the micro-batch and the mini-batch (packs never straddle a group
    or a batch); 1 (every row on its own) otherwise."""
    runs, counts = torch.unique_consecutive(group_ids.cpu(), return_counts=True)
    n = int(counts[0]) if len(counts) else 1
    if (
        not algo.share_prompts
        or n < 2
        or not bool((counts == n).all())
        or len(runs.unique()) != len(runs)
    ):
        return 1
    c = min(n, algo.micro_batch_size)
    return (
        c if n % c == 0 and algo.micro_batch_size % c == 0 and algo.mini_batch_size % c == 0 else 1
    )


def pack(input_ids: Tensor, attention_mask: Tensor, response_length: int, c: int) -> Pack | None:
    """The packed form of B = G·c rows (B, P + T), left-padded prompts and right-padded
    responses, whose consecutive runs of c rows share one prompt (the first P columns); None
    when they do not (or c < 2)."""
    B, width = input_ids.shape
    T = response_length
    P = width - T
    if c < 2 or B % c or P < 1:
        return None
    G, dev = B // c, input_ids.device
    prompts, prompt_mask = input_ids[:, :P].view(G, c, P), attention_mask[:, :P].view(G, c, P)
    if not (bool((prompts == prompts[:, :1]).all()) and bool((prompt_mask == prompt_mask[:, :1]).all())):
        return None
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as `Rollout.position_ids`
    extent = attention_mask[:, P:].sum(-1).view(G, c)  # each response's tokens (right-padded)
    start = P + extent.cumsum(-1) - extent  # (G, c) where each response begins in its pack
    L = P + int(extent.sum(-1).max())
    t = torch.arange(T, device=dev)
    inside = t[None] < extent.view(B, 1)  # (B, T) real response tokens
    dest = (start.view(B, 1) + t[None])[inside]  # their columns in the pack
    group = (torch.arange(B, device=dev) // c)[:, None].expand(B, T)[inside]
    ids = input_ids.new_zeros(G, L)
    pos = positions.new_zeros(G, L)
    block = torch.full((G, L), -2, device=dev)  # -1: the prompt; k: response k; -2: padding
    ids[:, :P], pos[:, :P] = prompts[:, 0], positions[::c, :P]
    block[:, :P] = torch.where(prompt_mask[:, 0].bool(), -1, -2)
    ids[group, dest] = input_ids[:, P:][inside]
    pos[group, dest] = positions[:, P:][inside]
    block[group, dest] = (torch.arange(B, device=dev) % c)[:, None].expand(B, T)[inside]
    i = torch.arange(L, device=dev)
    sees = (i[:, None] >= i[None, :]) & (block[:, None, :] != -2)  # causal, real keys only
    sees &= (block[:, None, :] == -1) | (block[:, :, None] == block[:, None, :])  # (G, L, L)
    # Row b's token t is predicted at the token before it: the prompt's last for t = 0.
    # (A padding query sees nothing: torch's sdpa gives it zeros, and it is never read.)
    before = torch.where(t[None] == 0, P - 1, start.view(B, 1) + t[None] - 1)
    index = torch.where(t[None] < extent.view(B, 1), before - (P - 1), 0)
    keep = torch.arange(P - 1, L - 1, device=dev)
    return Pack(ids, sees[:, None], pos, keep, index)
