"""Per-token log-probs and entropies from the LM head's input: the logits never whole.

`logprobs` takes (B, T, V) logits chunk by chunk, but the logits and their gradient still
exist in full: at 4 answers x 8,192 tokens x Qwen2.5's 152,064-token vocabulary, 10 GB each in
bf16. Here the policy's forward runs with its LM head replaced (`StatsHead`) by one that, given
the hidden states h (N, H) at the kept positions and the tokens they predict, returns
log softmax(h W^T / tau)[token] and the entropy of softmax(h W^T / tau) instead of the logits,
a chunk of positions at a time (`linear_token_stats`, `rows_per_chunk`). Its backward saves
only h and a (N,) logsumexp (and the entropy) and recomputes each chunk's logits, so the
largest temporaries are a few (chunk, V) ones in fp32, in the forward and in the backward.
The gradients with respect to h and to W are the full-logits ones up to float rounding; W's
is summed over chunks in fp32 (a (V, H) fp32 buffer during the backward).

The head is swapped inside the model's own forward, not called after it: under FSDP2 the
root's pre-forward has gathered the head's weight (the embeddings', when tied), and the
statistics leave the forward as its output, on which FSDP2 hangs the hook that gathers the
weight again for the backward. This is what verl does with `use_fused_kernels`:
`verl/models/transformers/monkey_patch.py` patches the model's forward to take log-probs and
entropy from `lm_head.weight` and the hidden states (`forward_with_torch_backend` of
`dense_common.py`: chunks of 512 positions, W's gradient summed in W's dtype; or the Triton
kernel of `verl/utils/kernel/linear_cross_entropy.py`). NeMo-RL's `FusedLinearCrossEntropyLoss` (NeMo
Automodel's, on cut-cross-entropy) and Liger's `LigerFusedLinearCrossEntropyLoss` fuse the
head and a cross-entropy loss the same way, from the hidden states and the head's weight.

It applies where it is exact (`plain_head`): a model whose forward returns `lm_head(hidden)`
unchanged as its logits (no soft-capping or scaling after the head: the types in
`PLAIN_HEAD_MODELS`), whose head is a plain `nn.Linear` without bias reachable as
`get_output_embeddings()` (a LoRA adapter on the head, peft's wrapper, is not), and that is not
`torch.compile`d (a swapped submodule would recompile it). Other models go through the logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vapo_lightning import logprobs

__all__ = ["PLAIN_HEAD_MODELS", "StatsHead", "linear_token_stats", "plain_head", "replaced_head", "rows_per_chunk"]

# Model types whose causal-LM forward is `logits = self.lm_head(hidden_states[:, keep, :])`,
# returned as is (tests/test_head_logprobs.py checks each against its logits).
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})

# Each chunk's matmuls read all of W (V, H): about c flops per byte of a bf16 W for c rows (c/2
# in fp32), so too few rows leave them waiting on memory, and W's gradient takes one (V, H)
# addition per chunk. Rows per chunk are at least these, whatever `logprobs.chunk_rows` counts
# in logits (6 rows of a 152k vocabulary on the CPU): 128 on the CPU, and verl's 512 (its torch
# path's chunk) elsewhere, where 2^26 logits are 441 such rows.
CPU_MIN_ROWS, MIN_ROWS = 128, 512


def rows_per_chunk(vocab: int, device: torch.device) -> int:
    """Positions per chunk of `linear_token_stats`: `logprobs.chunk_rows`, or more (above)."""
    return max(logprobs.chunk_rows(vocab, device), CPU_MIN_ROWS if device.type == "cpu" else MIN_ROWS)


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in here: autocast's, where it is on."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _logits(x: Tensor, w: Tensor, tau: float) -> Tensor:
    """(c, V) logits x w^T in w's dtype, then / tau in >= fp32."""
    z = F.linear(x.to(w.dtype), w)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z if tau == 1.0 else z / tau


