"""Rollouts: the experience buffer the updates read, and how engines assemble it.

A `Rollout` holds one rollout step's experience: n responses per prompt (group sampling,
VAPO §4.3: `left_padded` repeats each prompt n times), prompts left-padded and responses
right-padded in one (B, P + T) tensor so a single forward gives the log-probs and values of
every response token. The engines (`vapo_lightning.engines`) sample it and the reward phase
scores it; what the later phases compute (pi_old, V_old, advantages, returns) they return,
and nothing writes it onto the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from vapo_lightning import core, head_logprobs, packing
from vapo_lightning.config import Generation
from vapo_lightning.rewards.base import Sample
from vapo_lightning.tools.base import Tool
from vapo_lightning.tools.turns import SampleFn, Turns, run_turns

__all__ = [
    "Rollout",
    "assemble",
    "assemble_turns",
    "cat_rollouts",
    "critic_values",
    "left_padded",
    "policy_logits",
    "sample_turns",
    "token_logprobs",
    "with_round_counts",
]


@dataclass
class Rollout:
    """One rollout step's experience. B = prompts × n responses; tensors are (B, ...)."""

    input_ids: Tensor  # (B, P + T) left-padded prompt, right-padded response
    attention_mask: Tensor  # (B, P + T)
    response_mask: Tensor  # (B, T) bool, true on the model's tokens up to and incl. EOS
    # (false on padding and on tool observations, which are context: `tools.turns`)
    group_ids: Tensor  # (B,) the prompt each response answers
    truncated: Tensor  # (B,) bool, hit max_new_tokens without EOS
    samples: list[Sample] = field(default_factory=list)
    # The rewards, filled in by the trainer's reward phase:
    scores: Tensor | None = None  # (B,) sequence reward R
    correct: Tensor | None = None  # (B,) bool, verifier says correct
    # What the engine reports of its sampling, when asked (`RolloutEngine.logprobs`):
    rollout_logprobs: Tensor | None = None  # (B, T) log pi_engine(a_t | s_t)
    entropy: Tensor | None = None  # (B, T) the sampler's entropy at each response position
    tool_calls: Tensor | None = None  # (B,) tool calls of each response, with model.tools
    observation_tokens: Tensor | None = None  # (B,) tokens of their observations
    tool_errors: list[tuple[str, str, str]] = field(default_factory=list)  # (tool, kind, message)
    tool_seconds: float = 0.0  # time spent in tools while sampling
    reward_errors: int = 0  # samples a reward callback failed on (counted, never silent)
    sampled: int = 0  # responses the engine drew for this step, DAPO's dropped rounds included
    reward_metrics: dict[str, float] = field(default_factory=dict)  # callbacks' own counts
    reward_parts: Tensor | None = None  # (B, K) each reward callback's own score
    reward_names: list[str] = field(default_factory=list)  # (K,) their names

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def require(self, name: str) -> Tensor:
        """The tensor field `name` that a later phase fills in (`scores`, `correct`: the reward
        phase; `rollout_logprobs`: an engine asked for them), or an error naming it."""
        value = getattr(self, name)
        if not isinstance(value, Tensor):
            raise ValueError(f"the rollout has no {name} (filled in by the phase that computes it)")
        return value

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def responses(self) -> Tensor:  # (B, T)
        return self.input_ids[:, self.prompt_length :]

    @property
    def response_lengths(self) -> Tensor:  # (B,) the model's own tokens
        return self.response_mask.sum(-1)

    @property
    def response_extent(self) -> Tensor:  # (B,) tokens incl. observations: where padding starts
        return self.attention_mask[:, self.prompt_length :].sum(-1)

    @property
    def position_ids(self) -> Tensor:  # (B, P + T), counting from the first real token
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    def select(self, index: Tensor | list[int]) -> Rollout:
        """The responses at `index` (tensors and samples), e.g. one mini-batch."""
        index = torch.as_tensor(index, dtype=torch.long)
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                out[f.name] = value[index.to(value.device)]
            elif f.name == "samples" and value:
                out[f.name] = [value[i] for i in index.tolist()]
        return replace(self, **out)

    def trimmed(self) -> Rollout:
        """Drops columns that are padding in every row (leading prompt pads, trailing
        response pads), so micro-batch forwards do no wasted work."""
        P = self.prompt_length
        first = int((self.attention_mask[:, :P].sum(0) > 0).long().argmax()) if P else 0
        T = int(self.response_extent.max())
        out = {  # contiguous: a compiled forward (torch_compile) guards on the strides
            "input_ids": self.input_ids[:, first : P + T].contiguous(),
            "attention_mask": self.attention_mask[:, first : P + T].contiguous(),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.ndim == 2 and f.name not in out:
                out[f.name] = value[:, :T]
        return replace(self, **out)


def sample_turns(
    sample: SampleFn,
    prompt_ids: list[list[int]],
    cfg: Generation,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[Tool],
    n: int,
    device: torch.device | str,
) -> Rollout:
    """n responses per prompt from an engine's `sample` (`tools.turns.SampleFn`), calling
    `tools` as ``cfg`` allows, as one rollout."""
    turns = run_turns(
        sample,
        [p for p in prompt_ids for _ in range(n)],
        tools,
        tokenizer,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=sorted({tokenizer.eos_token_id, *cfg.stop_token_ids}),
        max_turns=cfg.max_turns,
        max_observation_tokens=cfg.max_observation_tokens,
    )
    return assemble_turns(prompt_ids, turns, tokenizer.pad_token_id, n, device)


def left_padded(
    prompt_ids: list[list[int]], n: int, pad_token_id: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """(B, P) token ids and attention mask of the prompts, left-padded, each repeated n times
    (B = prompts × n, the n samples of a prompt on consecutive rows)."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left padding
        ids[i, P - len(p) :] = torch.tensor(p)
        attn[i, P - len(p) :] = 1
    return ids.repeat_interleave(n, 0).to(device), attn.repeat_interleave(n, 0).to(device)


def assemble(ids: Tensor, attn: Tensor, response: Tensor, stop: list[int], pad_token_id: int, n: int) -> Rollout:
    """The rollout of (B, P) left-padded prompts and (B, T) sampled tokens: each response ends
    at its first stop token (kept, masked in), padding after it; no stop token: truncated."""
    device = response.device
    is_eos = torch.isin(response, torch.tensor(stop, device=device))
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.float().argmax(-1), response.shape[1])
    positions = torch.arange(response.shape[1], device=device)[None]
    response_mask = positions <= first_eos[:, None]
    response = torch.where(response_mask, response, torch.full_like(response, pad_token_id))
    groups = torch.arange(len(ids) // n, device=device).repeat_interleave(n)
    return Rollout(
        input_ids=torch.cat([ids, response], 1),
        attention_mask=torch.cat([attn, response_mask.long()], 1),
        response_mask=response_mask,
        group_ids=groups,
        truncated=~has_eos,
    )


def assemble_turns(
    prompt_ids: list[list[int]], turns: Turns, pad_token_id: int, n: int, device: torch.device | str
) -> Rollout:
    """The rollout of a multi-turn sampling: responses right-padded, `response_mask` true on
    the model's tokens only, every token of a response (observations too) attended."""
    ids, attn = left_padded(prompt_ids, n, pad_token_id, device)
    B, T = len(turns.responses), max(1, max(len(r) for r in turns.responses))
    response = torch.full((B, T), pad_token_id, dtype=torch.long)
    actions = torch.zeros((B, T), dtype=torch.bool)
    attended = torch.zeros((B, T), dtype=torch.long)
    logprobs = torch.zeros((B, T))
    for i, (tokens, acts) in enumerate(zip(turns.responses, turns.actions)):
        response[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        actions[i, : len(acts)] = torch.tensor(acts, dtype=torch.bool)
        attended[i, : len(tokens)] = 1
        if turns.logprobs is not None:
            logprobs[i, : len(tokens)] = torch.tensor(turns.logprobs[i])
    return Rollout(
        input_ids=torch.cat([ids, response.to(device)], 1),
        attention_mask=torch.cat([attn, attended.to(device)], 1),
        response_mask=actions.to(device),
        group_ids=torch.arange(len(prompt_ids), device=device).repeat_interleave(n),
        truncated=~torch.tensor(turns.finished, device=device),
        rollout_logprobs=logprobs.to(device) if turns.logprobs is not None else None,
        tool_calls=torch.tensor(turns.calls, device=device),
        observation_tokens=torch.tensor(turns.observation_tokens, device=device),
        tool_errors=turns.errors,
        tool_seconds=turns.tool_seconds,
    )


def policy_logits(policy: PreTrainedModel, r: Rollout, layout: packing.Layout = packing.ROWS) -> Tensor:
    """Logits over each response token, (B, T, V), in the model's dtype, not yet divided by
    the sampling temperature (`core.logprobs_from_logits` does that in fp32).

    Only positions P-1 .. P+T-2 (each predicts the next token, a response token) go through
    the LM head, and the result is contiguous: slicing a (B, T+1, V) output would make the
    log-prob functions reshape it into a second full copy. With `layout.pack` > 1, the
    responses to one prompt share a single forward of it, and the rows may lie end to end
    (`packing`).
    """
    L, T = r.input_ids.shape[1], r.response_mask.shape[1]
    packed = _packed(policy, r, layout)
    if packed is not None:
        return packed.rows(_pack_logits(policy, packed))
    out = policy(
        input_ids=r.input_ids,
        attention_mask=r.attention_mask,
        position_ids=r.position_ids,
        logits_to_keep=torch.arange(L - T - 1, L - 1, device=r.input_ids.device),
        use_cache=False,
    )
    return out.logits


def token_logprobs(
    policy: PreTrainedModel,
    r: Rollout,
    temperature: float,
    entropy: bool = True,
    entropy_grad: bool = False,
    layout: packing.Layout = packing.ROWS,
) -> tuple[Tensor, Tensor | None]:
    """log pi(a_t | s_t) of each response token and (with `entropy`) the entropy of pi at its
    position, (B, T) each, in fp32, under the sampling `temperature` (`core.
    logprobs_from_logits`, `core.entropy_from_logits`). `entropy_grad`: the entropy keeps
    its graph (an entropy bonus); otherwise only its value.

    Where the policy's LM head allows it (`head_logprobs.plain_head`), they are taken from the
    head's input inside the forward and the logits exist a chunk of positions at a time, never
    (B, T, V) (`_hidden_logprobs`); otherwise from the logits.

    With shared-prompt forwards they are computed on the packs' kept columns (R, K), where each
    position predicts the next token of its pack, and only then laid out per row: never a
    (B, T, V) copy of the logits, whose rows past each response's end (most of T when
    lengths vary) would go through the log-softmax too. A prompt's last position predicts
    every response's first token: those c log-probs are taken one by one.
    """
    head = head_logprobs.plain_head(policy)
    if head is not None:
        return _hidden_logprobs(policy, head, r, temperature, entropy, entropy_grad, layout)
    packed = _packed(policy, r, layout)
    if packed is None:
        logits = policy_logits(policy, r)  # (B, T, V)
        logprobs, per_row = core.logprobs_from_logits(logits, r.responses, temperature), None
    else:
        logits = _pack_logits(policy, packed)  # (R, K, V): each kept column predicts the next
        logprobs = packed.rows(core.logprobs_from_logits(logits, packed.next_tokens, temperature))
        first = core.logprobs_from_logits(
            logits.flatten(0, 1)[packed.first].repeat_interleave(len(r) // len(packed.first), 0),
            r.responses[:, 0],
            temperature,
        )  # (B,): each response's first token, from its prompt's last position
        logprobs, per_row = torch.cat([first[:, None], logprobs[:, 1:]], 1), packed.rows
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        h = core.entropy_from_logits(logits, temperature)
    return logprobs, h if per_row is None else per_row(h)


def _hidden_logprobs(
    policy: PreTrainedModel,
    head: torch.nn.Linear,
    r: Rollout,
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
    layout: packing.Layout,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` with the policy's LM head replaced by a `head_logprobs.StatsHead` for
    its forward: the same positions and the same tokens as through the logits, each position's
    log-prob and entropy returned by the forward in place of its logits."""

    def stats(labels: Tensor, index: Tensor | None = None) -> head_logprobs.StatsHead:
        return head_logprobs.StatsHead(head, labels, temperature, entropy, entropy_grad, index)

    packed = _packed(policy, r, layout)
    if packed is None:
        L, T = r.input_ids.shape[1], r.response_mask.shape[1]
        with head_logprobs.replaced_head(policy, head, stats(r.responses.reshape(-1))):
            out = policy(
                input_ids=r.input_ids,
                attention_mask=r.attention_mask,
                position_ids=r.position_ids,
                logits_to_keep=torch.arange(L - T - 1, L - 1, device=r.input_ids.device),
                use_cache=False,
            ).logits  # (B, T, k)
        return out[..., 0], _entropy(out[..., 1:], entropy, entropy_grad)
    # The kept columns (R, K) predict their pack's next tokens; each prompt's last column
    # (`packed.first`) also predicts the first token of each of its c responses.
    R, K = packed.next_tokens.shape
    c = len(r) // len(packed.first)
    index = torch.cat([torch.arange(R * K, device=r.input_ids.device), packed.first.repeat_interleave(c)])
    labels = torch.cat([packed.next_tokens.reshape(-1), r.responses[:, 0]])
    with head_logprobs.replaced_head(policy, head, stats(labels, index)):
        out = policy(**packed.forward_kwargs, logits_to_keep=packed.keep, use_cache=False).logits  # (R·K + B, k)
    kept = out[: R * K].view(R, K, -1)
    logprobs = torch.cat([out[R * K :, :1], packed.rows(kept[..., 0])[:, 1:]], 1)
    return logprobs, _entropy(packed.rows(kept[..., 1:]), entropy, entropy_grad)


def _entropy(column: Tensor, entropy: bool, entropy_grad: bool) -> Tensor | None:
    """The entropy column (..., 1) of a `StatsHead`'s output as (...), with its graph only
    with `entropy_grad`; None without `entropy` (no such column)."""
    if not entropy:
        return None
    return column[..., 0] if entropy_grad else column[..., 0].detach()


def critic_values(critic: PreTrainedModel, r: Rollout, layout: packing.Layout = packing.ROWS) -> Tensor:
    """V(s_t) for each response token: the critic's output one position before it, (B, T),
    the rows going through the critic as `layout` says."""
    T = r.response_mask.shape[1]
    packed = _packed(critic, r, layout)
    if packed is not None:
        out = critic(**packed.forward_kwargs)
        return packed.rows(out.logits[:, packed.keep, 0]).float()
    out = critic(input_ids=r.input_ids, attention_mask=r.attention_mask, position_ids=r.position_ids)
    return out.logits[:, -T - 1 : -1, 0].float()


def _pack_logits(policy: PreTrainedModel, packed: packing.Pack) -> Tensor:
    """The logits at the pack's kept columns, (R, K, V), each predicting the next token."""
    return policy(**packed.forward_kwargs, logits_to_keep=packed.keep, use_cache=False).logits


def _packed(model: PreTrainedModel, r: Rollout, layout: packing.Layout) -> packing.Pack | None:
    """`r` in packs for `model`'s forward, or None (each row its own, padded): packs of
    `layout.pack` responses to one prompt, or, where the model reads spans, of one (no
    padding, and the prompts' common start once) unless `layout.shared_start` is off."""
    if not packing.takes_masks(model):
        return None
    end_to_end, c = packing.reads_spans(model, r.input_ids.device), layout.pack
    if c < 2 and not (end_to_end and layout.shared_start):
        return None
    if not end_to_end and not _dense_packs_pay(model, r, c):
        return None
    return packing.pack(r.input_ids, r.attention_mask, r.response_mask.shape[1], c, end_to_end, layout.shared_start)


def _dense_packs_pay(model: PreTrainedModel, r: Rollout, c: int) -> bool:
    """Whether dense-mask packs of `c` answers cost `model` less work than rows, at this
    micro-batch's prompt and answer widths, which the dense mask computes over whatever the
    real lengths (`packing.dense_packing_saves_work`; shapes only: no device sync)."""
    cfg = model.config
    layers, hidden = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None)
    if layers is None or hidden is None:
        return True
    if "_vapo_parameters" not in model.__dict__:  # (counted once per model)
        model.__dict__["_vapo_parameters"] = sum(p.numel() for p in model.parameters())
    params = model.__dict__["_vapo_parameters"]
    return packing.dense_packing_saves_work(r.prompt_length, r.response_mask.shape[1], c, params, layers, hidden)


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenates rollouts of different prompt / response lengths (dynamic sampling)."""
    P = max(r.prompt_length for r in parts)
    T = max(r.response_mask.shape[1] for r in parts)

    def pad(x: Tensor, left: int, right: int) -> Tensor:  # masked positions: any valid id
        return torch.nn.functional.pad(x, (left, right))

    out: dict[str, Any] = {"samples": [s for r in parts for s in r.samples]}
    ids, attn, offset, groups = [], [], 0, []
    for r in parts:
        dp, dt = P - r.prompt_length, T - r.response_mask.shape[1]
        prompt, response = r.input_ids[:, : r.prompt_length], r.responses
        ids.append(torch.cat([pad(prompt, dp, 0), pad(response, 0, dt)], 1))
        a = r.attention_mask
        attn.append(torch.cat([pad(a[:, : r.prompt_length], dp, 0), pad(a[:, r.prompt_length :], 0, dt)], 1))
        groups.append(r.group_ids + offset)
        offset += int(r.group_ids.max()) + 1 if len(r) else 0
    out.update(input_ids=torch.cat(ids), attention_mask=torch.cat(attn), group_ids=torch.cat(groups))
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in parts]
        if f.name in out or not all(isinstance(v, Tensor) for v in values):
            continue
        out[f.name] = torch.cat([pad(v, 0, T - v.shape[1]) if v.ndim == 2 else v for v in values])
    return Rollout(**out)


def with_round_counts(r: Rollout, rounds: list[Rollout]) -> Rollout:
    """`r` (the responses kept from DAPO's dynamic-sampling `rounds`) with the counts of every
    round: responses sampled, reward and tool errors, and the reward callbacks' metrics
    summed, a zero kept (each rank logs each key)."""
    metrics: dict[str, float] = {}
    for x in rounds:
        for key, value in x.reward_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    r.tool_errors = [e for x in rounds for e in x.tool_errors]
    r.reward_errors, r.reward_metrics = sum(x.reward_errors for x in rounds), metrics
    r.reward_names = rounds[0].reward_names  # (cat_rollouts keeps tensors only)
    r.sampled = sum(len(x) for x in rounds)
    return r
