"""The credit-assignment task (`vapo_lightning.tasks.digitwise`): answers against a slow
reference, seeded disjoint splits, the verifier, slips in demonstrations, response lengths."""

from __future__ import annotations

import random
import re

import pytest

from vapo_lightning.core import length_adaptive_lam
from vapo_lightning.sft import SFTDataModule
from vapo_lightning.tasks import digitwise as D
from vapo_lightning.tokenization import train_bpe


def reference_answer(prompt: str) -> str:
    """Digit i of the answer is (a_i + b_i) mod 10: by integer arithmetic, not strings."""
    a, b = (int(x) for x in prompt.rsplit(":", 1)[1].split("+"))
    k = len(prompt.rsplit(":", 1)[1].split("+")[0].strip())
    digits = []
    for _ in range(k):
        a, da = divmod(a, 10)
        b, db = divmod(b, 10)
        digits.append((da + db) % 10)
    return "".join(map(str, reversed(digits)))


def test_answers_solutions_and_difficulty_match_the_reference():
    rows = D.generate(400, seed=3)
    assert {r["difficulty"] for r in rows} == set(range(D.MIN_DIGITS, D.MAX_DIGITS + 1))
    for r in rows:
        assert r["answer"] == reference_answer(r["prompt"]) and r["answer"][0] != "0"
        assert len(r["answer"]) == r["difficulty"] and D.is_correct(r["solution"], r["answer"])
        steps = re.findall(r"(\d)\+(\d)=(\d)", r["solution"])
        assert "".join(z for *_, z in steps) == r["answer"] and len(steps) == r["difficulty"]


def test_generation_is_seeded_and_splits_are_disjoint():
    assert D.generate(50, seed=1) == D.generate(50, seed=1) != D.generate(50, seed=2)
    train, val = D.make_splits(300, 60, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 300
    with pytest.raises(ValueError, match="difficulty"):
        D.make_problem(random.Random(0), D.MAX_DIGITS + 1)


def test_the_verifier_wants_the_exact_boxed_digits():
    row = D.make_problem(random.Random(5), 6)
    right = row["solution"]
    assert D.is_correct(right, row["answer"])
    wrong_digit = right[: right.rindex("{") + 1] + str((int(row["answer"][0]) + 1) % 10) + row["answer"][1:] + "}"
    assert not D.is_correct(wrong_digit, row["answer"])
    assert not D.is_correct(right.rsplit(" ", 1)[0], row["answer"])  # no box: no answer
    assert not D.is_correct(right[:-1], row["answer"])  # an unclosed box is not an answer
    assert D.check([right, "nothing"], [row, row]) == [True, False]


def test_slips_are_local_and_at_the_asked_rate():
    rng, rows = random.Random(0), D.generate(600, seed=4)
    slipped = steps = 0
    for r in rows:
        demo = D.with_slips(r, rng, 0.1)
        got = re.findall(r"(\d)\+(\d)=(\d)", demo["solution"])
        want = re.findall(r"(\d)\+(\d)=(\d)", r["solution"])
        assert [g[:2] for g in got] == [w[:2] for w in want]  # the operands are never wrong
        wrong = sum(g[2] != w[2] for g, w in zip(got, want))
        slipped, steps = slipped + wrong, steps + len(want)
        assert D.is_correct(demo["solution"], r["answer"]) == (wrong == 0)
        assert D.extract_answer(demo["solution"]) == "".join(g[2] for g in got)  # box copies the working
    assert 0.085 < slipped / steps < 0.115
    assert D.with_slips(rows[0], rng, 0.0) == rows[0]


def test_response_lengths_span_the_length_adaptive_lambda():
    """A few tokens to a few hundred with the project's BPE: lambda_actor (alpha 0.05)
    from 0 at K = 2 to ~0.9 at K = 28."""
    rows = D.generate(600, seed=6, distinct=False)
    tok = train_bpe([r["prompt"] for r in rows] + [r["solution"] for r in rows])
    by_k = {}
    for r in rows:
        by_k[r["difficulty"]] = len(tok(" " + r["solution"])["input_ids"]) + 1  # + EOS
    assert 15 <= by_k[D.MIN_DIGITS] <= 25 and 200 <= by_k[D.MAX_DIGITS] <= 260
    import torch

    lam = length_adaptive_lam(torch.tensor([by_k[D.MIN_DIGITS], by_k[D.MAX_DIGITS]]), 0.05)
    assert lam[0] == 0 and 0.88 < lam[1] < 0.93


def test_sft_demonstrations_slip_at_the_configured_rate():
    clean = SFTDataModule(task="digitwise", num_train=400)
    noisy = SFTDataModule(task="digitwise", num_train=400, slip_rate=0.2)
    assert [r["prompt"] for r in clean.train_rows] == [r["prompt"] for r in noisy.train_rows]
    assert all(D.is_correct(r["solution"], r["answer"]) for r in clean.train_rows)
    wrong = sum(not D.is_correct(r["solution"], r["answer"]) for r in noisy.train_rows)
    assert 0.5 < wrong / 400 < 0.95  # 1 - 0.8^K over K = 2..28
    with pytest.raises(ValueError, match="no demonstrations with slips"):
        SFTDataModule(task="arithmetic", num_train=10, slip_rate=0.1)
    with pytest.raises(ValueError, match="slip_rate must be in"):
        SFTDataModule(task="digitwise", num_train=10, slip_rate=1.0)
