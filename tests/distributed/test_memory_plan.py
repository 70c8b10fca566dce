"""The memory plan against cases worked by hand (docs/distributed.md's 7 B example among them)."""

from __future__ import annotations

import dataclasses

import pytest

from vapo_lightning.memory_plan import GiB, ModelShape, memory_plan

# log-probs through the full logits (a model without a plain LM head)
QWEN7B = ModelShape(params=7.615e9, layers=28, hidden=3584, vocab=152_064, kv_heads=4, head_dim=128)
QWEN7B_CRITIC = ModelShape(params=7.07e9, layers=28, hidden=3584)
PLAN_SMALL = dict(
    world=1,
    sharded=False,
    reference=False,
    responses=1,
    max_tokens=None,
    checkpointing=False,
    engine="vllm",
    device_bytes=80 * GiB,
    gpu_memory_utilization=0.0,
)


def plan_7b(policy=QWEN7B, **overrides):
    kwargs = PLAN_SMALL | dict(world=8, sharded=True, prompt=512, max_new_tokens=8192, responses=1024, micro_batch=4)
    kwargs |= dict(checkpointing=True, gpu_memory_utilization=0.5)
    return memory_plan(policy, QWEN7B_CRITIC, **{**kwargs, **overrides})


def test_the_7b_config_worked_by_hand():
    """configs/gpu/qwen2.5_7b_fsdp.yaml on 8 × 80 GiB: fp32 weights + AdamW (12 B a parameter)
    of both models over 8 ranks; 4 answers of 512 + 8192 tokens a micro-batch."""
    p = plan_7b()
    states = 12 * (7.615e9 + 7.07e9) / 8  # 22.03e9 B
    tokens = 4 * (512 + 8192)  # 34,816
    acts = 2 * 3584 * tokens * 28 + 34 * 3584 * tokens  # checkpointed layer inputs + one layer
    assert p.rollout == pytest.approx(states + 40 * GiB)
    assert p.actor_update == pytest.approx(states + 4 * 7.615e9 / 8 + acts + 4 * tokens * 152_064)
    assert p.critic_update == pytest.approx(states + 4 * 7.07e9 / 8 + acts)
    assert p.actor_update / GiB == pytest.approx(54.2, abs=0.1) and p.worst() < 80 * GiB
    # a token budget of one sequence: the logits of 8,704 tokens, not 34,816
    budget = plan_7b(max_tokens=8704)
    assert budget.actor_update / GiB == pytest.approx(31.6, abs=0.1)


def test_log_probs_from_the_heads_input_cost_a_chunk_not_the_logits():
    """Qwen2's plain head on a GPU: chunks of 512 positions; three fp32 (512, V) temporaries
    and W's fp32 gradient (V, H) instead of the bf16 logits and their gradient."""
    head = dataclasses.replace(QWEN7B, head_rows=512)
    p, logits = plan_7b(head), plan_7b()
    tokens = 4 * (512 + 8192)
    temporaries, weight_grad = 3 * 4 * 512 * 152_064, 4 * 152_064 * 3584
    assert (temporaries / GiB, weight_grad / GiB) == (pytest.approx(0.87, abs=0.005), pytest.approx(2.03, abs=0.005))
    chunk = temporaries + weight_grad
    assert chunk / GiB == pytest.approx(2.9, abs=0.05)
    assert p.actor_update == pytest.approx(logits.actor_update - 4 * tokens * 152_064 + chunk)
    assert p.actor_update / GiB == pytest.approx(37.4, abs=0.1)
    assert plan_7b(head, max_tokens=8704).actor_update / GiB == pytest.approx(29.6, abs=0.1)
    # flat in answer length without a token budget's help, but for the activations
    grow = plan_7b(head, max_new_tokens=16384).actor_update - plan_7b(head, max_new_tokens=1024).actor_update
    assert grow == pytest.approx(4 * (16384 - 1024) * (2 * 3584 * 28 + 34 * 3584))
    # fewer tokens than a chunk: the chunk is as long as the tokens
    tiny = ModelShape(params=1e6, layers=1, hidden=8, vocab=100, head_rows=512)
    assert memory_plan(
        tiny, None, **{**PLAN_SMALL, "max_new_tokens": 10, "prompt": 0, "micro_batch": 1}
    ).actor_update == pytest.approx(12e6 + 4e6 + 34 * 8 * 10 + 3 * 4 * 10 * 100 + 4 * 100 * 8)


