"""The bignum tool-use task: answers against Python, graded levels, seeded disjoint splits,
both answer forms scored by MathReward, and SFT encodings that leave observations unlabelled."""

from __future__ import annotations

import contextlib
import io
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from vapo_lightning.jsonl import read_jsonl, write_jsonl
from vapo_lightning.rewards.base import Sample
from vapo_lightning.rewards.math import MathReward
from vapo_lightning.sft import (
    IGNORE_INDEX,
    TASKS,
    SFTDataModule,
    encode_response,
    encode_responses,
    split_observations,
)
from vapo_lightning.tasks import arithmetic
from vapo_lightning.tasks import bignum as B
from vapo_lightning.tokenization import train_bpe

ASSETS = Path(__file__).resolve().parents[2] / "vapo_lightning" / "assets" / "bignum"
SOLUTION = re.compile(r"<code>(print\((\d+)([+*])(\d+)\))</code><output>(\d+)</output> \\boxed\{(\d+)\}")


def _run(program: str) -> str:
    """The program's standard output, as the sandbox would capture it (digits and + * only)."""
    assert re.fullmatch(r"print\(\d+[+*]\d+\)", program), program
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, {})  # only a print of one sum or product of literals reaches exec
    return out.getvalue()


def test_generate_is_deterministic_and_seed_dependent():
    assert B.generate(60, seed=3) == B.generate(60, seed=3)
    assert B.generate(60, seed=3) != B.generate(60, seed=4)


def test_rows_have_the_schema_and_answers_that_python_computes():
    rows = B.generate(1000, seed=0)
    for r in rows:
        assert set(r) == {"prompt", "answer", "solution", "data_source", "difficulty"}
        assert r["data_source"] == "bignum"
        a, op, b = re.fullmatch(r"What is (\d+)([+*])(\d+)\?", r["prompt"]).groups()
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))
        assert B.operands("User: " + r["prompt"] + "\nAssistant:") == (int(a), op, int(b))
        # The tool form: the program writes the prompt's expression, the observation is what
        # running it prints (trailing newline stripped), the box copies it.
        program, pa, pop, pb, shown, box = SOLUTION.fullmatch(r["solution"]).groups()
        assert (pa, pop, pb) == (a, op, b)
        assert _run(program) == r["answer"] + "\n"
        assert B.observation(_run(program)) == f"<output>{shown}</output>"
        assert shown == box == r["answer"]
        assert B.bare(r) == f"\\boxed{{{r['answer']}}}"


def test_levels_grade_the_operand_lengths():
    rows = B.generate(2000, seed=1)
    assert Counter(r["difficulty"] for r in rows) == {d: 400 for d in range(1, 6)}
    pairs: dict[int, set] = {}
    for r in rows:
        a, _, b = B.operands(r["prompt"])
        m, n = len(str(a)), len(str(b))
        assert (m + n) // 2 == r["difficulty"] and min(m, n) >= 1 and max(m, n) <= B.MAX_DIGITS
        pairs.setdefault(r["difficulty"], set()).add((m, n))
    for d, seen in pairs.items():
        assert seen == set(B.digit_counts(d))  # every length pair of the level occurs
    assert B.digit_counts(1) == [(1, 1), (1, 2), (2, 1)] and B.digit_counts(5) == [(5, 5)]
    # Both operations at every level; harder levels have longer answers.
    assert all({"+", "*"} <= {B.operands(r["prompt"])[1] for r in rows if r["difficulty"] == d} for d in range(1, 6))
    mean = [sum(len(r["answer"]) for r in rows if r["difficulty"] == d) / 400 for d in range(1, 6)]
    assert mean == sorted(mean) and mean[0] < 2.5 and mean[-1] > 7
    with pytest.raises(ValueError, match="difficulty"):
        B.make_problem(random.Random(0), 6)


def test_splits_are_disjoint_distinct_stratified_and_shipped():
    train, val = B.make_splits(4096, 200, seed=0)
    train_p, val_p = {r["prompt"] for r in train}, {r["prompt"] for r in val}
    assert len(train_p) == 4096 and len(val_p) == 200 and not train_p & val_p
    assert Counter(r["difficulty"] for r in val) == {d: 40 for d in range(1, 6)}
    assert set(Counter(r["difficulty"] for r in train).values()) <= {819, 820}
    assert read_jsonl(ASSETS / "train.jsonl") == train
    assert read_jsonl(ASSETS / "val.jsonl") == val
    assert B.make_splits(50, 10, seed=1) != B.make_splits(50, 10, seed=0)


def test_cli_writes_the_splits(tmp_path):
    B.main(["--out", str(tmp_path), "--n-train", "30", "--n-val", "10"])
    assert read_jsonl(tmp_path / "val.jsonl") == B.make_splits(30, 10, seed=0)[1]


