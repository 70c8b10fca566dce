"""Tools in the rollout: the multi-turn loop's token layout, budgets and failures
(`tools.turns`), the native sampler's pause at a call (`generation.StopText`), and the
rollout it assembles."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tests.tool_helpers import Broken, Upper
from vapo_lightning.config import Generation
from vapo_lightning.engines.native import generate
from vapo_lightning.engines.sampler import StopText, token_texts
from vapo_lightning.tools import Segment, ToolOutput, observation_ids, run_turns
from vapo_lightning.tools.base import from_spec, spec


@pytest.fixture(scope="module")
def tokenizer(tok):
    return PreTrainedTokenizerFast.from_pretrained(tok)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """An engine whose responses follow a script: row i emits the tokens of ``scripts[i]``
    in order, stopping as a real engine would (stop token, budget, or, when paused, the
    token that completes a `call_end`). Records every call."""

    def __init__(self, tokenizer, scripts: list[str], markers: list[str]):
        self.tok, self.markers = tokenizer, markers
        self.scripts = [[*encode(tokenizer, s), tokenizer.eos_token_id] for s in scripts]
        self.pos = [0] * len(scripts)
        self.calls: list[tuple[list[int], list[int], list[bool]]] = []

    def __call__(self, contexts, budgets, pause, rows):
        self.calls.append((list(rows), list(budgets), list(pause)))
        out = []
        for row, budget, paused in zip(rows, budgets, pause):
            ids: list[int] = []
            while len(ids) < budget and self.pos[row] < len(self.scripts[row]):
                token = self.scripts[row][self.pos[row]]
                ids.append(token)
                self.pos[row] += 1
                if token == self.tok.eos_token_id:
                    break
                if paused and any(m in self.tok.decode(ids) for m in self.markers):
                    break
            out.append(Segment(ids))
        return out


def run(tokenizer, scripts, tools, **kw):
    engine = ScriptedEngine(tokenizer, scripts, [t.call_end for t in tools])
    prompts = [encode(tokenizer, "What is 1 + 2?")] * len(scripts)
    kw = {"max_new_tokens": 200, "max_turns": 4, "max_observation_tokens": 64, **kw}
    turns = run_turns(engine, prompts, tools, tokenizer, stop_token_ids=[tokenizer.eos_token_id], **kw)
    return turns, engine


def test_token_layout_prompt_model_observation_model(tokenizer):
    """A response that calls once: its model tokens up to the call's end, the observation
    (context: actions false), then the model's tokens to EOS; responses that never call,
    or leave a block unclosed, are ordinary text. The calls of one round come together."""
    tool = Upper()
    scripts = [
        "Let me <code>abc</code> so 3",
        "3 + 4",
        "Let me <code>print(1) and 2",
        "a <code>x</code> b <code>y</code> c",
    ]
    turns, engine = run(tokenizer, scripts, [tool])
    eos = tokenizer.eos_token_id
    obs = encode(tokenizer, "<output>ABC</output>")
    first = turns.responses[0][: len(turns.responses[0]) - len(obs) - len(encode(tokenizer, " so 3")) - 1]
    assert tokenizer.decode(first).endswith("</code>")
    assert turns.responses[0] == first + obs + encode(tokenizer, " so 3") + [eos]
    assert turns.actions[0] == [True] * len(first) + [False] * len(obs) + [True] * (
        len(turns.responses[0]) - len(first) - len(obs)
    )
    for i in (1, 2):  # no call: every token is the model's, the script to its end
        assert turns.responses[i] == [*encode(tokenizer, scripts[i]), eos]
        assert all(turns.actions[i]) and turns.calls[i] == 0
    assert turns.calls == [1, 0, 0, 2]
    assert turns.observation_tokens[0] == len(obs)
    assert turns.finished == [True] * 4
    assert tool.seen[0] == ["abc", "x"]  # round 1: both paused responses, one batch
    assert tool.seen[1] == ["y"]
    assert engine.calls[1][0] == [0, 3]  # round 2 samples only the responses that paused
    assert turns.errors == [] and turns.logprobs is None


def test_max_turns_then_call_end_is_ordinary_text(tokenizer):
    """After `max_turns` calls a response is not paused again: its next call_end is text."""
    tool = Upper()
    turns, engine = run(tokenizer, ["<code>a</code> <code>b</code> <code>c</code> end"], [tool], max_turns=2)
    assert turns.calls == [2] and tool.seen == [["a"], ["b"]]
    assert engine.calls[-1][2] == [False]  # the last round ran unpaused
    text = tokenizer.decode(turns.responses[0])
    assert "<output>A</output>" in text and "<output>B</output>" in text
    assert "<output>C</output>" not in text and "<code>c</code> end" in text
    assert turns.finished == [True]


def test_observations_count_against_the_budget(tokenizer):
    """Every token of a response, observations included, counts against max_new_tokens; a
    response that runs out inside an observation is truncated, not finished."""

    class Long(Upper):
        def run(self, calls):
            return [ToolOutput("9" * 400) for _ in calls]

    script = "<code>a</code> then more words after the output"
    n_call = len(encode(tokenizer, "<code>a</code>"))
    turns, _ = run(tokenizer, [script], [Long()], max_new_tokens=n_call + 10, max_observation_tokens=64)
    assert len(turns.responses[0]) == n_call + 10 and turns.finished == [False]
    assert turns.actions[0].count(False) == 10
    turns, _ = run(tokenizer, [script], [Long()], max_new_tokens=200, max_observation_tokens=30)
    assert turns.observation_tokens == [30] and turns.finished == [True]
    obs = [t for t, a in zip(turns.responses[0], turns.actions[0]) if not a]
    text = tokenizer.decode(obs)
    assert text.startswith("<output>") and "(output truncated)" in text


def test_observation_ids_cut_and_say_so(tokenizer):
    tool = Upper()
    short = observation_ids(tool, "42", tokenizer, 64)
    assert short == encode(tokenizer, "<output>42</output>")
    long = observation_ids(tool, "1234567890 " * 50, tokenizer, 60)
    assert 56 <= len(long) <= 60  # the budget, used
    text = tokenizer.decode(long)
    assert text.startswith("<output>1234") and text.endswith("\n... (output truncated)</output>")


def test_a_tool_that_raises_is_counted_and_the_rollout_goes_on(tokenizer):
    turns, _ = run(tokenizer, ["<code>a</code> ok", "<code>b</code> ok", "bare"], [Broken()])
    assert turns.calls == [1, 1, 0] and turns.finished == [True] * 3
    assert [(t, k) for t, k, _ in turns.errors] == [("broken", "ValueError")] * 2
    text = tokenizer.decode(turns.responses[0])
    assert "<output>Tool error: ValueError: boom</output>" in text


def test_tool_spec_round_trip():
    tool = Upper(call_start="[[", call_end="]]")
    again = from_spec(spec(tool))
    assert type(again) is Upper and again.call_start == "[[" and again.call_end == "]]"
    with pytest.raises(TypeError, match="not a vapo_lightning Tool"):
        from_spec({"class_path": "collections.OrderedDict", "init_args": {}})


def test_stop_text_spans_tokens_and_respects_enabled_rows(tokenizer):
    """A marker split over several tokens still stops its row, at the token completing it."""
    ids = encode(tokenizer, "x </code> y")
    stop = StopText(token_texts(tokenizer), ["</code>"], [True, False])
    done = torch.zeros(2, dtype=torch.bool)
    hits = []
    for t, token in enumerate(ids):
        hit = stop(torch.arange(2), torch.tensor([token, token]), t, done)
        hits.append(hit.tolist())
        done |= hit
    beyond = len(token_texts(tokenizer)) + 5  # an id of a padded embedding: no text, no stop
    fresh = StopText(token_texts(tokenizer), ["</code>"], [True])
    assert not fresh(torch.arange(1), torch.tensor([beyond]), 0, torch.zeros(1, dtype=torch.bool)).any()
    at = next(t for t, h in enumerate(hits) if h[0])
    assert tokenizer.decode(ids[: at + 1]).endswith("</code>")
    assert "</code>" not in tokenizer.decode(ids[:at])
    assert not any(h[1] for h in hits) and stop.lengths == {0: at + 1}


class PositionScript(torch.nn.Module):
    """A 'language model' that writes ``script[position]`` at each position (greedy), for
    any context: a scripted policy for the native sampler, KV cache and all."""

    def __init__(self, script: list[int], vocab: int, margin: float = 1e4):
        super().__init__()
        self.script, self.vocab, self.margin = script, vocab, margin
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        logits_to_keep=1,
        **kw,
    ):
        nxt = (position_ids[:, -1:] + 1).clamp(max=len(self.script) - 1)
        logits = torch.full((*nxt.shape, self.vocab), -self.margin)
        logits.scatter_(-1, torch.tensor(self.script)[nxt].unsqueeze(-1), 0.0)

        class Out:
            pass

        out = Out()
        out.logits = logits
        return out


def test_native_sampler_pauses_at_calls_and_assembles_the_rollout(tokenizer):
    """The native engine end to end on a scripted policy: the rollout holds prompt, model
    tokens, observation, model tokens; `response_mask` is false exactly on the observation,
    attention covers it, and `trimmed` keeps it."""
    prompt = encode(tokenizer, "What is 1 + 2?")
    before, after = encode(tokenizer, " <code>abc</code>"), encode(tokenizer, " 3")
    obs = encode(tokenizer, "<output>ABC</output>")
    eos = tokenizer.eos_token_id
    # the script is indexed by position: the prompt, the model's tokens, the observation's
    # positions (never asked: the tool writes them), then the rest
    script = prompt + before + obs + after + [eos] * 4
    policy = PositionScript(script, len(tokenizer))
    cfg = Generation(n=2, max_new_tokens=40, temperature=0.0, max_turns=2)
    r = generate(policy, [prompt], cfg, tokenizer.pad_token_id, eos, tools=[Upper()], tokenizer=tokenizer)
    expect = before + obs + after + [eos]
    T = len(expect)
    assert r.responses.shape == (2, T)
    assert r.responses[0].tolist() == expect and r.responses[1].tolist() == expect
    mask = [True] * len(before) + [False] * len(obs) + [True] * (len(after) + 1)
    assert r.response_mask[0].tolist() == mask
    assert r.attention_mask[0, -T:].tolist() == [1] * T
    assert r.response_lengths.tolist() == [T - len(obs)] * 2
    assert r.response_extent.tolist() == [T] * 2
    assert r.tool_calls.tolist() == [1, 1] and r.observation_tokens.tolist() == [len(obs)] * 2
    assert not r.truncated.any()
    t = r.trimmed()
    assert t.response_mask.shape[1] == T and t.responses[0].tolist() == expect


def test_native_sampler_reports_the_log_probs_of_the_model_tokens_only(tokenizer):
    """With `logprobs`, a multi-turn rollout carries each model token's log-prob under the
    sampler (every other token 5 logits below the scripted one: log p = -log(1 + (V-1)e^-5))
    and 0 on the observation the tool wrote."""
    prompt = encode(tokenizer, "What is 1 + 2?")
    before, after = encode(tokenizer, " <code>abc</code>"), encode(tokenizer, " 3")
    obs, eos = encode(tokenizer, "<output>ABC</output>"), tokenizer.eos_token_id
    policy = PositionScript(prompt + before + obs + after + [eos] * 4, len(tokenizer), margin=5.0)
    cfg = Generation(n=2, max_new_tokens=40, temperature=0.0, max_turns=2)
    r = generate(
        policy, [prompt], cfg, tokenizer.pad_token_id, eos, tools=[Upper()], tokenizer=tokenizer, logprobs=True
    )
    want = -math.log1p((len(tokenizer) - 1) * math.exp(-5.0))
    lp, mask = r.rollout_logprobs, r.response_mask
    assert lp.shape == mask.shape and (~mask).any()
    torch.testing.assert_close(lp[mask], torch.full_like(lp[mask], want), atol=1e-5, rtol=1e-5)
    assert (lp[~mask] == 0).all()


@pytest.fixture(scope="module")
def python_tool():
    from vapo_lightning.tools import PythonTool

    tool = PythonTool(timeout_s=2.0, max_output_bytes=2000, workers=2)
    yield tool
    tool.close()


def test_python_tool_runs_each_call_in_the_sandbox(python_tool):
    """What a call prints comes back; a program's own exception shows its last traceback
    line and is not a tool error; a hang and a flood give short observations saying so, the
    hang counted as an error; calls share no state (each is a fresh program)."""
    outs = python_tool.run(
        [
            "print(4821*397)",
            "x = 1\nprint(x / 0)",
            "while True: pass",
            "while True: print('y' * 100)",
            "print(x)",  # x of the second call is not defined here
            "import os; print(os.getuid() != 0 or 'root')",
        ]
    )
    assert outs[0] == ToolOutput("1913937")
    assert outs[1].text.endswith("ZeroDivisionError: division by zero") and outs[1].error is None
    assert "Timed out after 2 s" in outs[2].text and outs[2].error == "timeout"
    assert outs[3].text.startswith("y" * 100) and "(output truncated)" in outs[3].text
    assert len(outs[3].text) < 2200
    assert "NameError" in outs[4].text
    assert python_tool.run(["print('after a hang')"]) == [ToolOutput("after a hang")]


def test_python_tool_keeps_its_config_in_the_spec():
    from vapo_lightning.tools import PythonTool

    tool = from_spec(spec(PythonTool(call_start="```python\n", call_end="```", timeout_s=3.0)))
    assert (tool.call_start, tool.call_end, tool.timeout_s) == ("```python\n", "```", 3.0)
    assert tool.observation("4") == "<output>4</output>"
    with pytest.raises(ValueError, match="timeout_s"):
        PythonTool(timeout_s=0)


def test_python_tool_refuses_to_start_below_its_minimum_isolation(monkeypatch):
    """As `CodeReward`: a sandbox with less than `min_isolation` stops the tool at setup,
    naming what is missing, and its servers are shut down; "none" accepts it."""
    import vapo_lightning.sandbox.client as client
    from vapo_lightning.tools import PythonTool

    pools = []

    class WeakPool:
        layers = ("rlimits", "session", "clean_env", "subreaper")

        def __init__(self, *a, **k):
            self.closed = False
            pools.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(client, "Pool", WeakPool)
    tool = PythonTool()
    with pytest.raises(RuntimeError, match=r"(?s)PythonTool.*Missing:.*filesystem.*network"):
        tool.setup()
    assert pools[-1].closed and tool._pool is None
    weak = PythonTool(min_isolation="none")
    weak.setup()
    assert weak._pool is pools[-1] and not pools[-1].closed
    with pytest.raises(ValueError, match="min_isolation"):
        PythonTool(min_isolation="paranoid")
    assert from_spec(spec(PythonTool(min_isolation="basic"))).min_isolation == "basic"


def test_observation_tokens_reach_no_loss(tok):
    """Both models' gradients equal a slow reference over the model's own tokens only: the
    actor's token-mean surrogate (on-policy, so ratio 1) plus the positive-example NLL, the
    critic's squared error to the Monte-Carlo return; whitening counts actions only; garbage
    at observation positions of every per-token field changes nothing."""
    from tests.update_helpers import module_with, old_estimates, rollout_with_observations, run_updates
    from vapo_lightning import core
    from vapo_lightning.advantages import compute_advantages
    from vapo_lightning.rollout import critic_values, policy_logits
    from vapo_lightning.updates import RankOps

    module = module_with(tok, 4)
    r = rollout_with_observations(module.policy.config.vocab_size)
    old, values = old_estimates(module, r)
    adv = compute_advantages(r, values, module.algo, False, RankOps().global_sum)
    mask = r.response_mask
    assert abs(float(core.masked_mean(adv.advantages, mask))) < 1e-5
    n = float(mask.sum())  # unbiased variance over the actions only
    assert abs(float(core.masked_mean(adv.advantages**2, mask)) * n / (n - 1) - 1) < 1e-4
    assert torch.equal(adv.lam_actor, core.length_adaptive_lam(mask.sum(-1), 0.05))
    for x in (old.logprobs, old.entropy, values):
        x[~mask] = float("nan")  # garbage wherever the mask is false
    steps, _, _ = run_updates(module, r, old, values)  # (its advantages: the same GAE on the same V_old)
    grads = {f"{name}.{n}": g for name, step in steps for n, g in step.items()}
    assert all(torch.isfinite(g).all() for g in grads.values())

    a, n_actions = module.algo, mask.sum()
    n_correct = (mask & r.correct[:, None]).sum()
    module.policy.zero_grad()
    module.critic.zero_grad()
    for b in range(len(r)):  # one response at a time, its whole context, actions by hand
        row = r.select([b]).trimmed()
        logp = core.logprobs_from_logits(policy_logits(module.policy, row), row.responses)[0]
        values = critic_values(module.critic, row)[0]
        actor = critic = 0.0
        for t in range(row.response_mask.shape[1]):
            if not row.response_mask[0, t]:
                continue
            ratio = torch.exp(logp[t] - logp[t].detach())
            actor = actor - adv.advantages[b, t] * ratio / n_actions
            if row.correct[0]:
                actor = actor - a.nll_coef * logp[t] / n_correct
            critic = critic + 0.5 * (values[t] - row.scores[0]) ** 2 / n_actions
        (actor + critic).backward()
    for prefix, model in (("actor", module.policy), ("critic", module.critic)):
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[f"{prefix}.{name}"], p.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_resumed_tools_run_reproduces_the_uninterrupted_run(tok, tmp_path):
    """Resumed in the middle of a run with tools: the same calls, observations and metrics
    as the uninterrupted run, and the checkpoint rebuilds the tools from its hyper-parameters."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import scalars, tiny_data, tiny_module, tiny_trainer
    from tests.tool_helpers import EverySpace
    from vapo_lightning.callbacks import ValidationSamples
    from vapo_lightning.jsonl import read_jsonl
    from vapo_lightning.module import VAPOModule

    def run(root, max_steps, ckpt_path=None):
        L.seed_everything(5)
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(
            root,
            max_steps=max_steps,
            callbacks=[ckpt, ValidationSamples()],
            val_check_interval=2,
            check_val_every_n_epoch=None,
        )
        module = tiny_module(tok, tools=[EverySpace(fail_over=2)])
        trainer.fit(module, datamodule=tiny_data(tmp_path), ckpt_path=ckpt_path)
        return scalars(root)

    full = run(tmp_path / "full", 4)
    assert min(v for _, v in full["tools/calls/mean"]) > 0  # the tool is used
    assert sum(v for _, v in full["tools/errors"]) > 0  # and fails sometimes
    rows = read_jsonl(tmp_path / "full" / "val_samples.jsonl")  # validation logs its tool use
    calls = [row["tool_calls"] for row in rows if row["step"] == rows[-1]["step"]]
    assert full["val/tools/share_of_responses"][-1][1] == pytest.approx(sum(c > 0 for c in calls) / len(calls))
    assert full["val/tools/calls/mean"][-1][1] == pytest.approx(sum(calls) / len(calls))
    run(tmp_path / "part", 2)
    (tmp_path / "part2").mkdir()
    (tmp_path / "part2" / "ckpt").symlink_to(tmp_path / "part" / "ckpt")
    resumed = run(tmp_path / "part2", 4, ckpt_path="last")
    for name in (
        "tools/calls/mean",
        "tools/observation_tokens/mean",
        "tools/share_of_responses",
        "tools/errors",
        "response_length/mean",
        "critic/score/mean",
        "actor/pg_loss",
    ):
        assert [v for _, v in resumed[name]] == [v for s, v in full[name] if s >= 2], name
    module = VAPOModule.load_from_checkpoint(tmp_path / "part" / "ckpt" / "last.ckpt")
    assert [type(t) for t in module.tools] == [EverySpace] and module.tools[0].fail_over == 2


