"""SFT warm start: response-only labels, a short run lowers the loss, the export reloads."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from vapo_lightning.sft import IGNORE_INDEX, SFTDataModule, SFTModule, chat_prompt, sft_main
from vapo_lightning.tasks import arithmetic
from vapo_lightning.tokenization import train_bpe

ROOT = Path(__file__).resolve().parents[2]
TINY = {"num_layers": 1, "hidden_size": 64, "intermediate_size": 128, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SFTDataModule:
    folder = tmp_path_factory.mktemp("arith")
    train, val = arithmetic.make_splits(64, 8, seed=7)
    arithmetic.write_jsonl(train, folder / "train.jsonl")
    arithmetic.write_jsonl(val, folder / "val.jsonl")
    return SFTDataModule(
        val_path=str(folder / "val.jsonl"),
        rl_train_path=str(folder / "train.jsonl"),
        num_train=512,
        batch_size=16,
        val_batch_size=8,
    )


def test_sft_problems_exclude_rl_and_val_prompts(data):
    rl = arithmetic.make_splits(64, 8, seed=7)[0]
    held_out = {r["prompt"] for r in data.val_rows + rl}
    assert len(held_out) == 72 and not held_out & {r["prompt"] for r in data.train_rows}
    assert len(data.train_rows) == 512


def test_answer_only_fraction_replaces_the_working_of_that_share():
    mixed = SFTDataModule(val_path=None, num_train=600, answer_only_fraction=0.3)
    plain = SFTDataModule(val_path=None, num_train=600)
    assert [r["prompt"] for r in mixed.train_rows] == [r["prompt"] for r in plain.train_rows]
    bare = 0
    for m, p in zip(mixed.train_rows, plain.train_rows):
        if m["solution"] == f"\\boxed{{{p['answer']}}}":
            bare += 1
        else:
            assert m == p  # untouched rows keep their worked solution
        assert arithmetic.is_correct(m["solution"], p["answer"])
    assert 0.23 < bare / 600 < 0.37  # 0.30 within 3.7 standard errors
    with pytest.raises(ValueError, match="answer_only_fraction must be in"):
        SFTDataModule(num_train=10, answer_only_fraction=1.5)
    with pytest.raises(ValueError, match="no answer-only form"):
        SFTDataModule(task="functions", num_train=10, answer_only_fraction=0.5)


def test_labels_cover_exactly_the_response_and_eos(data):
    batch = data._collate_train(data.train_examples[:4])
    tok = data.tokenizer
    for i, (prompt_ids, response_ids, _) in enumerate(data.train_examples[:4]):
        labels = batch["labels"][i]
        kept = labels[labels != IGNORE_INDEX].tolist()
        assert kept == response_ids and kept[-1] == tok.eos_token_id
        # Prompt positions (and right padding) carry no label.
        assert (labels[: len(prompt_ids)] == IGNORE_INDEX).all()
        text = tok.decode(prompt_ids + response_ids, skip_special_tokens=True)
        assert text == chat_prompt(tok, data.train_rows[i]["prompt"]) + " " + data.train_rows[i]["solution"]


def test_rows_without_observations_encode_as_one_text(data):
    """Arithmetic has no tool observations: the tokenizer is the BPE of prompts + solutions and
    each response is ``" " + solution`` tokenized at once, labelled in full."""
    rows = data.train_rows
    ref = train_bpe([r["prompt"] for r in rows] + [r["solution"] for r in rows], vocab_size=512)
    assert data.tokenizer.get_vocab() == ref.get_vocab()
    assert data.tokenizer.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    tok = data.tokenizer
    for row, example in zip(rows, data.train_examples):
        prompt = tok(chat_prompt(tok, row["prompt"]), add_special_tokens=False)["input_ids"]
        response = [*tok(" " + row["solution"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
        assert example == (prompt, response, response)


@pytest.mark.slow
def test_short_run_lowers_the_loss_and_export_reloads(data, tmp_path):
    L.seed_everything(0)
    module = SFTModule(
        tokenizer=data.tokenizer, lr=3e-3, warmup_steps=5, num_samples=2, export_dir=str(tmp_path / "export"), **TINY
    )
    probe = data._collate_train(data.train_examples[:32])
    with torch.no_grad():
        before = module._response_loss(probe).item()
    trainer = L.Trainer(
        max_steps=25,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=25,
        check_val_every_n_epoch=None,
    )
    trainer.fit(module, datamodule=data)
    with torch.no_grad():
        after = module._response_loss(probe).item()
    assert after < 0.7 * before, (before, after)

    export = tmp_path / "export"
    assert (export / "model.safetensors").exists() and (export / "eval.json").exists()
    model = LlamaForCausalLM.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.padding_side == "left" and tok.eos_token_id == data.tokenizer.eos_token_id
    ids = data._collate_train(data.train_examples[:4])
    torch.testing.assert_close(
        model(input_ids=ids["input_ids"]).logits, module.model(input_ids=ids["input_ids"]).logits
    )
    prompts = tok([chat_prompt(tok, r["prompt"]) for r in data.val_rows[:3]], padding=True, return_tensors="pt")
    out = model.generate(**prompts, max_new_tokens=12, do_sample=False)
    assert out.shape[0] == 3 and out.shape[1] > prompts["input_ids"].shape[1]


def test_left_padded_greedy_matches_unpadded(data):
    """Generation in a left-padded batch gives each prompt's own greedy continuation."""
    torch.manual_seed(0)
    module = SFTModule(tokenizer=data.tokenizer, **TINY).eval()
    tok = data.tokenizer
    rows = [r for r in data.val_rows if r["difficulty"] in (1, 6)][:2]
    batch = tok([chat_prompt(tok, r["prompt"]) for r in rows], padding=True, return_tensors="pt")
    assert (batch["attention_mask"][:, 0] == 0).any()  # some left padding happened
    together = module.generate(batch["input_ids"], batch["attention_mask"], do_sample=False)
    for i, r in enumerate(rows):
        alone = tok([chat_prompt(tok, r["prompt"])], return_tensors="pt")
        assert module.generate(alone["input_ids"], alone["attention_mask"], False)[0] == together[i]


@pytest.mark.slow
def test_cli_runs_the_shipped_config(tmp_path):
    """`sft_main` parses configs/quickstart_sft.yaml and trains / exports a tiny variant."""
    overrides = [f"--model.{k}={v}" for k, v in TINY.items()]
    sft_main(
        [
            "-c",
            str(ROOT / "configs" / "quickstart_sft.yaml"),
            *overrides,
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=1",
            "--data.num_train=96",
            "--data.val_batch_size=8",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
            f"--model.export_dir={tmp_path / 'export'}",
        ]
    )
    assert (tmp_path / "export" / "config.json").exists()
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*"))


def test_init_std_sets_the_initial_weights(data):
    for std in (0.02, 0.05):
        torch.manual_seed(0)
        module = SFTModule(tokenizer=data.tokenizer, init_std=std, **TINY)
        weight = module.model.model.layers[0].mlp.up_proj.weight
        assert abs(weight.std().item() - std) < 0.1 * std
