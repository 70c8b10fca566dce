"""The rollout sampler: a lean decoding loop over any Hugging Face causal LM's forward.

`transformers`' `generate` is built for every decoding strategy; a rollout needs one, and
pays for three of its general-purpose choices:

- its `DynamicCache` concatenates each layer's keys and values with the new token's, so
  decoding T tokens copies O(T²) cache; `kv_cache.GrowingLayer` writes in place into a buffer
  that doubles when full;
- it decodes every sequence until the longest one stops; here finished sequences leave the
  batch (`compact`), so the cost follows the sum of the response lengths, not B × max;
- it reads a prompt asked n times (group sampling, §4.3) n times; here the prefill runs over
  the distinct prompts, a group's n rows costing one prompt's forward, and with this
  project's attention on the CPU their cache is kept once, read once per decoding step by
  all the rows that continue it (`attention.SharedPrefix`; elsewhere it is copied to each
  row).

Decoding never uses cuDNN's attention kernel. Under bf16 autocast SDPA picked it once
finished rows had left the batch, and it built a new execution plan at nearly every step: the
planning's CPU time, not the GPU's work, then set the step's pace.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from vapo_lightning.attention import SDPA, decoding, reading_shared_prefixes
from vapo_lightning.engines.kv_cache import cache_argument, growing_cache
from vapo_lightning.logprobs import entropy_from_logits, logprobs_from_logits

__all__ = [
    "Sampled",
    "StopText",
    "eager",
    "gathered_weights",
    "sample_responses",
    "weights_cast_once",
    "without_cudnn_attention",
]


@contextlib.contextmanager
def without_cudnn_attention() -> Iterator[None]:
    """SDPA may use any kernel the caller allows except cuDNN's (see the module docstring);
    the flag is restored on exit. Process-global, like every `torch.backends` switch."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Forwards inside run eagerly even when the model is compiled (`VAPOModule(torch_compile=
    True)`): a decoding step's cache length changes at every call, so a compiled forward would
    recompile at each one until dynamo gave up. The stance is process-wide (threads running
    compiled code meanwhile run it eager too). No-op before torch 2.6 (no `set_stance`)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield


@contextlib.contextmanager
def weights_cast_once() -> Iterator[None]:
    """Under autocast each forward casts every fp32 weight to the autocast dtype again unless
    autocast's cast cache is on, and Lightning's mixed precision turns it off from 2.6 on (in a
    training step a cached cast would outlive the optimizer step; `updates.clip_and_step`
    drops them for older versions). A rollout's weights do not change, so the sampler turns the
    cache on: each weight is cast once per call instead of once per token. The cache is dropped
    on entry (the caller's region may hold casts of weights updated since) and on exit (these
    casts were made under no_grad, for weights an update will change), where the flag is
    restored. The flag is per thread; the cache is one for the process, so another thread's
    autocast may use or drop these casts meanwhile. Memory: while it samples, one copy of the
    fp32 weights in the autocast dtype (half their size; none for FSDP's bf16 parameters, which
    are not cast)."""
    enabled = torch.is_autocast_cache_enabled()
    torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)
        torch.clear_autocast_cache()


class Sampled(NamedTuple):
    """What `sample_responses` returns with `logprobs`: (B, T) each; after a row's stop
    token, padding and 0. Callers that asked for tokens alone carry None in the other two."""

    tokens: Tensor
    logprobs: Tensor | None  # log softmax(logits / T) of each sampled token, fp32
    entropy: Tensor | None  # the entropy of softmax(logits / T) at each position, fp32


def next_tokens(logits: Tensor, temperature: float, top_p: float, top_k: int = 0) -> Tensor:
    """One token per row of (b, V) logits: greedy at temperature 0, else sampling from
    softmax(logits / temperature) restricted to the k most likely tokens (top_k > 0), then
    to the smallest set of mass >= top_p (vLLM's order: top-k, then top-p)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return inverse_cdf_draw(logits.softmax(-1))


def inverse_cdf_draw(probs: Tensor, u: Tensor | None = None, block: int = 256) -> Tensor:
    """One index per row of (b, V) probabilities: the first whose cumulative mass exceeds a
    uniform draw (`u`, (b, 1) in [0, 1); None: drawn here) times the row's total. Exact, and
    it draws b random numbers where `torch.multinomial` draws b × V (its exponential race), a
    cost that grows with the vocabulary at every decoding step.

    In two levels, so that only b × V / `block` block sums and one block per row are summed up
    in float64, not the whole (b, V): the block whose cumulative mass first exceeds the draw,
    then the index inside it against what is left of the draw. A zero-probability index is never
    returned: its cumulative mass equals the previous one's, which exceeded the draw first (what
    is left is kept below the block's own sum, whatever the rounding)."""
    b, V = probs.shape
    n = -(-V // block)
    p = probs.float() if V % block == 0 else torch.nn.functional.pad(probs.float(), (0, n * block - V))
    p = p.view(b, n, block)
    cdf = p.sum(-1, dtype=torch.float64).cumsum(-1)  # (b, n) mass up to each block's end
    if u is None:
        u = torch.rand(b, 1, dtype=torch.float64, device=probs.device)
    target = u.double() * cdf[:, -1:]
    k = torch.searchsorted(cdf, target, right=True).clamp_(max=n - 1)  # (b, 1) the block
    inner = p.gather(1, k[:, :, None].expand(b, 1, block))[:, 0].double().cumsum(-1)  # (b, block)
    left = target - torch.where(k > 0, cdf.gather(1, (k - 1).clamp(min=0)), 0.0)
    left = torch.minimum(left.clamp(min=0.0), inner[:, -1:] * (1 - 1e-12))
    j = torch.searchsorted(inner, left, right=True).clamp_(max=block - 1)
    return (k * block + j).squeeze(-1)


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_texts(tokenizer) -> list[str]:
    """Each vocabulary token's text on its own (cached per tokenizer)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        _TOKEN_TEXTS[tokenizer] = texts
    return texts


class StopText:
    """Ends a row once the text it sampled in this call contains one of `markers` (a tool's
    `call_end`), for the rows where `enabled`; `lengths[row]` is then its number of tokens.

    `token_texts`: each token id's text (`token_texts(tokenizer)`); a marker may span several
    tokens. Markers are matched in the text of single tokens joined, so a marker must not
    lie inside a multi-byte character.
    """

    def __init__(self, token_texts: Sequence[str], markers: Sequence[str], enabled: Sequence[bool]) -> None:
        self.texts, self.markers, self.enabled = token_texts, list(markers), list(enabled)
        self.keep = max(len(m) for m in self.markers) - 1  # tail that may start a marker
        self.tails = [""] * len(self.enabled)
        self.lengths: dict[int, int] = {}

    def __call__(self, rows: Tensor, new: Tensor, t: int, done: Tensor) -> Tensor:
        """(b,) whether row k of the batch (output row ``rows[k]``) ends at token t."""
        hit = torch.zeros_like(done)
        for k, (row, token, finished) in enumerate(zip(rows.tolist(), new.tolist(), done.tolist())):
            if finished or not self.enabled[row]:
                continue
            # (a model's embedding may be padded past the vocabulary: such ids have no text)
            text = self.tails[row] + (self.texts[token] if token < len(self.texts) else "")
            if any(m in text for m in self.markers):
                hit[k] = True
                self.lengths[row] = t + 1
            self.tails[row] = text[-self.keep :] if self.keep else ""
        return hit


def is_lock_step(model: torch.nn.Module) -> bool:
    """A sharded (FSDP) model under several ranks: each forward gathers weights from all of
    them, so every rank must make the same forwards."""
    return (
        getattr(model, "_is_fsdp_managed_module", False)
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


@contextlib.contextmanager
def gathered_weights(model: torch.nn.Module, enabled: bool = True) -> Iterator[bool]:
    """FSDP2: all-gathers a sharded model's weights once, for many forwards (a rollout),
    instead of once per decoder layer per forward (every decoding step), then frees them.

    Memory: one full copy of the weights per device, in FSDP's parameter dtype, while the
    block runs. Yields whether the forwards inside still need every rank in lock step: False
    once gathered (they make no collective), True for a sharded model left sharded
    (`enabled=False`), False for a model that is not sharded. Collective: every rank enters.
    """
    if getattr(model, "_weights_gathered", False):  # nested: the outer block owns them
        yield False
        return
    if not enabled or not getattr(model, "_is_fsdp_managed_module", False):
        yield is_lock_step(model)
        return
    from torch.distributed.fsdp import FSDPModule  # (FSDP2, torch >= 2.6, as `shard`)

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # Every unit (the root too: `distributed.shard` passes it reshard_after_forward, so
    # FSDP2's keep-the-root heuristic is off) keeps its weights after each forward, then
    # returns to what `distributed.shard` set (a bool; anything else: FSDP2's default).
    after = getattr(model, "reshard_after_forward", True)
    after = after if isinstance(after, bool) else True
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    model._weights_gathered = True
    try:
        for m in units:
            m.unshard()
        yield False
    except BaseException:
        # A forward aborted mid-way leaves FSDP's per-iteration state behind (units in
        # FORWARD, the root's iteration marker): cleared, so the next training step runs.
        if isinstance(model, FSDPModule) and hasattr(model, "reset_iter_state"):
            model.reset_iter_state()
        raise
    finally:
        model._weights_gathered = False
        for m in units:  # the setting first: a unit still in FORWARD only reshards with it
            m.set_reshard_after_forward(after, recurse=False)
            m.reshard()


def calls_in_lock_step(model: torch.nn.Module, calls: int) -> int:
    """How many `sample_responses` calls this rank must make: the most any rank makes."""
    if not is_lock_step(model):
        return calls
    most = torch.tensor(calls, device=next(model.parameters()).device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def shares_prompt_cache(model: PreTrainedModel, device: torch.device) -> bool:
    """Whether decoding can read each distinct prompt's cache once for all its rows
    (`attention.SharedPrefix`): where its attention is this project's on the CPU
    (`attention.grouped_decode_attention`), which reads the shared part."""
    config = getattr(model, "config", None)  # (a test's scripted stand-in has none)
    return device.type == "cpu" and getattr(config, "_attn_implementation", None) == SDPA


def _prefill(
    model: PreTrainedModel, *, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, share: bool, **kwargs
) -> CausalLMOutputWithPast:
    """The model's forward over the prompts (B, P), each distinct row once: its cache (in
    `kwargs`) is then shared by (`share`) or copied to every row that repeats it, and its
    logits copied."""
    distinct, repeat = torch.unique(torch.cat([input_ids, attention_mask], -1), dim=0, return_inverse=True)
    if len(distinct) == len(input_ids):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    B = len(input_ids)
    first = repeat.new_empty(len(distinct)).scatter_(
        0, repeat, torch.arange(B, device=repeat.device)
    )  # one row of each
    out = model(
        input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=position_ids[first], **kwargs
    )
    for cache in kwargs.values():
        if isinstance(cache, Cache) and share:
            for layer in cache.layers:
                layer.share_prefix(repeat)
        elif isinstance(cache, Cache):
            cache.batch_select_indices(repeat)
    out.logits = out.logits[repeat]
    return out


def _every_rank_done(done_here: bool, synced: bool, device: torch.device) -> bool:
    """Whether decoding may stop; a synced (sharded) rank keeps decoding, feeding pads,
    until every rank is done."""
    if not synced:
        return done_here
    left = torch.tensor(float(not done_here), device=device)
    dist.all_reduce(left)
    return left.item() == 0


@torch.no_grad()
@without_cudnn_attention()
@decoding()  # attention in the cache's dtype (`attention.py`)
@weights_cast_once()  # under autocast, one cast of each weight per call, not per token
@eager()  # never compiled (`eager`)
def sample_responses(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_new_tokens: int = 0,
    compact_fraction: float = 0.25,
    lock_step: bool | None = None,
    stop_text: StopText | None = None,
    logprobs: bool = False,
) -> Tensor | Sampled:
    """Samples one response per left-padded prompt row: (B, T) token ids, T <= max_new_tokens,
    each row ending at its first stop token and padded after it with `pad_token_id`. With
    `logprobs`, a `Sampled`: the tokens, their log-probs and the entropy at each position.

    Finished rows keep being fed (and ignored) until they make up `compact_fraction` of the
    batch, then leave it: few cache copies, little wasted compute. A sharded (FSDP) model
    gathers weights in every forward, so its ranks all decode until every rank is done
    (`lock_step`; None: whenever the model is sharded; `gathered_weights` says when not).
    `stop_text` also ends rows at a text (a tool call's end; it records where).
    """
    device, B = input_ids.device, input_ids.shape[0]
    synced = is_lock_step(model) if lock_step is None else lock_step
    stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    out = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(out.shape, device=device) if logprobs else None
    out_entropy = torch.zeros(out.shape, device=device) if logprobs else None
    cache, cache_arg = growing_cache(input_ids.shape[1] + max_new_tokens), cache_argument(model)
    rows = torch.arange(B, device=device)  # the output row of each batch row
    done = torch.zeros(B, dtype=torch.bool, device=device)
    mask, tokens, steps = attention_mask.long(), input_ids, 0
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    share = shares_prompt_cache(model, device)
    with contextlib.ExitStack() as shared:  # reading the prompts' shared cache after the prefill
        for t in range(max_new_tokens):
            step = model if t else partial(_prefill, model, share=share)  # each distinct prompt read once
            logits = step(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=position,
                use_cache=True,
                **{cache_arg: cache},
                logits_to_keep=1,
            ).logits[:, -1]
            allowed = logits.index_fill(-1, stop, float("-inf")) if t < min_new_tokens else logits
            new = next_tokens(allowed, temperature, top_p, top_k)
            new = torch.where(done, torch.full_like(new, pad_token_id), new)  # pad after a stop
            out[rows, t] = new
            if out_logprobs is not None:
                # under softmax(logits / T) before top-k / top-p / min_new_tokens narrow the draw,
                # as the trainer's log-probs are taken (greedy, T 0: the plain softmax)
                lp = logprobs_from_logits(logits[:, None], new[:, None], temperature or 1.0)[:, 0]
                out_logprobs[rows, t] = torch.where(done, 0.0, lp)
                out_entropy[rows, t] = torch.where(done, 0.0, entropy_from_logits(logits, temperature or 1.0))
            steps = t + 1
            hit = torch.isin(new, stop)
            if stop_text is not None:
                hit = hit | stop_text(rows, new, t, done)
            done = done | hit
            all_done = bool(done.all())
            if _every_rank_done(all_done, synced, device) or steps == max_new_tokens:
                break
            if len(done) > 1 and done.float().mean() >= compact_fraction:
                # finished rows leave the batch; a synced rank with none left keeps one to feed
                keep = rows.new_zeros(1) if all_done else (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, done, mask, position, new = (x[keep] for x in (rows, done, mask, position, new))
            tokens = new[:, None]
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], -1)
            position = position[:, -1:] + 1
            if t == 0 and any(layer.prefix is not None for layer in cache.layers):
                shared.enter_context(reading_shared_prefixes([layer.prefix for layer in cache.layers]))
    if out_logprobs is not None:
        return Sampled(out[:, :steps], out_logprobs[:, :steps], out_entropy[:, :steps])
    return out[:, :steps]
