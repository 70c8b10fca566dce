"""The trainer on a CUDA device: the math, the sampler and a bf16 fit agree with the CPU.

Skipped where torch sees no GPU (CI here has none); run on a lent GPU machine with
`pytest tests/e2e/test_cuda.py` (see benchmarks/gpu_check.sh).
"""

import math

import lightning as L
import pytest
import torch

from tests.helpers import TINY_LLAMA, tiny_data, tiny_module, tiny_trainer
from vapo_lightning import core
from vapo_lightning.config import Generation
from vapo_lightning.engines.sampler import sample_responses
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 matmuls in fp32 (no TF32), so CPU and GPU differ by rounding only."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_core_math_matches_cpu():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 40
    lengths = torch.tensor([40, 1, 17, 33, 8, 25])
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = core.sparse_rewards(torch.randn(B, generator=g), mask)
    values = torch.randn(B, T, generator=g)
    lam = core.length_adaptive_lam(lengths, alpha=0.05)
    logp, old = torch.randn(B, T, generator=g) * 0.1 - 2, torch.randn(B, T, generator=g) * 0.1 - 2
    logits, labels = torch.randn(B, T, 50, generator=g), torch.randint(0, 50, (B, T), generator=g)

    def run(device):
        d = lambda x: x.to(device)  # noqa: E731
        adv, ret = core.gae(d(rewards), d(values), d(mask), 1.0, d(lam))
        loss, _ = core.policy_loss(d(logp), d(old), adv, d(mask), mask.sum(), 0.2, 0.28)
        vloss, _ = core.value_loss(d(values) + 0.1, d(values), ret, d(mask), mask.sum(), 0.5)
        lp = core.logprobs_from_logits(d(logits), d(labels))
        ent = core.entropy_from_logits(d(logits))
        return [x.cpu() for x in (adv, ret, loss, vloss, lp, ent)]

    for a, b in zip(run("cpu"), run("cuda"), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_sampler_on_cuda_scores_like_cpu(tok):
    """Greedy decoding on the GPU gives the CPU's responses (padding after the stop token
    included)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(tok))
    policy = build_policy(ModelSpec(config=TINY_LLAMA), tokenizer).eval()
    prompts = [f"What is {a} + {a + 1}?" for a in range(6)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    kwargs = {
        "max_new_tokens": 16,
        "stop_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
        "temperature": 0.0,
    }
    cpu = sample_responses(policy, enc.input_ids, enc.attention_mask, **kwargs)
    gpu = sample_responses(policy.cuda(), enc.input_ids.cuda(), enc.attention_mask.cuda(), **kwargs).cpu()
    policy.cpu()
    # A near-tie can break differently under different rounding: allow one row to differ.
    same_rows = sum(torch.equal(a, b) for a, b in zip(cpu, gpu))
    assert same_rows >= len(prompts) - 1, (cpu, gpu)


class WhereTheModelsTrain(L.Callback):
    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        for model in (pl_module.policy, pl_module.critic):
            self.devices.add(next(model.parameters()).device.type)


def test_bf16_fit_on_cuda_updates_both_models(tok, tmp_path):
    L.seed_everything(0)
    module = tiny_module(tok, val_generation=Generation(n=2, max_new_tokens=12))
    module.configure_model()
    before = {
        name: {n: p.detach().clone() for n, p in m.named_parameters()}
        for name, m in (("policy", module.policy), ("critic", module.critic))
    }
    seen = WhereTheModelsTrain()
    trainer = tiny_trainer(
        tmp_path,
        max_steps=2,
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        callbacks=[seen],
    )
    data = tiny_data(tmp_path)
    trainer.fit(module, datamodule=data)

    assert trainer.global_step == 2
    assert seen.devices == {"cuda"}  # fit moves the models back to the CPU when it ends
    for name, model in (("policy", module.policy), ("critic", module.critic)):
        changed = {n for n, p in model.named_parameters() if not torch.equal(before[name][n], p.detach().cpu())}
        assert changed == set(before[name]), f"{name}: {set(before[name]) - changed} unchanged"
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert 0.0 <= module.initial_val_accuracy <= 1.0  # scored before training, on the GPU
    (val,) = trainer.validate(module, datamodule=data, verbose=False)
    assert 0.0 <= val["val/accuracy"] <= 1.0


def test_bf16_autocast_decoding_keeps_a_bf16_cache_on_cuda(tok, monkeypatch):
    """tests/engines/test_generation.py's `test_autocast_decoding_keeps_the_cache_in_the_autocast_dtype` on
    the GPU (never run on one yet: run it on the next lent GPU): under CUDA autocast
    the cache is bf16 and greedy tokens equal those of the fp32 cache SDPA casts itself."""
    import vapo_lightning.engines.kv_cache as generation

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(tok))
    policy = build_policy(ModelSpec(config=TINY_LLAMA), tokenizer).eval().cuda()
    enc = tokenizer([f"What is {a} + 2?" for a in range(6)], return_tensors="pt", padding=True, padding_side="left").to(
        "cuda"
    )
    dtypes, init = [], generation.GrowingLayer.lazy_initialization

    def recording_init(self, k, v):
        init(self, k, v)
        dtypes.append(self._k.dtype)

    monkeypatch.setattr(generation.GrowingLayer, "lazy_initialization", recording_init)

    def decode():
        return sample_responses(
            policy,
            enc.input_ids,
            enc.attention_mask,
            max_new_tokens=16,
            min_new_tokens=16,
            stop_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            temperature=0.0,
        )

    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = decode()
        assert set(dtypes) == {torch.bfloat16}
        monkeypatch.setattr(generation, "cache_dtype", lambda k: k.dtype)
        dtypes.clear()
        slow = decode()
        assert set(dtypes) == {torch.float32}
    assert torch.equal(fast, slow)
