"""vLLM's sleep mode over a whole fit, without a GPU: `VLLMEngine`'s own sleep / wake / sync
logic drives a stand-in for `vllm.LLM` that keeps vLLM's contract (level 1 offloads the
weights, level 2 discards them; woken weights after level 2 hold garbage until a reload) and
fails on any breach: a generate from sleeping, discarded or stale weights, a reload into
sleeping weights. The fit has value pretraining, actor updates, validation and a resume.
Sampling itself is the native engine's."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import pytest
import torch

from tests.helpers import tiny_data, tiny_module, tiny_trainer
from vapo_lightning.callbacks import ValuePretraining
from vapo_lightning.config import Generation, VLLMOptions
from vapo_lightning.engines.native import NativeEngine
from vapo_lightning.engines.vllm import VLLMEngine


def fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


class SleepingLLM:
    """vLLM's sleep-mode contract, checked."""

    log: ClassVar[list[str]] = []  # every call, over every engine of the test

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy, self.weights, self.kv, self.loaded = policy, "garbage", "awake", None

    def sleep(self, level: int) -> None:
        assert self.weights in ("loaded", "garbage") and self.kv == "awake", "sleep while asleep"
        self.weights, self.kv = ("offloaded" if level == 1 else "discarded"), "asleep"
        self.log.append(f"sleep{level}")

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:
            assert self.weights in ("offloaded", "discarded"), "woke awake weights"
            self.weights = "loaded" if self.weights == "offloaded" else "garbage"
        if "kv_cache" in tags:
            self.kv = "awake"
        self.log.append("wake:" + ",".join(tags))

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        assert method == "reload_weights"
        assert self.weights in ("loaded", "garbage"), f"a reload into sleeping weights ({self.weights})"
        for _ in kwargs["weights_iterator"]:
            pass
        self.weights, self.loaded = "loaded", fingerprint(self.policy)
        self.log.append("reload")

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self) -> None:
        assert self.kv == "awake", "generate with a sleeping KV cache"
        assert self.weights == "loaded", f"generate from {self.weights} weights"
        assert self.loaded == fingerprint(self.policy), "generate from stale weights"
        self.log.append("generate")


class SleepingEngine(VLLMEngine):
    """`VLLMEngine`'s memory logic (sync, release, sleep, wake) over `SleepingLLM`, on a
    pretend GPU; tokens from the native engine."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, tools: list, logprobs: bool = False) -> None:
        self.policy, self.tokenizer, self.tools, self.logprobs = policy, tokenizer, list(tools), True
        self.options, self.on_gpu, self.tp_group = VLLMOptions(sleep=True), True, None
        self.dtype = torch.float32
        self.asleep: set[str] = set()
        self.weights_stale = True
        self.llm = SleepingLLM(policy)
        self.native = NativeEngine(policy, tokenizer, tools, logprobs=True)
        self.load_weights(policy)

    @classmethod
    def from_generation(cls, gen, policy, tokenizer, tools, **kwargs) -> SleepingEngine:
        return cls(policy, tokenizer, tools)

    @classmethod
    def check_setup(cls, config: Any, max_model_len: int) -> None:
        pass

    def generate(self, prompt_ids, gen, reproducible=False):
        with self._awake():
            self.llm.generate()
            return self.native.generate(prompt_ids, gen, reproducible)

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_sleep_mode_never_samples_discarded_or_stale_weights_over_a_fit_and_its_resume(tmp_path, tok, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint

    monkeypatch.setitem(
        __import__("vapo_lightning.engines", fromlist=["ENGINES"]).ENGINES, "vllm", f"{__name__}:SleepingEngine"
    )
    SleepingLLM.log = []
    gen = Generation(n=4, max_new_tokens=12, engine="vllm")

    def fit(steps: int, ckpt: str | None = None) -> None:
        module, data = tiny_module(tok, generation=gen), tiny_data(tmp_path)
        save = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(
            tmp_path,
            max_steps=steps,
            callbacks=[ValuePretraining(steps=2), save],
            val_check_interval=2,
            check_val_every_n_epoch=None,
        )
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)

    fit(4)  # 2 value-pretraining steps (level 1: the weights kept), 2 actor steps (level 2)
    first = list(SleepingLLM.log)
    assert first.count("generate") >= 4 + 3  # 4 rollouts; validation before training and at 2, 4
    assert "sleep1" in first and "sleep2" in first
    after_deep = first.index("sleep2")
    assert "reload" in first[after_deep : first.index("generate", after_deep)]  # reloaded before sampling
    fit(5, ckpt=str(tmp_path / "ckpt" / "last.ckpt"))  # resumed: the restored weights, not the initial ones
    assert SleepingLLM.log.count("generate") > first.count("generate")


def test_weights_offloaded_while_stale_are_still_reloaded(tok):
    """A policy that changed, then a level-1 sleep (the weights offloaded, not reloaded):
    the next sync must still load the new weights."""
    module = tiny_module(tok)
    module.configure_model()
    engine = SleepingEngine(module.policy, module.tokenizer, [])
    with torch.no_grad():
        next(module.policy.parameters()).add_(1.0)
    engine.policy_changed()
    engine.release(keep_weights=True)
    assert engine.sync()  # reloaded
    engine.generate([[5, 6, 7]], Generation(n=1, max_new_tokens=2))


def test_the_device_is_checked_before_the_engine_starts():
    from vapo_lightning.engines.vllm_setup import EngineSetupError, check_device_memory

    GiB = 2**30
    check_device_memory(True, 0.5, {}, (60 * GiB, 80 * GiB))
    with pytest.raises(EngineSetupError, match="expandable segments"):
        check_device_memory(True, 0.5, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, (60 * GiB, 80 * GiB))
    check_device_memory(False, 0.5, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, (60 * GiB, 80 * GiB))
    with pytest.raises(EngineSetupError, match=r"claim 40.0 GiB, but 30.0 GiB of 80.0 are free"):
        check_device_memory(True, 0.5, {}, (30 * GiB, 80 * GiB))
