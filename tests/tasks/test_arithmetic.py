"""The arithmetic task: seeded, correct, within the advertised lengths, disjoint splits."""

from __future__ import annotations

import re

import pytest

from vapo_lightning.tasks import arithmetic as A
from vapo_lightning.tokenization import train_bpe


def _recompute(prompt: str) -> int:
    """The answer by a route independent of the generator: parse the prompt, fold in order."""
    start = int(re.match(r"Start at (\d+)\.", prompt).group(1))
    x = start
    for op, b in re.findall(r"[a-j]\) ([+-]) (\d+)", prompt):
        x = x + int(b) if op == "+" else x - int(b)
    return x


def test_generate_is_deterministic_and_seed_dependent():
    assert A.generate(50, seed=3) == A.generate(50, seed=3)
    assert A.generate(50, seed=3) != A.generate(50, seed=4)


def test_rows_have_the_schema_and_the_right_answers():
    rows = A.generate(600, seed=0)
    assert {r["difficulty"] for r in rows} == set(range(1, A.MAX_DIFFICULTY + 1))
    for r in rows:
        assert set(r) == {"prompt", "answer", "solution", "data_source", "difficulty"}
        assert r["data_source"] == "arithmetic"
        assert int(r["answer"]) == _recompute(r["prompt"])
        assert len(re.findall(r"[a-j]\) [+-] \d+", r["prompt"])) == r["difficulty"]
        # The reference solution is checked by the grader, and every written step is true.
        assert A.is_correct(r["solution"], r["answer"])
        for lhs, rhs in re.findall(r"\) ([\d +-]+?) = (\d+)(?=[.])", r["solution"]):
            assert eval(lhs) == int(rhs), (lhs, rhs)  # only digits and + - reach eval


def test_intermediate_values_stay_small_and_non_negative():
    for r in A.generate(300, seed=1):
        numbers = [int(n) for n in re.findall(r"\d+", r["solution"])]
        assert min(numbers) >= 0 and max(numbers) <= A.MAX_VALUE


def test_splits_are_disjoint_and_distinct():
    train, val = A.make_splits(2000, 200, seed=0)
    assert len(train) == 2000 and len(val) == 200
    train_prompts, val_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in val}
    assert len(train_prompts) == 2000 and len(val_prompts) == 200
    assert not train_prompts & val_prompts


def test_response_and_prompt_lengths_in_tokens():
    rows = A.generate(1200, seed=2)
    tok = train_bpe([r["prompt"] for r in rows] + [r["solution"] for r in rows], vocab_size=512)
    by_level: dict[int, list[int]] = {}
    for r in rows:
        n = len(tok(" " + r["solution"])["input_ids"]) + 1  # + EOS
        by_level.setdefault(r["difficulty"], []).append(n)
        chat = [{"role": "user", "content": r["prompt"]}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert len(tok(prompt)["input_ids"]) <= 100  # chat template included
    assert min(by_level[1]) >= 10 and max(by_level[1]) <= 50
    assert 110 <= max(by_level[A.MAX_DIFFICULTY]) <= 150
    means = [sum(v) / len(v) for _, v in sorted(by_level.items())]
    assert means == sorted(means)  # harder problems have longer solutions


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{12}.", 12),
        ("\\boxed{3} then \\boxed{ 45 }", 45),
        ("\\boxed{-7}", -7),
        ("no box 12", None),
        ("\\boxed{1.5}", None),
    ],
)
def test_extract_boxed_int(text, expected):
    assert A.extract_boxed_int(text) == expected


def test_is_correct_compares_as_integers():
    assert A.is_correct("\\boxed{007}", "7")
    assert not A.is_correct("\\boxed{8}", "7")
    assert not A.is_correct("7", "7")


def test_cli_writes_the_splits(tmp_path):
    A.main(["--out", str(tmp_path), "--n-train", "30", "--n-val", "10"])
    train, val = A.read_jsonl(tmp_path / "train.jsonl"), A.read_jsonl(tmp_path / "val.jsonl")
    assert (len(train), len(val)) == (30, 10)
    assert val == A.make_splits(30, 10, seed=0)[1]


def test_bad_difficulty_raises():
    import random

    with pytest.raises(ValueError, match="difficulty"):
        A.make_problem(random.Random(0), 0)