@pytest.mark.slow
def test_ddp_run_with_tools_on_two_processes(tmp_path):
    """Two ranks with tools: each samples its own multi-turn responses; tool metrics are
    logged (reduced over ranks) alongside the usual ones."""
    from tests.helpers import vapo_fit, version_scalars

    tools = "--model.tools=[{class_path: tests.tool_helpers.EverySpace, init_args: {fail_over: 8}}]"
    vapo_fit(tmp_path, "ddp", "--trainer.max_steps=3", tools)
    (version,) = tmp_path.glob("lightning_logs/version_*")
    logged = version_scalars(version)
    assert logged["rollout_step"] == [1.0, 2.0, 3.0]
    assert all(0 < v <= 4 for v in logged["tools/calls/mean"])  # max_turns 4
    assert all(0 < v <= 1 for v in logged["tools/share_of_responses"])
    assert all(v > 0 for v in logged["tools/observation_tokens/mean"])
    assert len(logged["actor/grad_norm"]) == 1 and 0 < logged["actor/grad_norm"][0] < 1e3


@pytest.mark.slow
def test_failing_calls_are_counted_every_step_and_shown_once(tok, tmp_path):
    """Every failed call counts in tools/errors; each kind of failure is warned about once,
    with its message, however often it recurs (training and validation)."""
    import warnings

    from tests.helpers import scalars, tiny_data, tiny_module, tiny_trainer
    from tests.tool_helpers import EverySpace

    module = tiny_module(tok, tools=[EverySpace(fail_over=0)])  # every non-empty call fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_steps=3).fit(module, datamodule=tiny_data(tmp_path))
    logged = scalars(tmp_path)
    shown = [str(w.message) for w in caught if "counted in tools/errors" in str(w.message)]
    assert shown == ["tool 'every_space' failed (too_long): too_long (counted in tools/errors)"]
    assert sum(v for _, v in logged["tools/errors"]) >= 3