@pytest.fixture(scope="module")
def reward():
    r = MathReward(num_workers=1)
    yield r
    r.close()


def _score(reward, responses: list[str], answers: list[str]) -> list[float]:
    return reward.score(
        [Sample("", text, [], False, ground_truth=gold, data_source="bignum") for text, gold in zip(responses, answers)]
    )


def test_math_reward_scores_both_forms(reward):
    rows = B.generate(50, seed=5)
    answers = [r["answer"] for r in rows]
    assert _score(reward, [r["solution"] for r in rows], answers) == [1.0] * 50
    assert _score(reward, [" " + B.bare(r) for r in rows], answers) == [1.0] * 50
    assert B.check([r["solution"] for r in rows], rows) == [True] * 50
    off = [str(int(a) + 1) for a in answers]
    wrong_box = [r["solution"].replace(f"\\boxed{{{r['answer']}}}", f"\\boxed{{{o}}}") for r, o in zip(rows, off)]
    assert _score(reward, wrong_box, answers) == [-1.0] * 50  # the box decides, not the output
    assert B.check(wrong_box, rows) == [False] * 50
    no_box = [r["solution"].split(" \\boxed")[0] for r in rows]  # the tool ran, no answer given
    assert _score(reward, no_box, answers) == [-1.0] * 50
    assert _score(reward, [f"\\boxed{{{o}}}" for o in off], answers) == [-1.0] * 50


# ------------------------------------------------------------------------ SFT encoding


def test_split_observations():
    solution = "<code>print(6*15)</code><output>90</output> \\boxed{90}"
    assert split_observations(solution) == [
        ("<code>print(6*15)</code>", False),
        ("<output>90</output>", True),
        (" \\boxed{90}", False),
    ]
    assert split_observations("a) 5 - 4 = 1. \\boxed{1}") == [("a) 5 - 4 = 1. \\boxed{1}", False)]
    two = "<code>x</code><output>1\n2</output><code>y</code><output></output>end"
    assert split_observations(two) == [
        ("<code>x</code>", False),
        ("<output>1\n2</output>", True),
        ("<code>y</code>", False),
        ("<output></output>", True),
        ("end", False),
    ]


@pytest.fixture(scope="module")
def tok():
    rows = B.generate(600, seed=9)
    texts = [r["prompt"] for r in rows] + [t for r in rows for t, _ in split_observations(r["solution"])]
    return train_bpe(texts, vocab_size=400)


def test_observation_tokens_are_exactly_the_masked_ones(tok):
    for r in B.generate(100, seed=11):
        ids, labels = encode_response(tok, r["solution"])
        code, obs, rest = (t for t, _ in split_observations(r["solution"]))
        pieces = [tok(t, add_special_tokens=False)["input_ids"] for t in (" " + code, obs, rest)]
        assert ids == [*pieces[0], *pieces[1], *pieces[2], tok.eos_token_id]
        start, end = len(pieces[0]), len(pieces[0]) + len(pieces[1])
        assert all(lab == IGNORE_INDEX for lab in labels[start:end])
        assert labels[:start] == ids[:start] and labels[end:] == ids[end:]
        assert tok.decode(ids[start:end]) == obs == B.observation(r["answer"])
        assert tok.decode(ids, skip_special_tokens=True) == " " + r["solution"]
        bare_ids, bare_labels = encode_response(tok, B.bare(r))
        assert bare_ids == bare_labels == [*tok(" " + B.bare(r))["input_ids"], tok.eos_token_id]
    with pytest.raises(ValueError, match="starts with model text"):
        encode_response(tok, "<output>1</output> \\boxed{1}")


