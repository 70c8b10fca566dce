"""`--trainer.strategy=ddp|fsdp` on CPU with 2 processes (gloo), as real subprocesses.

Lightning launches the second rank by re-running the command line, so every run here is a
`python -m ...` subprocess: the `vapo` CLI on configs/tiny_cpu.yaml (shortened),
tests/distributed/distributed_worker.py for the parity test (one update on a fixed global batch), or
tests/distributed/load_worker.py for loading a checkpoint on rank 0 only.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import (
    ROOT,
    SHORT,
    TINY_LLAMA,
    build_tokenizer,
    make_rows,
    print_config,
    run_module,
    vapo_fit,
    version_scalars,
    write_jsonl,
)


def is_dcp_folder(path: Path) -> bool:
    """A sharded checkpoint: a folder with DCP metadata and one shard file per rank."""
    shards = sorted(p.name for p in path.glob("*.distcp"))
    return path.is_dir() and (path / ".metadata").exists() and shards == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_cli_ddp_trains_on_two_processes(tmp_path):
    vapo_fit(tmp_path, "ddp", "--trainer.max_steps=3")  # 2 warm-up steps, then the actor
    (version,) = glob.glob(f"{tmp_path}/lightning_logs/version_*")  # one run, one log
    logged = version_scalars(Path(version))
    assert logged["rollout_step"] == [1.0, 2.0, 3.0]
    assert logged["warmup/active"] == [1.0, 1.0, 0.0]
    assert len(logged["actor/grad_norm"]) == 1 and 0 < logged["actor/grad_norm"][0] < 1e3
    assert all(0 < g < 1e3 for g in logged["critic/grad_norm"])
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()  # one file: every rank holds it all


@pytest.mark.slow
def test_cli_ddp_resumes_and_reproduces_the_uninterrupted_run(tmp_path):
    """Stopped after 2 rollout steps and resumed for the third: the same weights and the same
    logged step as 3 uninterrupted steps (each rank's random stream and data position are in
    the checkpoint)."""
    vapo_fit(tmp_path / "full", "ddp", "--trainer.max_steps=3")
    vapo_fit(tmp_path / "part", "ddp", "--trainer.max_steps=2")
    vapo_fit(tmp_path / "part", "ddp", "--trainer.max_steps=3", "--ckpt_path=last")
    full, part = (
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False) for run in ("full", "part")
    )
    assert full["global_step"] == part["global_step"] == 3
    assert full["state_dict"].keys() == part["state_dict"].keys()
    for name, value in full["state_dict"].items():
        assert torch.equal(value, part["state_dict"][name]), name
    (version,) = glob.glob(f"{tmp_path}/full/lightning_logs/version_*")
    resumed = sorted(glob.glob(f"{tmp_path}/part/lightning_logs/version_0/events.out.tfevents.*"))[-1]
    acc = EventAccumulator(resumed)
    acc.Reload()
    expected = version_scalars(Path(version))
    for tag in ("actor/pg_loss", "critic/vf_loss", "response_length/mean", "reward"):
        assert [e.value for e in acc.Scalars(tag)] == expected[tag][-1:], tag


EXIT_PROBE = """
import atexit, glob
import lightning as L
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.distributed.fsdp import fully_shard
from vapo_lightning.distributed import VAPOStrategy

class Model(BoringModel):
    def configure_model(self):  # DTensor parameters: DTensor's caches then hold the mesh
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

def gloo_threads():
    return sorted(n for n in (open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm"))
                  if "gloo" in n)

# Registered before the strategy's handler, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("at exit:", dist.is_initialized(), gloo_threads(), flush=True))

def main():  # as the CLI runs it: the trainer and the model are gone when main returns
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=VAPOStrategy(mode="fsdp"),
                        max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())
    print("after fit:", dist.get_backend(), len(gloo_threads()) > 0, flush=True)