def test_more_answer_tokens_cost_memory_unless_a_budget_holds_them():
    short, long = plan_7b(max_new_tokens=1024), plan_7b(max_new_tokens=16384)
    assert long.actor_update > short.actor_update * 1.5
    assert plan_7b(max_new_tokens=1024, max_tokens=20_000).actor_update == pytest.approx(
        plan_7b(max_new_tokens=16384, max_tokens=20_000).actor_update
    )  # a micro-batch filled to the budget, whatever the length of its answers


def test_replication_holds_every_state_on_every_rank_and_the_native_engine_its_kv_cache():
    tiny = ModelShape(params=1e6, layers=2, hidden=64, vocab=1000, kv_heads=2, head_dim=32)
    kwargs = dict(
        world=4,
        reference=True,
        prompt=100,
        max_new_tokens=156,
        responses=8,
        micro_batch=2,
        max_tokens=None,
        checkpointing=False,
        engine="native",
        device_bytes=GiB,
        gpu_memory_utilization=0.5,
    )
    ddp = memory_plan(tiny, tiny, sharded=False, **kwargs)
    fsdp = memory_plan(tiny, tiny, sharded=True, **kwargs)
    states = 12e6 + 12e6 + 4e6  # policy, critic, a frozen reference
    kv = 2 * 2 * 2 * 32 * 2 * 8 * 256  # K and V, layers, kv heads, head size, bf16, 8 sequences of 256
    assert ddp.rollout == pytest.approx(states + 2e6 + kv)
    assert fsdp.rollout == pytest.approx(states / 4 + 2e6 + kv)
    acts = 34 * 64 * 512 * 2  # no checkpointing: every layer's, 2 × 256 tokens
    assert ddp.actor_update == pytest.approx(states + 4e6 + acts + 4 * 512 * 1000)
    lora = ModelShape(params=1e6, layers=2, hidden=64, vocab=1000, kv_heads=2, head_dim=32, trained=1e4)
    assert lora.state_bytes == 12e4 + 4 * (1e6 - 1e4) and lora.gradient_bytes == 4e4


def test_offloaded_models_leave_their_states_in_host_memory():
    p, off = plan_7b(), plan_7b(offload=("critic",))
    assert p.rollout - off.rollout == pytest.approx(12 * 7.07e9 / 8)


def test_a_models_shape_says_whether_its_log_probs_come_from_the_heads_input():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=151_936, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=16, n_layer=1, n_head=2))
    # Qwen2.5's vocabulary: verl's 512 positions a chunk on a GPU, 128 on the CPU
    assert ModelShape.of(llama, torch.device("cuda")).head_rows == 512
    assert ModelShape.of(llama, torch.device("cpu")).head_rows == 128
    assert ModelShape.of(gpt2, torch.device("cuda")).head_rows == 0  # not a plain head: the logits
    shape = ModelShape.of(llama)
    assert (shape.vocab, shape.hidden, shape.layers, shape.kv_heads, shape.head_dim) == (151_936, 16, 1, 2, 8)


def test_the_plans_head_term_against_the_cpu_measurement():
    """benchmarks/results/memory_head_logprobs.md measured the whole update's peak growth from
    the head's input (the plan's term plus a 2-layer model's activations); docs/distributed.md
    quotes the term."""
    import re
    from pathlib import Path

    from vapo_lightning.memory_plan import logprob_bytes

    bench = ModelShape(params=0, layers=2, hidden=64, vocab=151_936, head_rows=128)
    term = logprob_bytes(bench, 2048) / GiB
    assert term == pytest.approx(0.25, abs=0.005)
    root = Path(__file__).resolve().parents[2]
    row = next(
        line
        for line in (root / "benchmarks/results/memory_head_logprobs.md").read_text().splitlines()
        if line.startswith("| from the head's input")
    )
    measured = [float(v) for v in re.findall(r"([\d.]+) GiB", row)]
    assert len(measured) == 3 and all(term < m < term + 0.1 for m in measured)
    assert "is 0.25 GiB" in (root / "docs/distributed.md").read_text()


def test_a_lora_base_kept_in_bf16_counts_two_bytes_a_parameter():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("peft")
    from vapo_lightning.lora import LoRA, keep_base_in, with_adapters

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    model = with_adapters(llama, LoRA(r=2, alpha=4), "policy")
    assert ModelShape.of(model).frozen_bytes == 4
    keep_base_in(model, torch.bfloat16)
    shape = ModelShape.of(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.frozen_bytes == 2 and shape.trained == trained
    assert shape.state_bytes == 12 * trained + 2 * (shape.params - trained)
