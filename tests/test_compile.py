"""`VAPOModule(torch_compile=True)`: compiled training forwards, eager sampling, same numbers."""

import lightning as L
import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from tests.helpers import TINY_LLAMA, build_tokenizer, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.config import Algorithm
from vapo_lightning.generation import sample_responses
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
from vapo_lightning.rollout import GenerationConfig, Rollout, policy_logits


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    yield
    torch._dynamo.reset()


def captured() -> int:
    """Frames dynamo has traced into graphs since the last reset."""
    return dynamo_utils.counters["stats"]["calls_captured"]


def fit_metrics(tok, root, torch_compile: bool) -> dict[str, list[float]]:
    L.seed_everything(3)
    module = tiny_module(
        tok,
        # one epoch over one mini-batch with two micro-batches: both models' grad forwards
        algorithm=Algorithm(mini_batch_size=16, micro_batch_size=8),
        generation=GenerationConfig(n=4, max_new_tokens=10),
        torch_compile=torch_compile,
    )
    root.mkdir()
    seen: dict[str, list[float]] = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            for k, v in trainer.callback_metrics.items():
                seen.setdefault(k, []).append(float(v))

    trainer = tiny_trainer(root, max_steps=2, callbacks=[Record()], logger=False)
    trainer.fit(module, datamodule=tiny_data(root, val=None))
    return seen


def test_compiled_updates_match_eager(tok, tmp_path):
    eager = fit_metrics(tok, tmp_path / "eager", torch_compile=False)
    assert captured() == 0
    compiled = fit_metrics(tok, tmp_path / "compiled", torch_compile=True)
    assert captured() > 0  # the training forwards ran compiled
    # Same rollouts (the sampler is eager in both), and the first step's losses and
    # gradient norms equal up to the compiled kernels' float reassociation.
    for key in ("response_length/mean", "critic/score/mean"):
        assert compiled[key] == eager[key], key
    for key in ("critic/vf_loss", "actor/pg_loss", "actor/nll_loss", "actor/entropy",
                "actor/grad_norm", "critic/grad_norm"):  # fmt: skip
        assert compiled[key][0] == pytest.approx(eager[key][0], rel=1e-4, abs=1e-6), key


def test_sampler_never_traces_a_compiled_model(tok):
    tokenizer = load_tokenizer(str(tok))
    model = build_policy(ModelSpec(config=TINY_LLAMA), tokenizer).eval()
    model.compile()
    ids = torch.tensor([[tokenizer.pad_token_id, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids != tokenizer.pad_token_id).long()
    out = sample_responses(
        model, ids, mask, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id, min_new_tokens=6,
    )  # fmt: skip
    assert out.shape == (2, 6)
    assert captured() == 0
    # The same model's training-style forward is compiled: the check above can fail.
    r = Rollout(
        input_ids=torch.cat([ids, out], 1),
        attention_mask=torch.cat([mask, torch.ones_like(out)], 1),
        response_mask=torch.ones_like(out, dtype=torch.bool),
        group_ids=torch.arange(2),
        truncated=torch.ones(2, dtype=torch.bool),
    )
    with torch.no_grad():
        policy_logits(model, r)
    assert captured() > 0


def test_compile_needs_set_stance(tok, monkeypatch):
    monkeypatch.delattr(torch.compiler, "set_stance")
    with pytest.raises(ValueError, match=r"model.torch_compile needs torch >= 2.6"):
        tiny_module(tok, torch_compile=True)