main()
"""


@pytest.mark.slow
def test_the_gloo_process_group_is_destroyed_before_the_interpreter_exits(tmp_path):
    """Lightning registers the group's destruction at exit for NCCL only; a gloo group left to
    the interpreter's finalisation aborted a finished 2-rank run now and then (exit -6). After
    `destroy_process_group`, the meshes that DTensor's caches keep alive still hold the groups
    and their threads: at exit, no gloo thread may be left."""
    script = tmp_path / "probe.py"
    script.write_text(EXIT_PROBE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after fit: gloo True" in done.stdout, done.stdout
    assert "at exit: False []" in done.stdout, done.stdout


@pytest.mark.slow
def test_cli_fsdp_resumes_from_a_sharded_checkpoint_and_exports_full_weights(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    vapo_fit(tmp_path, "fsdp", "--trainer.max_steps=2")
    logs = tmp_path / "lightning_logs"
    assert version_scalars(logs / "version_0")["rollout_step"] == [1.0, 2.0]
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert is_dcp_folder(ckpt)

    export = tmp_path / "export"
    vapo_fit(tmp_path, "fsdp", "--trainer.max_steps=3", "--ckpt_path=last", f"--model.hf_export_dir={export}")
    logged = version_scalars(logs / "version_1")
    assert logged["rollout_step"] == [3.0]  # continues at the third rollout step
    assert logged["warmup/active"] == [0.0]  # the 2 warm-up steps were done before

    # The export holds the gathered full weights: those of the final sharded checkpoint.
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")  # written at step 3
    state = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]
    policy = AutoModelForCausalLM.from_pretrained(export / "policy")
    critic = AutoModelForTokenClassification.from_pretrained(export / "critic")
    assert json.loads((export / "policy" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for prefix, model in [("policy.", policy), ("critic.", critic)]:
        for name, p in model.state_dict().items():
            torch.testing.assert_close(p, state[prefix + name], rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(export / "policy")
    ids = tokenizer(["Evaluate left to right: 2 + 3"], return_tensors="pt")
    out = policy.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]

    # `vapo export` reads the sharded folder in one process: the run's own export, exactly.
    from vapo_lightning.export import export_checkpoint

    export_checkpoint(ckpt, tmp_path / "from_ckpt")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "from_ckpt" / "policy")
    for name, p in policy.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], p, rtol=0, atol=0)


@pytest.mark.slow
def test_a_sharded_save_that_fails_on_one_rank_leaves_the_last_one_whole(tmp_path):
    """Saves every step; rank 1's writes fail from step 3 on: the run stops at that save with
    an error on every rank (no hang), `last.ckpt` still points at step 2's complete save, and a
    run resumed from it goes on at step 3."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vapo_lightning.cli",
            "fit",
            "-c",
            "configs/tiny_cpu.yaml",
            "--trainer.devices=2",
            "--trainer.strategy=fsdp",
            f"--trainer.default_root_dir={tmp_path}",
            *SHORT,
            "--trainer.max_steps=4",
            "--trainer.callbacks+=tests.helpers.FailingSaveOnRank1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "failed to save; the previous save is kept" in done.stderr, done.stderr[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and is_dcp_folder(last)
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "last.ckpt.saves").iterdir()) == ["1", "2"]
    vapo_fit(tmp_path, "fsdp", "--trainer.max_steps=3", "--ckpt_path=last")
    (version,) = [v for v in (tmp_path / "lightning_logs").iterdir() if v.name != "version_0"]
    assert version_scalars(version)["rollout_step"] == [3.0]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "precision"), [("ddp", "32-true"), ("fsdp", "32-true"), ("fsdp", "bf16-mixed")])
