"""The word-problem task (`vapo_lightning.tasks.word_problems`): seeded, disjoint splits, right
answers, the committed asset files equal to what the generator writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.tasks import word_problems as W

ASSETS = Path(__file__).resolve().parents[2] / "vapo_lightning" / "assets" / "word_problems"
CHANGE = re.compile(r"(buys|finds|gives (?:him|her)|gets|gives|loses|uses|sells) (\d+)")
GAIN_VERBS = {"buys", "finds", "gives him", "gives her", "gets"}


def recount(prompt: str) -> int:
    """The answer read back from the story's words (not from the solution)."""
    count = int(re.search(r"has (\d+)", prompt).group(1))
    for verb, n in CHANGE.findall(prompt.split(".", 1)[1]):
        count += int(n) if verb in GAIN_VERBS else -int(n)
    return count


def test_answers_follow_from_the_story_and_stay_in_range():
    rows = W.generate(500, seed=3)
    for row in rows:
        assert int(row["answer"]) == recount(row["prompt"]), row["prompt"]
        assert row["solution"].endswith(f"\\boxed{{{row['answer']}}}")
        assert len(row["solution"].split(" = ")) == row["difficulty"] + 1
        assert 1 <= int(row["answer"]) <= W.MAX_COUNT
    assert {r["difficulty"] for r in rows} == {1, 2}


def test_generation_is_seeded_and_splits_are_disjoint():
    assert W.generate(50, seed=1) == W.generate(50, seed=1) != W.generate(50, seed=2)
    train, val = W.make_splits(300, 60, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 300


def test_the_committed_files_are_the_generators_output():
    train, val = W.make_splits(2000, 128, seed=0)
    assert read_jsonl(ASSETS / "train.jsonl") == train
    assert read_jsonl(ASSETS / "val.jsonl") == val


def test_a_bad_difficulty_is_refused():
    import random

    with pytest.raises(ValueError, match="difficulty must be in"):
        W.make_problem(random.Random(0), 3)
