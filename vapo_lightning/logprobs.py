"""Per-token log-probabilities and entropies of (B, T, V) logits, chunk by chunk.

PPO's ratio exp(logp - logp_old) needs fp32 log-probs; a (B, T, V) fp32 log_softmax of a
large vocabulary does not fit beside the model. These kernels take the logits as given (bf16
stays bf16), work `chunk_rows` positions at a time in fp32, and save only the logits and a
(N,) logsumexp for the backward, which recomputes the softmax chunk by chunk. Exported by
`vapo_lightning.core` with the rest of the math. Where the policy's LM head allows it,
`head_logprobs` goes further and never makes the logits whole: it takes the head's input.

A chunk is counted in logits, not rows, so its size does not grow with the vocabulary. On the
CPU it holds about 2^20 of them (4 MiB in fp32), so the several passes over it (cast, max,
exp, sums) read the cache rather than memory; a GPU takes about 2^26 at a time, enough rows to
keep it busy.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_rows", "chunk_rows_for", "entropy_from_logits", "logprobs_from_logits"]

CPU_CHUNK_LOGITS = 2**20  # 4 MiB of fp32: the passes over a chunk read the cache
GPU_CHUNK_LOGITS = 2**26  # 256 MiB of fp32, two or three alive at once


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Positions per chunk of a `vocab`-wide softmax on `device`, by element count: ~2^20
    logits on the CPU, ~2^26 elsewhere (441 rows of Qwen2.5's 152,064-token vocabulary, where a
    fixed 4,096 rows would make a 2.5 GB fp32 temporary)."""
    budget = CPU_CHUNK_LOGITS if device.type == "cpu" else GPU_CHUNK_LOGITS
    return max(1, budget // vocab)


def chunk_rows_for(logits: Tensor) -> int:
    """`chunk_rows` for (..., V) `logits`."""
    return chunk_rows(logits.shape[-1], logits.device)


def _at_least_fp32(x: Tensor, tau: float = 1.0) -> Tensor:
    """x / tau in fp32 (or x's dtype if wider); x itself (no copy) when nothing changes."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x if tau == 1.0 else x / tau


def _per_row(logits: Tensor, tau: float, chunk: int, f) -> tuple[Tensor, Tensor]:
    """(f(rows, z, lse), lse) for each chunk of rows of (N, V) logits: z = logits / tau in
    >= fp32 and lse = logsumexp(z) (N,); one (chunk, V) temporary at a time."""
    out = logits.new_empty(logits.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32))
    lse = torch.empty_like(out)
    for i in range(0, logits.shape[0], chunk):
        rows = slice(i, i + chunk)
        z = _at_least_fp32(logits[rows], tau)
        lse[rows] = torch.logsumexp(z, dim=-1)
        out[rows] = f(rows, z, lse[rows])
    return out, lse


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(z / tau)[label] per row of (N, V) logits, chunk by chunk in >= fp32.

    Saves the logits as given (bf16 stays bf16) and the (N,) logsumexp, not an fp32 copy of
    the logits: the backward recomputes softmax one chunk at a time,
    d logp / dz = (onehot(label) - softmax(z / tau)) / tau.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, tau: float, chunk: int) -> Tensor:
        out, lse = _per_row(logits, tau, chunk, lambda rows, z, m: z.gather(-1, labels[rows, None]).squeeze(-1) - m)
        ctx.save_for_backward(logits, labels, lse)
        ctx.tau, ctx.chunk = tau, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            g = grad_out[rows, None] / ctx.tau  # (chunk, 1): the 1/tau of dz/dlogits
            d = -torch.exp(_at_least_fp32(logits[rows], ctx.tau) - lse[rows, None]) * g
            d.scatter_add_(-1, labels[rows, None], g)
            grad[rows] = d
        return grad, None, None, None


class _TokenEntropy(torch.autograd.Function):
    """H(softmax(z / tau)) per row of (N, V) logits, chunk by chunk in >= fp32; saves the
    logits as given plus (N,) logsumexp and entropy. dH/dz = -p * (log p + H) / tau."""

    @staticmethod
    def forward(ctx, logits: Tensor, tau: float, chunk: int) -> Tensor:
        out, lse = _per_row(logits, tau, chunk, lambda rows, z, m: m - (torch.softmax(z, dim=-1) * z).sum(-1))
        ctx.save_for_backward(logits, lse, out)
        ctx.tau, ctx.chunk = tau, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            logp = _at_least_fp32(logits[rows], ctx.tau) - lse[rows, None]
            g = grad_out[rows, None] / ctx.tau
            grad[rows] = -torch.exp(logp) * (logp + entropy[rows, None]) * g
        return grad, None, None


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_rows: int | None = None
) -> Tensor:
    """log p(label) under softmax(logits / temperature): (B, T, V) logits and (B, T) labels
    -> (B, T), in fp32 (or the logits' dtype if wider).

    `chunk_rows` positions at a time (None: `chunk_rows_for`): never a full (B, T, V)
    log_softmax, at most a (chunk_rows, V) fp32 temporary, in the forward and in the
    backward, and no fp32 copy of bf16 logits is kept for the backward. PPO's ratio exp(logp - logp_old) needs fp32
    log-probs: mixed precision hands over bf16 logits, divided by the temperature only in fp32.
    """
    flat, chunk = logits.reshape(-1, logits.shape[-1]), chunk_rows or chunk_rows_for(logits)
    return _TokenLogProbs.apply(flat, labels.reshape(-1), temperature, chunk).reshape(labels.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """Per-token entropy of softmax(logits / temperature), H = logsumexp(z) - sum softmax(z) * z,
    (..., V) -> (...), in fp32 (or wider); chunked like `logprobs_from_logits`."""
    flat, chunk = logits.reshape(-1, logits.shape[-1]), chunk_rows or chunk_rows_for(logits)
    return _TokenEntropy.apply(flat, temperature, chunk).reshape(logits.shape[:-1])
