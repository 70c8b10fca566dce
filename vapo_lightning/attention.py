"""Attention for bf16 mixed precision on the CPU.

Under CPU autocast, SDPA runs in bf16, and torch's bf16 flash-attention *backward* on the CPU is
slower than the fp32 one, enough that a whole actor update runs faster with attention in fp32.
`SDPA` below is transformers' SDPA attention, except that on the CPU under autocast it runs in
fp32 (faster there for training, and more accurate), in every forward but decoding's on CPUs
with AMX: the sampler's single-token forwards only read the KV cache, and bf16 halves the bytes
they read (`decoding()`, `decodes_in_autocast_dtype`). So the forwards that give pi_old, V and
the updates' log-probs all use the same kernel, whatever the grad mode. On GPUs, and without
autocast, it is transformers' own function.

`models._finish` selects it for the model types listed in `STANDARD_SDPA` (their modeling code
calls attention only through transformers' interface; some others test the name "sdpa"
themselves). The choice is not saved with the model (`save_pretrained` writes none).

Shared-prompt forwards (`packing`) pass the layout of their packs as `pack_spans`; on the CPU
`packed_attention` then attends span by span instead of over each pack's whole square.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = [
    "SDPA",
    "STANDARD_SDPA",
    "SharedPrefix",
    "decodes_in_autocast_dtype",
    "decoding",
    "grouped_decode_attention",
    "packed_attention",
    "reading_shared_prefixes",
    "sdpa_fp32_on_cpu",
]

SDPA = "vapo_sdpa"
STANDARD_SDPA = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})

_decoding = contextvars.ContextVar("vapo_decoding", default=False)
_prefixes: contextvars.ContextVar[Sequence[SharedPrefix | None] | None] = contextvars.ContextVar(
    "vapo_shared_prefixes", default=None
)


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """Forwards inside run attention in the autocast dtype (the sampler's). A context
    variable: threads started inside do not inherit it."""
    token = _decoding.set(True)
    try:
        yield
    finally:
        _decoding.reset(token)


class SharedPrefix:
    """One layer's cached keys and values of G distinct prompts, (G, H_kv, P, D), and the
    prompt each decoding row continues (`group`, (b,)): group sampling asks each prompt n
    times, and the n rows read its cache once, as one matrix of their n × H / H_kv queries
    against it, instead of each its own copy. A decoding step's attention on the CPU spends
    its time reading the cache, and the prompt is most of what it reads.

    The rows are placed in a (G, n) grid (n: the most rows any prompt has; a row's slot: its
    rank among its prompt's rows, holes left empty) to be multiplied by their prompt's cache.
    """

    def __init__(self, keys: Tensor, values: Tensor, group: Tensor) -> None:
        self.keys, self.values = keys, values
        self._place(group)

    def select(self, indices: Tensor) -> None:
        """Keeps the rows at `indices` (finished rows leave the batch) and the prompts that
        still have one."""
        group = self.group[indices]
        alive = torch.bincount(group, minlength=len(self.keys)) > 0
        if not alive.all():
            self.keys, self.values = self.keys[alive], self.values[alive]
            group = (alive.cumsum(0) - 1)[group]
        self._place(group)

    def _place(self, group: Tensor) -> None:
        counts = torch.bincount(group, minlength=len(self.keys))
        order = torch.argsort(group, stable=True)
        slot = torch.empty_like(group)
        slot[order] = torch.arange(len(group), device=group.device) - (counts.cumsum(0) - counts)[group[order]]
        self.group, self.n = group, int(counts.max())
        self.index = group * self.n + slot  # (b,) each row's place in the (G, n) grid

    def _by_prompt(self, x: Tensor) -> Tensor:
        """(b, H_kv, g, k) per row -> (G, H_kv, n × g, k) per prompt (zeros in the holes)."""
        _, kv_heads, g, k = x.shape
        grid = x.new_zeros(len(self.keys) * self.n, kv_heads, g, k).index_copy_(0, self.index, x)
        return grid.view(-1, self.n, kv_heads, g, k).transpose(1, 2).reshape(-1, kv_heads, self.n * g, k)

    def _by_row(self, y: Tensor, g: int) -> Tensor:
        """(G, H_kv, n × g, k) per prompt -> (b, H_kv, g, k) per row."""
        G, kv_heads, _, k = y.shape
        return y.view(G, kv_heads, self.n, g, k).transpose(1, 2).reshape(G * self.n, kv_heads, g, k)[self.index]

    def scores(self, q: Tensor) -> Tensor:
        """(b, H_kv, g, D) queries -> (b, H_kv, g, P): q k^T against each row's prompt."""
        return self._by_row(self._by_prompt(q) @ self.keys.transpose(-1, -2), q.shape[2])

    def mix(self, probs: Tensor) -> Tensor:
        """(b, H_kv, g, P) attention weights on the prompt -> (b, H_kv, g, D): their sum of
        its values."""
        return self._by_row(self._by_prompt(probs) @ self.values, probs.shape[2])


@contextlib.contextmanager
def reading_shared_prefixes(prefixes: Sequence[SharedPrefix | None]) -> Iterator[None]:
    """Decoding steps inside attend, in layer i, over `prefixes[i]` (None: none) and then the
    keys and values the cache passes (each row's own tokens after it)."""
    token = _prefixes.set(prefixes)
    try:
        yield
    finally:
        _prefixes.reset(token)


@functools.cache
def cpu_has_amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later), where torch's CPU bf16 kernels are fast."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def decodes_in_autocast_dtype(device_type: str) -> bool:
    """Whether decoding attends in the autocast dtype and keeps its KV cache in it (GPUs, and
    CPUs with AMX), or in fp32 (other CPUs). Without AMX, torch's CPU bf16 attention is the slow
    one, for a decoding step's single-token queries too, even on a CPU with AVX512-BF16."""
    return device_type != "cpu" or cpu_has_amx()


def sdpa_fp32_on_cpu(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pack_spans: tuple | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """(B, H, L, D) query, key and value -> (B, L, H, D) attention output, as transformers'
    `sdpa_attention_forward`; in fp32 on the CPU under autocast, except while decoding on a
    CPU with AMX. With `pack_spans` (`packing.Pack.spans`) on the CPU, `packed_attention`."""
    # Compiled forwards never decode (the sampler runs eager), and dynamo cannot trace a
    # ContextVar: reading it would split a compiled graph at every attention layer.
    sampling = not torch.compiler.is_compiling() and _decoding.get()
    if sampling and query.device.type == "cpu" and query.shape[2] == 1:
        prefixes = _prefixes.get()
        prefix = prefixes[module.layer_idx] if prefixes is not None else None
        return grouped_decode_attention(query, key, value, attention_mask, kwargs.get("scaling"), prefix)
    decode = sampling and cpu_has_amx()
    if pack_spans is not None and query.device.type == "cpu":
        fp32 = torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", enabled=False):
            q, k, v = (x.float() for x in (query, key, value)) if fp32 else (query, key, value)
            return packed_attention(q, k, v, pack_spans, kwargs.get("scaling")), None
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu") and not decode:
        with torch.autocast("cpu", enabled=False):
            return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, None]:
    """One decoding step's attention on the CPU: (B, H, 1, D) query, (B, H_kv, T, D) cached
    keys and values (the cache's views), a (B, 1, 1, T) mask (boolean, True: attend; or
    additive) or None -> ((B, 1, H, D) output, None), in the cache's dtype. With a `prefix`
    (the prompts' shared cache, P positions), `key` and `value` hold the positions after it and
    the mask covers P + T.

    softmax(q k^T * scaling + mask) v, with the H / H_kv query heads that share a key head as
    one matrix against it, so the cache is read once, in place. transformers' SDPA path copies
    every layer's whole cache H / H_kv times (`repeat_kv`: torch's GQA needs no mask) and
    torch's CPU flash kernel is built for long queries, not a decoding step's single one.
    """
    B, H, _, D = query.shape
    kv_heads, dtype = key.shape[1], key.dtype
    with torch.autocast("cpu", enabled=False):
        q = query.to(dtype).view(B, kv_heads, H // kv_heads, D)
        scores = q @ key.transpose(-1, -2)
        if prefix is not None:
            scores = torch.cat([prefix.scores(q), scores], -1)
        scores = scores * (D**-0.5 if scaling is None else scaling)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))  # (B, 1, 1, T)
        elif attention_mask is not None:  # an additive float mask
            scores = scores + attention_mask.to(dtype)
        probs = scores.softmax(-1)
        if prefix is None:
            out = probs @ value  # (B, H_kv, H / H_kv, D)
        else:
            P = prefix.keys.shape[2]
            out = prefix.mix(probs[..., :P]) + probs[..., P:] @ value
    return out.reshape(B, 1, H, D), None