class _LinearTokenStats(torch.autograd.Function):
    """(log p(label), H(p)) per row, p = softmax(hidden @ weight^T / tau), chunk by chunk.

    Saves hidden (N, H), weight, labels, the (N,) logsumexp and entropy; the backward
    recomputes a chunk's log p = z - lse and forms dL/dz = -p (g + g_H (log p + H)) + g onehot
    (then / tau): dz gives dhidden = dz W and dW += dz^T hidden.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, labels: Tensor, tau: float, chunk: int, entropy: bool, grad_h: bool
    ):
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(hidden, weight)
        w = weight.to(dtype)
        out_dtype = torch.promote_types(dtype, torch.float32)
        logp = hidden.new_empty(hidden.shape[0], dtype=out_dtype)
        lse = torch.empty_like(logp)
        h = torch.empty_like(logp) if entropy else logp.new_empty(0)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], chunk):
                rows = slice(i, i + chunk)
                z = _logits(hidden[rows], w, tau)  # (c, V)
                lse[rows] = m = torch.logsumexp(z, dim=-1)
                logp[rows] = z.gather(-1, labels[rows, None]).squeeze(-1) - m
                if entropy:
                    h[rows] = m - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, lse, h)
        ctx.dtype, ctx.tau, ctx.chunk, ctx.grad_h = dtype, tau, chunk, entropy and grad_h
        if not ctx.grad_h:
            ctx.mark_non_differentiable(h)
        return logp, h

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_h: Tensor | None):
        hidden, weight, labels, lse, h = ctx.saved_tensors
        g_h = g_h if ctx.grad_h else None
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (g_logp is None and g_h is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        w = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # W's gradient, summed over chunks
        grad_weight = weight.new_zeros(weight.shape, dtype=acc) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], ctx.chunk):
                rows = slice(i, i + ctx.chunk)
                x = hidden[rows].to(ctx.dtype)
                logp = _logits(x, w, ctx.tau).sub_(lse[rows, None])  # (c, V) log p
                p = logp.exp()
                coef: Tensor | float = g_logp[rows, None] if g_logp is not None else 0.0
                if g_h is not None:
                    coef = logp.add_(h[rows, None]).mul_(g_h[rows, None]).add_(coef)
                dz = p.mul_(coef).neg_()  # -p (g + g_H (log p + H)), then + g onehot
                if g_logp is not None:
                    dz.scatter_add_(-1, labels[rows, None], g_logp[rows, None])
                dz = (dz.div_(ctx.tau) if ctx.tau != 1.0 else dz).to(ctx.dtype)  # (c, V) dL/dlogits
                if grad_hidden is not None:
                    grad_hidden[rows] = dz @ w
                if grad_weight is not None and dz.dtype == acc:
                    grad_weight.addmm_(dz.T, x)
                elif grad_weight is not None:
                    grad_weight += dz.T @ x
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = False,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(label) and (with `entropy`) H(p) for p = softmax(hidden @ weight^T / temperature):
    hidden (N, H), weight (V, H), labels (N,) -> (N,), (N,), in fp32 (or wider).

    The logits exist `chunk_rows` positions at a time (None: `rows_per_chunk`), in the
    forward and in the backward, computed in `F.linear`'s dtype (autocast's where it is on) and
    divided by the temperature in fp32. `entropy_grad`: the entropy keeps its graph (an
    entropy bonus); otherwise only its value.
    """
    chunk = chunk_rows or rows_per_chunk(weight.shape[0], hidden.device)
    logp, h = _LinearTokenStats.apply(hidden, weight, labels, temperature, chunk, entropy, entropy_grad)
    return logp, h if entropy else None


class StatsHead(nn.Module):
    """Stands in for the LM head `head` for one forward (`replaced_head`): given the hidden
    states (..., H) at the kept positions, returns (M, k) statistics instead of (..., V)
    logits: column 0 the log-prob of `labels` (M,) under the temperature, column 1 (with
    `entropy`) the entropy. `index` (M,): which of the flattened positions each label is
    predicted at (None: each position its own label, and the output keeps the positions'
    shape, (..., k)). The head's weight is read at call time: FSDP2's gathered one."""

    head: nn.Linear

    def __init__(
        self,
        head: nn.Linear,
        labels: Tensor,
        temperature: float,
        entropy: bool,
        entropy_grad: bool,
        index: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: the model's parameters stay as they are
        self.labels, self.index, self.temperature = labels, index, temperature
        self.entropy, self.entropy_grad = entropy, entropy_grad

    def forward(self, hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        x = flat if self.index is None else flat[self.index]
        logp, h = linear_token_stats(
            x, self.head.weight, self.labels, self.temperature, self.entropy, self.entropy_grad
        )
        shape = hidden.shape[:-1] if self.index is None else self.index.shape
        # A new tensor, not a view: FSDP2 hooks its backward on the forward's output.
        return torch.stack([logp.view(shape)] + ([] if h is None else [h.view(shape)]), -1)


def plain_head(model: object) -> nn.Linear | None:
    """`model`'s LM head, where its statistics can come from its input exactly (the module
    docstring says when); None where the logits must be made."""
    if not isinstance(model, nn.Module) or getattr(model, "_compiled_call_impl", None) is not None:
        return None
    if getattr(getattr(model, "config", None), "model_type", None) not in PLAIN_HEAD_MODELS:
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is nn.Linear and head.bias is None else None


@contextlib.contextmanager
def replaced_head(model: nn.Module, head: nn.Module, stand_in: nn.Module) -> Iterator[None]:
    """`model` with the submodule `head` replaced by `stand_in`, put back on exit."""
    name = next(n for n, m in model.named_modules() if m is head)
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, stand_in)
    try:
        yield
    finally:
        setattr(owner, attr, head)
