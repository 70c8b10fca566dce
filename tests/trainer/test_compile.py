"""`VAPOModule(torch_compile=True)`: compiled training forwards, eager sampling, same numbers."""

import lightning as L
import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from tests.helpers import TINY_LLAMA, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.config import Algorithm, Generation
from vapo_lightning.engines.sampler import sample_responses
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
from vapo_lightning.rollout import Rollout, policy_logits


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    yield
    torch._dynamo.reset()


def captured() -> int:
    """Frames dynamo has traced into graphs since the last reset."""
    return dynamo_utils.counters["stats"]["calls_captured"]


def graphs() -> int:
    """Distinct graphs dynamo has compiled since the last reset."""
    return dynamo_utils.counters["stats"]["unique_graphs"]


def fit_metrics(tok, root, torch_compile: bool, algorithm: Algorithm) -> dict[str, list[float]]:
    L.seed_everything(3)
    module = tiny_module(
        tok,
        algorithm=algorithm,
        generation=Generation(n=4, max_new_tokens=10),
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


@pytest.mark.parametrize(
    "algorithm,min_graphs",
    [
        # one epoch over one mini-batch of two micro-batches: the updates' forwards give pi_old
        # and V_old; a grad graph per model
        (Algorithm(mini_batch_size=16, micro_batch_size=8), 2),
        # two epochs over two mini-batches: pi_old and V_old from no-grad eval forwards first,
        # then a grad graph per model
        (Algorithm(mini_batch_size=8, micro_batch_size=4, ppo_epochs=2), 4),
    ],
    ids=["one-pass", "epochs"],
)
@pytest.mark.slow
def test_compiled_updates_match_eager(tok, tmp_path, algorithm, min_graphs):
    eager = fit_metrics(tok, tmp_path / "eager", False, algorithm)
    assert captured() == 0
    compiled = fit_metrics(tok, tmp_path / "compiled", True, algorithm)
    assert graphs() >= min_graphs  # both models' forwards ran compiled
    # Same rollouts (the sampler is eager in both), and the first step's losses and
    # gradient norms equal up to the compiled kernels' float reassociation.
    for key in ("response_length/mean", "critic/score/mean"):
        assert compiled[key] == eager[key], key
    for key in (
        "critic/vf_loss",
        "actor/pg_loss",
        "actor/nll_loss",
        "actor/entropy",
        "actor/grad_norm",
        "critic/grad_norm",
        "actor/ppo_kl",
    ):
        assert compiled[key][0] == pytest.approx(eager[key][0], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_bf16_compiled_forward_is_one_graph(tok):
    """Under CPU autocast `attention.sdpa_fp32_on_cpu` asks whether the sampler is decoding;
    a compiled forward must not read that context variable (a graph break per layer)."""
    model = build_policy(ModelSpec(config=TINY_LLAMA), load_tokenizer(str(tok)))
    ids = torch.randint(5, 100, (2, 10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.mark.slow
def test_sampler_never_traces_a_compiled_model(tok):
    tokenizer = load_tokenizer(str(tok))
    model = build_policy(ModelSpec(config=TINY_LLAMA), tokenizer).eval()
    model.compile()
    ids = torch.tensor([[tokenizer.pad_token_id, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids != tokenizer.pad_token_id).long()
    out = sample_responses(
        model,
        ids,
        mask,
        max_new_tokens=6,
        stop_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        min_new_tokens=6,
    )
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