def test_cli_lora_trains_resumes_and_exports_merged_weights_on_two_processes(tmp_path, strategy, precision):
    """LoRA on policy and critic under ddp / fsdp, on a base from a folder: the run trains and
    resumes from its checkpoint (ddp's leaves the base out, fsdp's keeps it), and the exported
    policy is the base + (alpha / r) B A of the checkpoint's adapters. Under bf16-mixed the
    frozen bases are bf16 beside fp32 adapters in one FSDP group, and so is the export."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    sft = [
        "--model.policy.config=null",
        "--model.policy.name_or_path=vapo_lightning/assets/quickstart_sft",
        "--model.policy.tokenizer=null",
    ]  # a base from a folder: ddp checkpoints leave it out
    lora = ['--model.policy.lora={"r": 4, "alpha": 8}', "--model.algorithm.kl_coef=0.05", *sft]
    lora.append(f"--trainer.precision={precision}")
    vapo_fit(tmp_path, strategy, "--trainer.max_steps=3", *lora)  # 2 warm-up steps, then the actor
    logged = version_scalars(tmp_path / "lightning_logs" / "version_0")
    assert len(logged["actor/grad_norm"]) == 1 and 0 < logged["actor/grad_norm"][0] < 1e3
    export = tmp_path / "export"
    vapo_fit(tmp_path, strategy, "--trainer.max_steps=4", "--ckpt_path=last", f"--model.hf_export_dir={export}", *lora)
    newest = max(glob.glob(f"{tmp_path}/lightning_logs/version_*/events.out.tfevents.*"), key=os.path.getmtime)
    acc = EventAccumulator(newest)  # the resumed run's (ddp logs on in version_0)
    acc.Reload()
    assert [e.value for e in acc.Scalars("rollout_step")] == [4.0]

    last = tmp_path / "checkpoints" / "last.ckpt"  # step 4: ddp one file, fsdp a DCP folder
    if last.is_dir():
        dcp_to_torch_save(last, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt" if last.is_dir() else last, weights_only=False)["state_dict"]
    inner = "policy.base_model.model."
    assert (f"{inner}model.embed_tokens.weight" in state) == (strategy == "fsdp")
    base = AutoModelForCausalLM.from_pretrained(ROOT / "vapo_lightning/assets/quickstart_sft").state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export / "policy").state_dict()
    merged = 0
    for name, value in exported.items():
        layer = name.removesuffix(".weight")
        if f"{inner}{layer}.lora_A.default.weight" in state:
            a, b = state[f"{inner}{layer}.lora_A.default.weight"], state[f"{inner}{layer}.lora_B.default.weight"]
            expected = base[name] + 2.0 * b @ a
            assert b.abs().max() > 0, name  # the adapter learned
            merged += 1
        else:
            expected = base[name]
        if precision == "bf16-mixed":  # the base in bf16, the sum rounded to it
            expected = (base[name].to(torch.bfloat16) + (expected - base[name])).to(torch.bfloat16)
        assert value.dtype == expected.dtype, name
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    layers = json.loads((ROOT / "vapo_lightning/assets/quickstart_sft/config.json").read_text())["num_hidden_layers"]
    assert merged == layers * 7  # every layer's q, k, v, o, gate, up, down


@pytest.mark.slow
def test_fsdp_loads_on_rank_0_only_and_every_rank_gets_the_single_process_weights(tmp_path):
    """A saved tiny Llama (tied embeddings) loaded under fsdp on 2 ranks: rank 0 calls
    `from_pretrained`, rank 1 builds on the meta device and receives rank 0's weights into its
    shards. Each rank's gathered weights, its rotary buffers (not in the state dict) and one
    sharded greedy `generate` equal a single-process load; the critic (the policy's backbone
    and a fresh value head, seed 0 as in the worker) too. The ranks' greedy responses from
    our sampler, two prompts on rank 0 and one on rank 1 at one sequence per call, equal the
    single process's, with the weights gathered once per rollout and with them left sharded
    (rank 1 then makes a dummy call so that the run does not hang)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.distributed.load_worker import PROMPTS, greedy_tokens, uneven_config, uneven_prompts
    from vapo_lightning.engines.native import generate
    from vapo_lightning.models import ModelSpec, build_critic, build_policy, load_tokenizer

    ckpt = tmp_path / "ckpt"
    tok = load_tokenizer(str(build_tokenizer(ckpt)))
    cfg = LlamaConfig(
        **{k: v for k, v in TINY_LLAMA.items() if k != "model_type"},
        vocab_size=len(tok),
        tie_word_embeddings=True,
        initializer_range=0.5,  # at HF's 0.02 greedy decoding repeats the last prompt token
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(ckpt)
    out = tmp_path / "out"
    out.mkdir()
    run_module("tests.distributed.load_worker", str(out), str(ckpt), "2")

    torch.manual_seed(0)  # the worker's seed: the critic's fresh head draws the same numbers
    policy = build_policy(ModelSpec(name_or_path=str(ckpt)), tok)
    critic = build_critic(None, policy, tok)
    expected_tokens = greedy_tokens(policy, tok.pad_token_id)
    uneven = uneven_config(policy, tok)
    expected_uneven = [
        generate(policy, uneven_prompts(r), uneven, tok.pad_token_id, tok.eos_token_id) for r in range(2)
    ]
    # rank 0's second prompt decodes longer than the first prompt (rank 1's only one)
    lengths = [r.response_mask.sum(-1).tolist() for r in expected_uneven]
    assert lengths[1] == [2] and lengths[0][0] == 2 and lengths[0][1] > 2, lengths
    expected_uneven = [r.responses for r in expected_uneven]
    generated = expected_tokens[:, max(map(len, PROMPTS)) :]
    assert generated.shape[1] > 1 and len(generated.unique()) > 4  # varied tokens, not one repeated
    with torch.no_grad():
        expected_values = critic(input_ids=torch.tensor([PROMPTS[0]])).logits
    buffers = {f"policy.{k}": b for k, b in policy.named_buffers()}
    buffers |= {f"critic.{k}": b for k, b in critic.named_buffers()}
    assert any("rotary_emb.inv_freq" in k for k in buffers)
    full = sum(p.numel() for m in (policy, critic) for p in m.parameters())

    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, got in enumerate(ranks):
        for name, model in [("policy", policy), ("critic", critic)]:
            expected = model.state_dict()
            assert got[name].keys() == expected.keys(), (rank, name)
            for key, tensor in expected.items():
                torch.testing.assert_close(got[name][key], tensor, rtol=0, atol=0, msg=key)
        assert got["buffers"].keys() == buffers.keys()
        for key, tensor in buffers.items():
            torch.testing.assert_close(got["buffers"][key], tensor, rtol=0, atol=0, msg=key)
        assert got["tied"]
        assert torch.equal(got["tokens"], expected_tokens), rank
        for gather in (False, True):
            responses = got[f"uneven_responses_gather_{gather}"]
            assert torch.equal(responses, expected_uneven[rank]), (rank, gather)
        # Gathered once per rollout: one all-gather per FSDP unit (2 layers + root), however
        # many tokens; left sharded: one per unit per forward, the same count on both ranks.
        units = got["fsdp_units"]
        assert units == 3 and got["all_gathers_gather_True"] == units
        per_step = got["all_gathers_gather_False"]
        assert per_step % units == 0 and per_step >= 8 * units, per_step
        assert per_step == ranks[0]["all_gathers_gather_False"]
        assert got["sharded_after"]  # the gathered weights were freed after sampling
        assert got["failed_inside"] and got["sharded_after_error"]
        assert torch.equal(got["responses_after_error"], expected_uneven[rank])
        torch.testing.assert_close(got["values"], expected_values, rtol=1e-6, atol=1e-7)
        assert 0 < got["local_numel_after_sharding"] < 0.6 * full  # about half: shards only

    # Rank 0 read the checkpoint once (the critic copies the policy's backbone) and held full
    # weights; rank 1 never called from_pretrained and held no parameter off the meta device
    # before sharding (policy, critic).
    assert ranks[0]["from_pretrained_calls"] == ["LlamaForCausalLM"]
    assert ranks[0]["numel_before_sharding"] == [sum(p.numel() for p in m.parameters()) for m in (policy, critic)]
    assert ranks[1]["from_pretrained_calls"] == []
    assert ranks[1]["numel_before_sharding"] == [0, 0]


@pytest.fixture(scope="module")
def parity_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    tok = build_tokenizer(root / "tok")
    train = write_jsonl(root / "train.jsonl", make_rows(32))
    return root, str(train), str(tok)


def one_update(parity_inputs, strategy: str, devices: int, *flags: str):
    root, train, tok = parity_inputs
    out = root / "-".join([strategy, *flags]).replace("--", "")
    if not (out / "weights.pt").exists():
        out.mkdir(exist_ok=True)
        run_module("tests.distributed.distributed_worker", str(out), train, tok, strategy, str(devices), *flags)
    metrics = json.loads((out / "metrics.json").read_text())
    return torch.load(out / "weights.pt"), metrics


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_update_like_one_process_on_the_same_global_batch(parity_inputs, strategy):
    """One critic and one actor AdamW step (lr 1e-3) on the same 8 prompts x 4 responses.

    Tolerance 1e-5 on parameters: AdamW's first step moves each weight by about lr = 1e-3
    whatever the gradient's scale, so sums taken in another order (micro-batches split
    differently, two partial sums all-reduced) only move weights whose gradient is near
    Adam's eps; measured differences are <= 2e-6. The same runs with per-rank normalisers
    (the negative control below) differ by 2e-3. AdamW ignores a uniform gradient scale, so
    the global gradient norms before clipping, and the losses, are compared too (rtol 1e-5).
    """
    ref, ref_metrics = one_update(parity_inputs, "single", 1)
    got, metrics = one_update(parity_inputs, strategy, 2)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    for key in [
        "critic/grad_norm",
        "actor/grad_norm",
        "critic/vf_loss",
        "actor/nll_loss",
        "actor/entropy",
        "rollout/accuracy",
        "response_length/mean",
    ]:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_two_ranks_update_like_one_eager_process(parity_inputs, strategy):
    """`torch_compile=True` under ddp / fsdp (the models compiled after `parallelize`, hooks
    included): the same step as the eager single process. Losses and gradient norms at rel
    1e-4, as in tests/trainer/test_compile.py (compiled kernels sum in another order; measured here:
    equal to 1.2e-7). Parameters at 3e-5, 1/70 of the negative control's 2e-3: AdamW's first
    step turns a float-order difference in a gradient near its eps into a visible one, and
    one weight of 2,048 in one matrix moved 1.09e-5 more here (shared-prompt forwards, whose
    attention sums run over a prompt and 4 answers; the rest within 1e-5)."""
    ref, ref_metrics = one_update(parity_inputs, "single", 1)
    got, metrics = one_update(parity_inputs, strategy, 2, "--compile")
    assert metrics["dynamo_graphs"] >= 2  # both models' forwards ran compiled
    assert ref_metrics["dynamo_graphs"] == 0
    assert got.keys() == ref.keys()  # no `_orig_mod.` or other renamed parameters
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=3e-5, msg=lambda m, name=name: f"{name}: {m}")
    for key in [
        "critic/grad_norm",
        "actor/grad_norm",
        "critic/vf_loss",
        "actor/nll_loss",
        "actor/entropy",
        "response_length/mean",
    ]:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4), key