def columns(packs: Sequence, shared: int, length: int, row: Sequence[torch.Tensor]) -> list[dict[int, torch.Tensor]]:
    """Each (H, L, D) tensor of `row` as (1, H, n, D) views of the row's spans, keyed by their
    first column: the shared start, each pack's prompt, each response. One split per tensor,
    not a slice per span: a slice's backward writes a zero tensor the size of the whole row,
    once per span (quadratic in the spans a row holds), a split's is one concatenation."""
    bounds = {0, shared, length}
    for pack in packs:
        bounds |= {pack.first, pack.P, *(s + n for s, n in pack.responses)}
    cuts = sorted(bounds)
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    return [dict(zip(cuts, x[None].split(sizes, 2), strict=False)) for x in row]


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: tuple,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention over packs (`packing`), span by span: (R, H, L, D) query, (R, H_kv, L, D)
    keys and values, `spans` (R,) the `packing.Spans` of the packs in each row ->
    (R, L, H, D) output, zero outside the packs.

    A row's shared start [0, S) (its packs' `shared`; S = 0: none) attends causally over
    itself; each prompt [first, P) over the shared start and causally over itself, each
    response [s, s + n) over the shared start, its prompt and causally over itself: the pairs
    a pack's block mask keeps, and no others. One masked call computes all L^2 pairs of a
    row, most of them masked out where a row holds several packs of several answers each.
    """
    H, L, D = query.shape[1:]

    def attend(q, k, v, **how):  # torch's CPU flash kernel takes 4-D (1, H, n, D) inputs only
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True, **how)

    def after(context: int, n: int) -> torch.Tensor:  # n queries: all `context` keys, then causal
        return torch.ones(n, context + n, dtype=torch.bool, device=query.device).tril(context)

    rows = []
    for packs, *row in zip(spans, query.unbind(0), key.unbind(0), value.unbind(0), strict=True):
        S = packs[0].shared if packs else 0
        q, k, v = columns(packs, S, L, row)
        parts, done = [], S
        if S:
            parts.append(attend(q[0], k[0], v[0], is_causal=True))
        for span in packs:
            f, P = span.first, span.P
            pk, pv = k[f], v[f]  # views: no copy where no start is shared
            if S:
                pk, pv = torch.cat([k[0], pk], 2), torch.cat([v[0], pv], 2)
            prompt = attend(q[f], pk, pv, attn_mask=after(S, P - f)) if S else attend(q[f], pk, pv, is_causal=True)
            parts += [query.new_zeros(1, H, f - done, D), prompt]
            for s, n in span.responses:
                if n:  # an empty response has no column
                    keys, values = torch.cat([pk, k[s]], 2), torch.cat([pv, v[s]], 2)
                    parts.append(attend(q[s], keys, values, attn_mask=after(S + P - f, n)))
            done = span.end
        parts.append(query.new_zeros(1, H, L - done, D))
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows).transpose(1, 2).contiguous()


AttentionInterface.register(SDPA, sdpa_fp32_on_cpu)
AttentionMaskInterface.register(SDPA, sdpa_mask)  # the same masks as "sdpa"
