"""The credit-assignment task (`vapo_lightning.tasks.digitwise`): answers against a slow
reference, seeded disjoint splits, the verifier, slips in demonstrations, response lengths,
and its reward callback."""

from __future__ import annotations

import random

import pytest
import torch

from vapo_lightning.core import length_adaptive_lam
from vapo_lightning.sft import SFTDataModule
from vapo_lightning.tasks import digitwise as D
from vapo_lightning.tokenization import train_bpe


def reference_answer(prompt: str) -> str:
    """Digit i of the answer is (x_i + y_i) mod 10, read from the prompt by splitting."""
    pairs = prompt.split(": ", 1)[1].split()
    assert [p[0] for p in pairs] == list("abcdefghijklmnopqrstuvwxyz"[: len(pairs)])
    return "".join(str((int(p[1]) + int(p[2])) % 10) for p in pairs)


def test_answers_solutions_and_difficulty_match_the_reference():
    rows = D.generate(400, seed=3)
    assert {r["difficulty"] for r in rows} == set(range(D.MIN_DIGITS, D.MAX_DIGITS + 1))
    for r in rows:
        assert r["answer"] == reference_answer(r["prompt"]) and len(r["answer"]) == r["difficulty"]
        assert D.is_correct(r["solution"], r["answer"])
        assert D.pairs("User: " + r["prompt"] + "\nAssistant:") == D.pairs(r["prompt"])
        found = D.steps(r["solution"])
        assert "".join(str(z) for *_, z in found) == r["answer"] and len(found) == r["difficulty"]


