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
    follows = VAPOModule(
        policy=policy, generation=Generation(engine="vllm"), val_generation=Generation(n=1, temperature=0.0)
    )
    assert (follows.gen.engine, follows.val_gen.engine) == ("vllm", "vllm")
    told = VAPOModule(policy=policy, generation=Generation(engine="vllm"), val_generation=Generation(engine="native"))
    assert told.val_gen.engine == "native"
    native = VAPOModule(policy=policy, val_generation=Generation(engine="native"))
    assert (native.gen.engine, native.val_gen.engine) == ("native", "native")


def test_every_engine_has_the_common_surface():
    """Each registered engine is a `RolloutEngine` (one file and one line make a new one);
    both report their own log-probs (rollout correction, pi_old from the rollout)."""
    from vapo_lightning.engines import ENGINES, RolloutEngine, engine_class

    classes = {name: engine_class(name) for name in ENGINES}
    assert all(issubclass(cls, RolloutEngine) for cls in classes.values())
    assert classes["native"].reports_logprobs and classes["vllm"].reports_logprobs


def test_native_engine_samples_the_policy_itself(tmp_path):
    """The native engine holds no copy: it never loads weights, and its rollouts carry the
    `Sample`s the rewards read (text without special tokens, the row's fields)."""
    from vapo_lightning.engines.native import NativeEngine
    from vapo_lightning.models import build_policy, load_tokenizer

    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    policy = build_policy(ModelSpec(config=TINY_LLAMA), tok)
    engine = NativeEngine(policy, tok, [])
    assert not engine.sync()
    rows = [
        {
            "prompt_ids": tok("1 + 2 =")["input_ids"],
            "prompt_text": "1 + 2 =",
            "ground_truth": "3",
            "data_source": "sums",
        }
    ]
    torch.manual_seed(0)
    r = engine.sample(rows, Generation(n=3, max_new_tokens=6))
    assert len(r) == 3 and len(r.samples) == 3 and r.rollout_logprobs is None  # not asked
    assert {(s.prompt, s.ground_truth, s.data_source) for s in r.samples} == {("1 + 2 =", "3", "sums")}
    texts = tok.batch_decode(r.responses, skip_special_tokens=True)
    assert [s.response for s in r.samples] == texts
    assert [len(s.response_ids) for s in r.samples] == r.response_lengths.tolist()
    engine = NativeEngine(policy, tok, [], logprobs=True)  # the trainer asks when it reads them
    r = engine.sample(rows, Generation(n=3, max_new_tokens=6))
    lp, mask = r.rollout_logprobs, r.response_mask
    assert lp.shape == mask.shape and (lp[mask] < 0).all() and (lp[~mask] == 0).all()
    assert (r.entropy[mask] > 0).all() and (r.entropy[~mask] == 0).all()  # pi_old's, as sampled


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
    from vapo_lightning.engines.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the engine's memory logic without vLLM
    engine.llm, engine.options, engine.on_gpu = FakeLLM(), VLLMOptions(), True
    engine.asleep, engine.weights_stale, engine.policy = set(), False, "policy"
    loads = []

    def load_weights(self, policy):  # the real one's wake-up and bookkeeping, no copy
        loads.append(policy)
        with self._awake(("weights",)):
            self.weights_stale = False

    monkeypatch.setattr(VLLMEngine, "load_weights", load_weights)

    engine.release(keep_weights=True)  # value pretraining: the weights survive (offloaded)
    assert engine.llm.calls == [("sleep", 1)] and not engine.weights_stale
    assert not engine.sync() and loads == []  # same policy, weights kept: nothing to load
    with engine._awake():
        pass
    assert engine.llm.calls[-1] == ("wake_up", ("kv_cache", "weights")) and not engine.asleep

    engine.release(keep_weights=False)  # the actor will update: the weights are dropped (level 2)
    assert engine.llm.calls[-1] == ("sleep", 2) and engine.weights_stale
    # Even if the update is skipped (a non-finite gradient: no `policy_changed`), the next
    # rollout reloads: dropped weights are never sampled from.
    assert engine.sync() and loads == ["policy"]
    assert engine.llm.calls[-1] == ("wake_up", ("weights",)) and engine.asleep == {"kv_cache"}
    assert not engine.sync()
    engine.policy_changed()
    assert engine.sync() and len(loads) == 2  # a new policy always loads

    engine.on_gpu, engine.asleep = False, set()  # CPU backend: no sleep mode
    calls = len(engine.llm.calls)
    engine.release(keep_weights=False)
    assert len(engine.llm.calls) == calls and not engine.asleep


def test_rewards_read_the_response_without_special_tokens(tmp_path):
    """The EOS that ends a response (and the padding after it, here the same token, as in
    SmolLM2) is in its ids, not in the text a reward parses: "The answer is 5</s>" would not
    read as 5 by every reward."""
    from transformers import AutoTokenizer

    from vapo_lightning.engines.base import samples_of
    from vapo_lightning.rollout import Rollout

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    answer = tok("What is 2 + 3? 2 + 3 = 5", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    prompt, response = torch.tensor([[7, 8]]), torch.tensor([[*answer, eos, eos, eos]])
    mask = torch.arange(response.shape[1])[None] <= len(answer)
    r = Rollout(
        input_ids=torch.cat([prompt, response], 1),
        attention_mask=torch.cat([torch.ones_like(prompt), mask.long()], 1),
        response_mask=mask,
        group_ids=torch.tensor([0]),
        truncated=torch.tensor([False]),
    )
    (sample,) = samples_of(r, [{"prompt_text": "p", "ground_truth": "5"}], tok)
    assert sample.response == "What is 2 + 3? 2 + 3 = 5"
    assert sample.response_ids == [*answer, eos]


def test_the_weight_sync_hands_the_engine_its_own_dtype():
    """A bf16 engine receives bf16 tensors (cast before an FSDP gather: half the bytes), each
    the fp32 weight rounded as the engine's own load would round it; without a dtype, the
    weights as they are."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vapo_lightning.engines.vllm import named_full_tensors

    cfg = dict(TINY_LLAMA)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    state = model.state_dict()
    sent = dict(named_full_tensors(model, torch.bfloat16))
    assert sent.keys() == state.keys()
    for name, tensor in sent.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16)), name
    assert all(t.dtype == torch.float32 for _, t in named_full_tensors(model))
