"""Multi-turn rollouts: responses that call tools mid-way, on any engine.

`run_turns` drives an engine's sampler round by round. Each round samples every open
response until it stops (a stop token, its token budget, or a tool's `call_end`); the calls
of the responses that paused run, one batch per tool (concurrently inside the tool), their
outputs are appended as observations, and the paused responses go on in the next round.

The token layout of one response (`Turns.actions` is the mask the losses read):

    prompt | model tokens ... </code> | <output>...</output> | model tokens ... EOS
             actions: true              false (context)        true

Observation tokens are context, never actions: the policy is not trained on them, they do
not count as steps of GAE, the critic is not fitted on them (`core.gae` carries its recursion
across masked positions), and the length-adaptive λ counts the model's own tokens. Every
token of a response, observations included, counts against ``max_new_tokens``.

A response pauses at most `max_turns` times; after that a `call_end` is ordinary text. A
call the model never closes is ordinary text too. A tool that raises gives every call of that
round an observation naming the error, and the error is counted (`Turns.errors`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from vapo_lightning.tools.base import Tool, ToolOutput

__all__ = ["Segment", "Turns", "observation_ids", "run_turns"]

TRUNCATED_NOTE = "\n... (output truncated)"


@dataclass
class Segment:
    """Tokens an engine sampled for one response in one round (and their log-probs under the
    engine, when it reports them)."""

    ids: list[int]
    logprobs: list[float] | None = None


SampleFn = Callable[[list[list[int]], list[int], list[bool], list[int]], list[Segment]]
"""``sample(contexts, budgets, pause, rows)``: one `Segment` per context (prompt + response
so far of response ``rows[i]``), at most ``budgets[i]`` tokens, ending at a stop token, at
the budget, or, where ``pause[i]``, at the token that completes any tool's `call_end`."""


@dataclass
class Turns:
    """The responses of a multi-turn rollout, one entry per response."""

    responses: list[list[int]]
    actions: list[list[bool]]
    """True on the model's own tokens, false on observations."""
    finished: list[bool]
    """Ended with a stop token (else truncated at the budget)."""
    calls: list[int]
    observation_tokens: list[int]
    logprobs: list[list[float]] | None = None
    """The engine's log-probs of the model tokens (0 on observations), if it reports them."""
    errors: list[tuple[str, str, str]] = field(default_factory=list)
    """(tool, kind, message) of each failed call."""
    tool_seconds: float = 0.0


def observation_ids(tool: Tool, text: str, tokenizer: PreTrainedTokenizerBase, budget: int) -> list[int]:
    """The tokens of ``tool.observation(text)``, at most `budget`: an output too long is cut
    (at a token boundary of its own tokenization) and says so."""

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    ids = encode(tool.observation(text))
    if len(ids) <= budget:
        return ids
    room = budget - len(encode(tool.observation(TRUNCATED_NOTE)))
    body = tokenizer.decode(encode(text)[: max(0, room)])
    return encode(tool.observation(body + TRUNCATED_NOTE))[:budget]


def _paused_at(text: str, tools: Sequence[Tool]) -> Tool | None:
    """The tool whose `call_end` ends nearest the end of `text` (None: no call_end)."""
    best, best_end = None, -1
    for tool in tools:
        at = text.rfind(tool.call_end)
        if at >= 0 and at + len(tool.call_end) > best_end:
            best, best_end = tool, at + len(tool.call_end)
    return best


def _run_tool(tool: Tool, calls: list[str]) -> list[ToolOutput]:
    """`tool.run`, with a raise turned into one error observation per call."""
    try:
        outputs = tool.run(calls)
        if len(outputs) != len(calls):
            raise RuntimeError(f"returned {len(outputs)} outputs for {len(calls)} calls")
        return outputs
    except Exception as err:  # a tool's failure must not end the step
        kind = type(err).__name__
        return [ToolOutput(f"Tool error: {kind}: {err}", error=f"{kind}: {err}") for _ in calls]


def run_turns(
    sample: SampleFn,
    prompts: list[list[int]],
    tools: Sequence[Tool],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    max_turns: int = 4,
    max_observation_tokens: int = 256,
) -> Turns:
    """Samples one response per prompt (repeat a prompt for several), calling `tools`."""
    B, stop = len(prompts), set(stop_token_ids)
    out = Turns(
        responses=[[] for _ in range(B)],
        actions=[[] for _ in range(B)],
        finished=[False] * B,
        calls=[0] * B,
        observation_tokens=[0] * B,
        logprobs=[[] for _ in range(B)],
    )
    segment_start = [0] * B  # where each response's model text since its last observation starts
    engine_logprobs = True
    active = list(range(B))
    while active:
        budgets = [max_new_tokens - len(out.responses[i]) for i in active]
        pause = [out.calls[i] < max_turns for i in active]
        segments = sample([prompts[i] + out.responses[i] for i in active], budgets, pause, active)
        pending: dict[int, list[tuple[int, str]]] = {}  # tool index -> (response, call)
        for i, seg, budget, paused in zip(active, segments, budgets, pause):
            ids = seg.ids[:budget]
            engine_logprobs &= seg.logprobs is not None
            out.responses[i] += ids
            out.actions[i] += [True] * len(ids)
            out.logprobs[i] += (seg.logprobs or [0.0] * len(ids))[: len(ids)]
            if ids and ids[-1] in stop:
                out.finished[i] = True
            elif len(out.responses[i]) < max_new_tokens and paused and ids:
                text = tokenizer.decode(out.responses[i][segment_start[i] :])
                tool = _paused_at(text, tools)
                call = tool.parse(text) if tool is not None else None
                if call is None:  # a call_end nobody opened: ordinary text, sampling goes on
                    pending.setdefault(-1, []).append((i, ""))
                else:
                    pending.setdefault(tools.index(tool), []).append((i, call))
        active = [i for i, _ in pending.pop(-1, [])]
        started = time.perf_counter()
        active += _observe(out, pending, tools, tokenizer, max_new_tokens, max_observation_tokens, segment_start)
        out.tool_seconds += time.perf_counter() - started
        active.sort()
    if not engine_logprobs:
        out.logprobs = None
    return out


def _observe(
    out: Turns,
    pending: dict[int, list[tuple[int, str]]],
    tools: Sequence[Tool],
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    max_observation_tokens: int,
    segment_start: list[int],
) -> list[int]:
    """Runs each tool's pending calls (tool index -> (response, call)) and appends their
    observations to the responses (context, not actions); returns the responses that have
    room to go on."""
    going_on = []
    for t, calls in pending.items():
        tool = tools[t]
        for (i, _), result in zip(calls, _run_tool(tool, [c for _, c in calls])):
            if result.error is not None:
                out.errors.append((tool.name, result.error.split(":")[0], result.error))
            room = max_new_tokens - len(out.responses[i])
            ids = observation_ids(tool, result.text, tokenizer, min(room, max_observation_tokens))
            out.responses[i] += ids
            out.actions[i] += [False] * len(ids)
            out.logprobs[i] += [0.0] * len(ids)
            out.calls[i] += 1
            out.observation_tokens[i] += len(ids)
            segment_start[i] = len(out.responses[i])
            if len(out.responses[i]) < max_new_tokens:
                going_on.append(i)
    return going_on
