"""The sampler's KV cache: each attention layer's keys and values written in place into a
buffer that doubles when full, instead of `transformers`' `DynamicCache`, which concatenates
each layer's keys and values with the new token's at every step (O(T²) copying for T
tokens). Optionally holding the prompts' part once per distinct prompt (`share_prefix`), for
the decoding attention that reads it (`attention.SharedPrefix`).
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from vapo_lightning.attention import SharedPrefix, decodes_in_autocast_dtype

__all__ = ["GrowingLayer", "cache_argument", "cache_dtype", "growing_cache"]


class GrowingLayer(CacheLayerMixin):
    """One attention layer's KV cache, (B, heads, length, head_dim), written in place.

    `capacity` positions are allocated at the first update (the prompt and every new token
    when the caller knows it); past it the buffer doubles (amortised O(1) per token).
    `update` returns views of the filled part, so attention reads exactly the cached length.
    After `share_prefix` the prompts' part is held once per distinct prompt (`prefix`) and
    `update` returns the positions after it. Supports what decoding needs (update, lengths,
    masks, dropping rows), not beam search, cropping or offloading.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, capacity: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.capacity = capacity
        self.prefix: SharedPrefix | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.length, self.offset = key_states.device, 0, 0
        B, H, T, _ = key_states.shape
        size = max(self.capacity, 2 * T, 64)
        dtype = cache_dtype(key_states)
        self._k = key_states.new_empty(B, H, size, key_states.shape[-1], dtype=dtype)
        self._v = value_states.new_empty(B, H, size, value_states.shape[-1], dtype=dtype)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length - self.offset, self.length - self.offset + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._k, self._v = (self._grow(buf, 2 * end) for buf in (self._k, self._v))
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self.length += key_states.shape[-2]
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def share_prefix(self, group: Tensor) -> None:
        """The cache holds one row per distinct prompt (the prefill's); `group` (B,) says which
        each of the B decoding rows continues. The prompts' keys and values stay, once each,
        as the `prefix` that decoding attention reads (`attention.SharedPrefix`); each row
        caches its own tokens after them."""
        P = self.length - self.offset
        self.prefix = SharedPrefix(self._k[:, :, :P].contiguous(), self._v[:, :, :P].contiguous(), group)
        B, (_, H, size, D) = len(group), self._k.shape
        self._k, self._v = (buf.new_empty(B, H, max(size - P, 1), D) for buf in (self._k, self._v))
        self.offset += P
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]

    def _grow(self, buf: Tensor, size: int) -> Tensor:
        out = buf.new_empty(*buf.shape[:2], size, buf.shape[-1])
        out[:, :, : self.length - self.offset] = buf[:, :, : self.length - self.offset]
        return out

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keeps only the rows at `indices` (finished sequences leave the batch)."""
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = (
                self._k[:, :, : self.length - self.offset],
                self._v[:, :, : self.length - self.offset],
            )
            if self.prefix is not None:
                self.prefix.select(indices)

    def get_mask_sizes(self, query: int | Tensor, *args) -> tuple[int, int]:
        """(kv length, offset) for a query of `query` tokens (older 5.x: its cache positions)."""
        n = query if isinstance(query, int) else query.shape[0]
        return self.get_seq_length() + n, 0

    def get_seq_length(self, *args) -> int:
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def _unsupported(self, *args, **kwargs) -> None:
        raise NotImplementedError("GrowingLayer is a decoding cache: no beam search, crop or offload")

    reorder_cache = crop = offload = prefetch = reset = _unsupported


def cache_dtype(key_states: Tensor) -> torch.dtype:
    """Under autocast (bf16-mixed) a Llama's keys come out of the rotary embedding in fp32, and
    SDPA cast the whole key cache to the autocast dtype at every step, a copy of the cache per
    step. Stored in that dtype once, attention reads the same values and half the key bytes
    (values already come out of `v_proj` in it). Where decoding attends in fp32 (CPUs without
    AMX, `attention.decodes_in_autocast_dtype`), without autocast, and on devices autocast does
    not know: the keys' dtype."""
    device = key_states.device.type
    try:
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except RuntimeError:  # a device type autocast does not know (e.g. mps on torch 2.4)
        low = None
    if not decodes_in_autocast_dtype(device):
        low = None
    wider = key_states.is_floating_point() and low is not None and low.itemsize < key_states.itemsize
    return low if wider else key_states.dtype


def growing_cache(capacity: int) -> Cache:
    """A KV cache whose layers hold `capacity` positions from the start (prompt + the most
    new tokens): it never grows, never over-allocates."""
    return Cache(layer_class_to_replicate=partial(GrowingLayer, capacity=capacity))


def cache_argument(model: PreTrainedModel) -> str:
    """transformers >= 5.2x names the forward's cache argument `cache`; earlier 5.x
    `past_key_values`. (A LoRA model's forward passes it on: its base's forward says.)"""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