@pytest.mark.slow
def test_parity_check_fails_when_normalisers_are_per_rank(parity_inputs):
    ref, _ = one_update(parity_inputs, "single", 1)
    got, _ = one_update(parity_inputs, "ddp", 2, "--local-normalisers")
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst > 1e-4  # 100x the parity tolerance: the test above can fail


GPU_CONFIGS = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.name for p in GPU_CONFIGS])
def test_gpu_configs_parse_and_keep_the_papers_global_batch(path):
    cfg = print_config("fit", "-c", str(path))  # parses only: no model is downloaded
    trainer, model, data = cfg["trainer"], cfg["model"], cfg["data"]
    assert trainer["strategy"]["class_path"] == "vapo_lightning.distributed.VAPOStrategy"
    assert trainer["strategy"]["init_args"]["mode"] == "fsdp"
    assert trainer["strategy"]["init_args"]["activation_checkpointing"] is True
    assert trainer["precision"] == "bf16-mixed" and trainer["accelerator"] == "gpu"
    ranks = trainer["devices"] * trainer["num_nodes"]
    assert trainer["devices"] == 8
    # §5.1: 512 prompts x 16 samples per rollout, mini-batches of 512 responses.
    assert ranks * data["prompts_per_step"] == 512 and model["generation"]["n"] == 16
    assert ranks * model["algorithm"]["mini_batch_size"] == 512
    assert (model["optim"]["actor_lr"], model["optim"]["critic_lr"]) == (1e-6, 2e-6)
    algo = model["algorithm"]
    assert (algo["clip_low"], algo["clip_high"], algo["nll_coef"]) == (0.2, 0.28, 0.1)


