"""The memory plan against cases worked by hand (docs/distributed.md's 7 B example among them)."""

from __future__ import annotations

import pytest

from vapo_lightning.memory_plan import GiB, ModelShape, memory_plan

QWEN7B = ModelShape(params=7.615e9, layers=28, hidden=3584, vocab=152_064, kv_heads=4, head_dim=128)
QWEN7B_CRITIC = ModelShape(params=7.07e9, layers=28, hidden=3584)


def plan_7b(**overrides):
    kwargs = dict(
        world=8,
        sharded=True,
        reference=False,
        prompt=512,
        max_new_tokens=8192,
        responses=1024,
        micro_batch=4,
        max_tokens=None,
        checkpointing=True,
        engine="vllm",
        device_bytes=80 * GiB,
        gpu_memory_utilization=0.5,
    )
    return memory_plan(QWEN7B, QWEN7B_CRITIC, **{**kwargs, **overrides})


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
