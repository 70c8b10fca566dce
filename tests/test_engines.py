"""Engine selection, without vLLM: which engine each phase uses and the engine's dtype."""

import torch

from tests.helpers import TINY_LLAMA, build_tokenizer
from vapo_lightning.config import Generation
from vapo_lightning.engines import engine_dtype
from vapo_lightning.models import ModelSpec
from vapo_lightning.module import VAPOModule


def test_validation_follows_the_training_engine_unless_told(tmp_path):
    tok = str(build_tokenizer(tmp_path / "tok"))
    policy = ModelSpec(config=TINY_LLAMA, tokenizer=tok)
    default = VAPOModule(policy=policy)
    assert (default.gen.engine, default.val_gen.engine) == ("native", "native")
    follows = VAPOModule(policy=policy, generation=Generation(engine="vllm"),
                         val_generation=Generation(n=1, temperature=0.0))  # fmt: skip
    assert (follows.gen.engine, follows.val_gen.engine) == ("vllm", "vllm")
    assert follows.uses_vllm
    told = VAPOModule(policy=policy, generation=Generation(engine="vllm"),
                      val_generation=Generation(engine="native"))  # fmt: skip
    assert told.val_gen.engine == "native"
    assert not VAPOModule(policy=policy, val_generation=Generation(engine="native")).uses_vllm


def test_engine_dtype_follows_the_trainer_precision():
    assert engine_dtype("auto", "bf16-mixed") is torch.bfloat16
    assert engine_dtype("auto", "16-mixed") is torch.float16
    assert engine_dtype("auto", "32-true") is torch.float32
    assert engine_dtype("float32", "bf16-mixed") is torch.float32


class FakeLLM:
    """Records vLLM's sleep / wake-up calls (sleep mode needs a GPU)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


def test_sleep_discards_weights_only_when_an_update_replaces_them(monkeypatch):
    from vapo_lightning.config import VLLMOptions
    from vapo_lightning.engines import RolloutEngines
    from vapo_lightning.engines.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the engine's memory logic without vLLM
    engine.llm, engine.options, engine.on_gpu = FakeLLM(), VLLMOptions(), True
    engine.asleep, engine.weights_stale = set(), False
    loads = []
    def load_weights(self, policy):  # the real one's wake-up and bookkeeping, no copy
        loads.append(policy)
        with self._awake(("weights",)):
            self.weights_stale = False

    monkeypatch.setattr(VLLMEngine, "load_weights", load_weights)

    class Module(RolloutEngines):
        gen = val_gen = Generation(engine="vllm")
        policy = "policy"

    m = Module()
    m._init_engines()
    m._vllm, m._engine_version, m.actor_frozen = engine, 0, True
    m.release_engine()  # value pretraining: the weights survive (offloaded)
    assert engine.llm.calls == [("sleep", 1)] and not engine.weights_stale
    assert not m.sync_engine() and loads == []  # same policy, weights kept: nothing to load
    with engine._awake():
        pass
    assert engine.llm.calls[-1] == ("wake_up", ("kv_cache", "weights")) and not engine.asleep

    m.actor_frozen = False
    m.release_engine()  # the actor will update: the weights are dropped (level 2)
    assert engine.llm.calls[-1] == ("sleep", 2) and engine.weights_stale
    # Even if the update is skipped (a non-finite gradient leaves the version unchanged),
    # the next rollout reloads: dropped weights are never sampled from.
    assert m.sync_engine() and loads == ["policy"]
    assert engine.llm.calls[-1] == ("wake_up", ("weights",)) and engine.asleep == {"kv_cache"}
    m.policy_version += 1
    assert m.sync_engine() and len(loads) == 2  # a new policy always loads

    engine.on_gpu, engine.asleep = False, set()  # CPU backend: no sleep mode
    calls = len(engine.llm.calls)
    m.release_engine()
    assert len(engine.llm.calls) == calls and not engine.asleep