def test_generation_is_seeded_and_splits_are_disjoint():
    assert D.generate(50, seed=1) == D.generate(50, seed=1) != D.generate(50, seed=2)
    train, val = D.make_splits(300, 60, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 300
    with pytest.raises(ValueError, match="difficulty"):
        D.make_problem(random.Random(0), D.MAX_DIGITS + 1)


def test_the_verifier_wants_every_step_and_nothing_else():
    row = D.make_problem(random.Random(5), 6)
    right = row["solution"]
    assert D.is_correct(right, row["answer"]) and D.is_correct("  " + right + "\n", row["answer"])
    last = right[:-1] + str((int(right[-1]) + 1) % 10)
    assert not D.is_correct(last, row["answer"])  # one wrong digit in the last step
    first = right.replace("=" + row["answer"][0], "=" + str((int(row["answer"][0]) + 1) % 10), 1)
    assert not D.is_correct(first, row["answer"])  # ... or in the first
    assert not D.is_correct(right.rsplit(" f)", 1)[0], row["answer"])  # a step missing
    assert not D.is_correct(right + " the end", row["answer"])  # anything else
    assert not D.is_correct(right.replace("b)", "c)", 1), row["answer"])  # labels out of order
    assert D.check([right, "nothing"], [row, row]) == [True, False]


def test_slips_are_local_and_at_the_asked_rate():
    rng, rows = random.Random(0), D.generate(600, seed=4)
    slipped = steps = 0
    for r in rows:
        demo = D.with_slips(r, rng, 0.1)
        got, want = D.steps(demo["solution"]), D.steps(r["solution"])
        assert [g[:3] for g in got] == [w[:3] for w in want]  # labels and operands are never wrong
        wrong = sum(g[3] != w[3] for g, w in zip(got, want))
        slipped, steps = slipped + wrong, steps + len(want)
        assert D.is_correct(demo["solution"], r["answer"]) == (wrong == 0)
    assert 0.085 < slipped / steps < 0.115
    assert D.with_slips(rows[0], rng, 0.0) == rows[0]


def test_response_lengths_span_the_length_adaptive_lambda():
    """A few tokens to a few hundred with the project's BPE: 8 tokens per step plus EOS,
    lambda_actor (alpha 0.05) from 0 at K = 2 to 0.90 at K = 26."""
    rows = D.generate(600, seed=6, distinct=False)
    tok = train_bpe([r["prompt"] for r in rows] + [r["solution"] for r in rows])
    by_k = {}
    for r in rows:
        by_k[r["difficulty"]] = len(tok(" " + r["solution"])["input_ids"]) + 1  # + EOS
    assert by_k == {k: 8 * k + 1 for k in by_k}
    lam = length_adaptive_lam(torch.tensor([by_k[D.MIN_DIGITS], by_k[D.MAX_DIGITS]]), 0.05)
    assert lam[0] == 0 and 0.89 < lam[1] < 0.91


def test_sft_demonstrations_slip_at_the_configured_rate():
    clean = SFTDataModule(task="digitwise", num_train=400)
    noisy = SFTDataModule(task="digitwise", num_train=400, slip_rate=0.2)
    assert [r["prompt"] for r in clean.train_rows] == [r["prompt"] for r in noisy.train_rows]
    assert all(D.is_correct(r["solution"], r["answer"]) for r in clean.train_rows)
    wrong = sum(not D.is_correct(r["solution"], r["answer"]) for r in noisy.train_rows)
    assert 0.5 < wrong / 400 < 0.95  # 1 - 0.8^K over K = 2..26
    with pytest.raises(ValueError, match="no demonstrations with slips"):
        SFTDataModule(task="arithmetic", num_train=10, slip_rate=0.1)
    with pytest.raises(ValueError, match="slip_rate must be in"):
        SFTDataModule(task="digitwise", num_train=10, slip_rate=1.0)


def test_the_reward_scores_with_the_verifier_and_flags_bad_ground_truth():
    from vapo_lightning.rewards import DigitwiseReward, Sample, SampleError

    row = D.make_problem(random.Random(2), 5)
    reward = DigitwiseReward()
    sample = lambda response, truth=row["answer"]: Sample(  # noqa: E731
        prompt=row["prompt"], response=response, response_ids=[1], truncated=False, ground_truth=truth
    )
    wrong = row["solution"][:-1] + str((int(row["solution"][-1]) + 1) % 10)
    got = reward.score([sample(row["solution"]), sample(wrong), sample(""), sample(row["solution"], None)])
    assert got[:3] == [1.0, -1.0, -1.0] and isinstance(got[3], SampleError)
    assert reward.correct_threshold == 0.0
    with pytest.raises(ValueError, match="greater"):
        DigitwiseReward(correct_reward=0, wrong_reward=0)


def test_the_role_probe_splits_the_loss_by_what_each_token_is():
    """benchmarks/probes/probe_digitwise_roles.py: each response token gets its role in the
    step, and the per-role losses, weighted by their counts, are the SFT loss."""
    import importlib.util
    from pathlib import Path

    from vapo_lightning.sft import SFTModule

    path = Path(__file__).resolve().parents[2] / "benchmarks/probes/probe_digitwise_roles.py"
    spec = importlib.util.spec_from_file_location("probe_digitwise_roles", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    data = SFTDataModule(task="digitwise", num_train=200)
    rows = data.val_rows[:6]
    examples = data._encode(rows)
    for row, e in zip(rows, examples):
        got = probe.roles(data.tokenizer, e.response_ids)
        K = row["difficulty"]
        assert got == ["label", ")", "space", "x", "+", "y", "=", "z"] * K + ["EOS"]
    with pytest.raises(ValueError, match="expected the 'x' of a step"):
        ids = examples[0].response_ids  # ' a' ')' ' ' '+' EOS: the step's x is missing
        probe.roles(data.tokenizer, [*ids[:3], ids[4], ids[-1]])
    torch.manual_seed(0)
    module = SFTModule(tokenizer=data.tokenizer, num_layers=1, hidden_size=64, intermediate_size=64)
    loss = probe.role_losses(module.model.eval(), data, rows)
    counts = dict.fromkeys(loss, 0)
    for e in examples:
        for r in probe.roles(data.tokenizer, e.response_ids):
            counts[r] += 1
    overall = sum(loss[r] * counts[r] for r in loss) / sum(counts.values())
    with torch.no_grad():
        expected = module._response_loss(data._collate_train(examples)).item()
    assert overall == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_the_shipped_sft_start_solves_the_task_greedily():
    """vapo_lightning/assets/digitwise_sft: its greedy answers to validation problems are right
    (96 % over the 125 in its eval.json), written in the task's format."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vapo_lightning.jsonl import read_jsonl

    root = Path(__file__).resolve().parents[2] / "vapo_lightning/assets"
    tok = AutoTokenizer.from_pretrained(root / "digitwise_sft")
    model = AutoModelForCausalLM.from_pretrained(root / "digitwise_sft").eval()
    rows = read_jsonl(root / "digitwise/val.jsonl")[:20]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    batch = tok(chats, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=224, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
        )
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    right = [D.is_correct(t.strip(), r["answer"]) for t, r in zip(texts, rows)]
    assert sum(right) >= 17, list(zip(texts, right))
    assert max(r["difficulty"] for r in rows) >= 20  # long answers among them