@pytest.mark.slow
def test_fsdp_fit_with_a_threshold_the_critic_view_micro_batches_and_a_save_every_step(tmp_path):
    """Every collective entered by every rank: value pretraining ended by its explained-
    variance threshold (decided over both ranks' tokens), the critic view at validation (the
    sharded critic run on every rank), micro-batches smaller than the mini-batch and a
    sharded checkpoint every step; the run finishes (a rank left waiting would hang it)."""
    layer = tmp_path / "layer.yaml"
    layer.write_text(
        json.dumps(
            {
                "trainer": {
                    "callbacks": [
                        {"class_path": "tests.helpers.ParityReward"},  # rewards that vary: a defined explained variance
                        {
                            "class_path": "vapo_lightning.callbacks.ValuePretraining",
                            "init_args": {"steps": 3, "explained_variance_threshold": -1e9},
                        },
                        {"class_path": "vapo_lightning.critic_view.CriticView", "init_args": {"k": 2}},
                        {
                            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                            "init_args": {"save_last": True, "every_n_train_steps": 1, "save_top_k": 0},
                        },
                    ]
                }
            }
        )
    )
    vapo_fit(
        tmp_path,
        "fsdp",
        "-c",
        str(layer),
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=2",
        "--model.algorithm.micro_batch_size=4",
        "--data.val_batch_size=8",
    )
    logged = version_scalars(tmp_path / "lightning_logs" / "version_0")
    assert logged["warmup/active"] == [1.0, 0.0, 0.0]  # the threshold ended it after one step
    assert len(logged["actor/pg_loss"]) == 2
    assert (tmp_path / "critic_view" / "critic_view.md").read_text().count("### step 2, response") == 2
    assert is_dcp_folder(tmp_path / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_fsdp_fit_with_dapo_dynamic_sampling(tmp_path):
    """DAPO's extra sampling rounds under fsdp: the ranks agree each round whether any still
    needs responses (a sum over ranks, on the module's device) and end with equal batches."""
    vapo_fit(
        tmp_path,
        "fsdp",
        "-c",
        "configs/baselines/dapo.yaml",
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=tests.helpers.ParityReward",
    )
    logged = version_scalars(tmp_path / "lightning_logs" / "version_0")
    assert logged["rollout_step"] == [1.0, 2.0]
    assert all(n >= 32 for n in logged["rollout/responses_sampled"])  # 2 ranks × 4 prompts × 4, or more rounds