def test_a_batch_encodes_as_each_solution_on_its_own(tok):
    """`encode_responses` tokenizes all segments in one call; each row is what the segment by
    segment reference gives, with and without observations, in any mix."""
    solutions = [r["solution"] for r in B.generate(30, seed=5)]
    solutions += [B.bare(r) for r in B.generate(10, seed=6)]
    random.Random(0).shuffle(solutions)

    def reference(solution: str) -> tuple[list[int], list[int]]:
        ids, labels = [], []
        for k, (text, is_observation) in enumerate(split_observations(solution)):
            piece = tok(" " + text if k == 0 else text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += [IGNORE_INDEX] * len(piece) if is_observation else piece
        return [*ids, tok.eos_token_id], [*labels, tok.eos_token_id]

    assert encode_responses(tok, solutions) == [reference(s) for s in solutions]
    assert encode_responses(tok, []) == []


def test_rows_without_observations_encode_as_one_segment(tok):
    for r in arithmetic.generate(50, seed=2):
        ids, labels = encode_response(tok, r["solution"])
        assert ids == labels == [*tok(" " + r["solution"], add_special_tokens=False)["input_ids"], tok.eos_token_id]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SFTDataModule:
    folder = tmp_path_factory.mktemp("bignum")
    train, val = B.make_splits(100, 20, seed=7)
    write_jsonl(train, folder / "train.jsonl")
    write_jsonl(val, folder / "val.jsonl")
    return SFTDataModule(
        task="bignum",
        val_path=str(folder / "val.jsonl"),
        rl_train_path=str(folder / "train.jsonl"),
        num_train=2000,
        answer_only_fraction=0.5,
        batch_size=16,
        val_batch_size=20,
    )


def test_sft_mixes_tool_and_bare_answers_at_every_level(data):
    assert TASKS["bignum"].answer_only is B.bare
    held_out = {r["prompt"] for r in data.val_rows} | {r["prompt"] for r in B.make_splits(100, 20, 7)[0]}
    assert not held_out & {r["prompt"] for r in data.train_rows}
    for d in range(1, 6):
        level = [r for r in data.train_rows if r["difficulty"] == d]
        bare = [r for r in level if r["solution"] == B.bare(r)]
        tool = [r for r in level if SOLUTION.fullmatch(r["solution"])]
        assert len(bare) + len(tool) == len(level) == 400
        assert 0.4 < len(bare) / len(level) < 0.6
    assert all(B.is_correct(r["solution"], r["answer"]) for r in data.train_rows)


def test_sft_batches_label_model_tokens_only(data):
    tok = data.tokenizer
    # No vocabulary entry spans a tool call's end and its observation's start.
    assert not [t for t in tok.get_vocab() if "><" in t]
    tool_rows = [i for i, r in enumerate(data.train_rows) if "<output>" in r["solution"]][:8]
    batch = data._collate_train([data.train_examples[i] for i in tool_rows])
    for k, i in enumerate(tool_rows):
        row, example = data.train_rows[i], data.train_examples[i]
        n_prompt = len(example.prompt_ids)
        labels, ids = batch["labels"][k], batch["input_ids"][k]
        response = slice(n_prompt, n_prompt + len(example.response_ids))
        assert (labels[:n_prompt] == IGNORE_INDEX).all()
        assert tok.decode(ids[response][labels[response] == IGNORE_INDEX]) == B.observation(row["answer"])
        code, _, rest = (t for t, _ in split_observations(row["solution"]))
        assert tok.decode(labels[labels != IGNORE_INDEX]) == " " + code + rest + tok.eos_token
    # The validation loss skips the observations too.
    rows = data.val_rows[:4]
    val = data._collate_val(rows)
    n_model = sum(lab != IGNORE_INDEX for e in data._encode(rows) for lab in e.labels)
    assert (val["labels"] != IGNORE_INDEX).sum() == n_model
    assert n_model < sum(len(e.response_ids) for e in data._encode(rows))


def test_answer_only_from_step_opens_with_full_solutions(tmp_path):
    train, val = B.make_splits(40, 10, seed=3)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(val, tmp_path / "val.jsonl")
    paths = {
        "val_path": str(tmp_path / "val.jsonl"),
        "rl_train_path": str(tmp_path / "train.jsonl"),
    }
    kw = {"task": "bignum", "num_train": 800, "answer_only_fraction": 0.5, "batch_size": 16}
    data = SFTDataModule(**paths, **kw, answer_only_from_step=10)
    plain = SFTDataModule(**paths, **kw)
    assert data.train_rows == plain.train_rows  # the mix itself is unchanged
    assert (
        data.warmup_rows == B.generate(800, seed=1234, exclude=[r["prompt"] for r in val + train], distinct=False)[:160]
    )
    batches = data._batches(data.seed)
    assert len(batches) == 10 + 800 // 16
    examples = data._examples
    warm = [examples[i] for b in batches[:10] for i in b]
    assert sorted(map(id, warm)) == sorted(map(id, data.warmup_examples))  # each once
    assert all(IGNORE_INDEX in e.labels for e in warm)  # every one a tool call
    rest = [i for b in batches[10:] for i in b]
    assert min(rest) >= 160 and len(set(rest)) == 800
    bare = sum(IGNORE_INDEX not in examples[i].labels for i in rest) / len(rest)
    assert 0.4 < bare < 0.6
    batch = data._collate_train([examples[i] for i in batches[0]])
    assert (batch["labels"] == IGNORE_INDEX).any(dim=1).all()
    with pytest.raises(ValueError, match="answer_only_from_step"):
        SFTDataModule(**paths, **kw | {"num_train": 100}, answer_only_from_step=10)
