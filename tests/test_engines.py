"""Engine selection, without vLLM: which engine each phase uses and the engine's dtype."""

import torch

from tests.helpers import TINY_LLAMA, build_tokenizer
from vapo_lightning.engines import engine_dtype
from vapo_lightning.models import ModelSpec
from vapo_lightning.module import VAPOModule
from vapo_lightning.rollout import GenerationConfig


def test_validation_follows_the_training_engine_unless_told(tmp_path):
    tok = str(build_tokenizer(tmp_path / "tok"))
    policy = ModelSpec(config=TINY_LLAMA, tokenizer=tok)
    default = VAPOModule(policy=policy)
    assert (default.gen.engine, default.val_gen.engine) == ("native", "native")
    follows = VAPOModule(policy=policy, generation=GenerationConfig(engine="vllm"),
                         val_generation=GenerationConfig(n=1, temperature=0.0))  # fmt: skip
    assert (follows.gen.engine, follows.val_gen.engine) == ("vllm", "vllm")
    assert follows.uses_vllm
    told = VAPOModule(policy=policy, generation=GenerationConfig(engine="vllm"),
                      val_generation=GenerationConfig(engine="native"))  # fmt: skip
    assert told.val_gen.engine == "native"
    assert not VAPOModule(policy=policy, val_generation=GenerationConfig(engine="native")).uses_vllm


def test_engine_dtype_follows_the_trainer_precision():
    assert engine_dtype("auto", "bf16-mixed") is torch.bfloat16
    assert engine_dtype("auto", "16-mixed") is torch.float16
    assert engine_dtype("auto", "32-true") is torch.float32
    assert engine_dtype("float32", "bf16-mixed") is torch.float32
