"""The code quickstart: the functions task (seeded, disjoint, decided by its table, checked in
the sandbox), its SFT data, and `vapo fit -c configs/quickstart_code.yaml` end to end."""

from __future__ import annotations

import glob
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import ROOT, print_config
from vapo_lightning.cli import main
from vapo_lightning.rewards.base import Sample
from vapo_lightning.rewards.code import CodeReward, extract_code
from vapo_lightning.sandbox import evaluate
from vapo_lightning.sft import SFTDataModule
from vapo_lightning.tasks import functions as F

ASSETS = ROOT / "vapo_lightning" / "assets" / "functions"
_TABLE = re.compile(r"f\((-?\d+)\) = (-?\d+)")


def _off_by_one(solution: str) -> str:
    return solution.replace("    return ", "    return 1 + ")


def test_generate_is_deterministic_and_seed_dependent():
    assert F.generate(60, seed=3) == F.generate(60, seed=3)
    assert F.generate(60, seed=3) != F.generate(60, seed=4)


def test_rows_have_the_schema_and_consistent_tests():
    rows = F.generate(500, seed=0)
    assert {r["difficulty"] for r in rows} == set(range(1, F.MAX_DIFFICULTY + 1))
    for r in rows:
        assert set(r) == {"prompt", "solution", "tests", "fn_name", "data_source", "difficulty"}
        assert r["fn_name"] == "f" and r["data_source"] == "functions"
        shown = [(int(x), int(y)) for x, y in _TABLE.findall(r["prompt"])]
        xs = [x for x, _ in shown]
        assert len(shown) == F.TABLE_SIZE and xs == list(range(xs[0], xs[0] + len(xs)))
        # The tests are the table, then held-out inputs that the prompt does not show.
        tests = [(t["input"], t["output"]) for t in r["tests"]]
        assert tests[: len(shown)] == [([x], y) for x, y in shown]
        held_out = [x for (x,), _ in tests[len(shown) :]]
        assert len(held_out) == F.NUM_HELD_OUT and not set(held_out) & set(xs)


def test_the_table_decides_the_function():
    """No template instance (nor any line) that fits the table differs on the held-out inputs,
    unless a strictly simpler explanation fits too (the reference is the simplest)."""
    candidates = [
        (level, expr, eval(f"lambda x: {expr}"))  # the generator's own templates
        for level, expr in [*((0, e) for e in F._rivals()), *F._instances()]
    ]
    for r in F.generate(60, seed=5):
        shown, held = r["tests"][: F.TABLE_SIZE], r["tests"][F.TABLE_SIZE :]
        for level, expr, fn in candidates:
            if level <= r["difficulty"] and all(fn(*t["input"]) == t["output"] for t in shown):
                assert all(fn(*t["input"]) == t["output"] for t in held), (r["prompt"], expr)


def test_splits_are_disjoint_and_the_shipped_files_match_the_generator():
    train, val = F.make_splits(2048, 200, seed=0)
    train_prompts, val_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in val}
    assert len(train_prompts) == 2048 and len(val_prompts) == 200
    assert not train_prompts & val_prompts
    assert F.read_jsonl(ASSETS / "train.jsonl") == train
    assert F.read_jsonl(ASSETS / "val.jsonl") == val


def test_reference_solutions_pass_in_the_sandbox_and_wrong_ones_fail():
    rows = F.generate(40, seed=11)
    for r in rows:
        result = evaluate(extract_code(r["solution"]), r["tests"], "f")
        assert result.status == "ok" and result.passed == result.total == 12, (r, result)
        wrong = evaluate(extract_code(_off_by_one(r["solution"])), r["tests"], "f")
        assert wrong.status == "ok" and wrong.passed == 0, (r, wrong)
    # The task's checker reads the fenced response exactly as CodeReward does.
    responses = [" " + r["solution"] for r in rows] + [_off_by_one(r["solution"]) for r in rows]
    assert F.check(responses, rows + rows) == [True] * 40 + [False] * 40


def test_a_lookup_table_of_the_prompt_fails_the_held_out_tests():
    row = F.generate(1, seed=2)[0]
    table = dict(_TABLE.findall(row["prompt"]))
    lookup = "def f(x):\n    return {" + ", ".join(f"{x}: {y}" for x, y in table.items()) + "}[x]"
    assert F.check([lookup], [row]) == [False]


def test_code_reward_scores_the_rows_as_written():
    rows = F.generate(10, seed=4)
    reward = CodeReward(all_or_nothing=True, num_workers=2, program_timeout_s=5.0)
    try:
        samples = [
            Sample(
                prompt=r["prompt"],
                response=response,
                response_ids=[1],
                truncated=False,
                ground_truth=r["tests"],
                extra_info={"fn_name": r["fn_name"]},
            )
            for r in rows
            for response in (" " + r["solution"], _off_by_one(r["solution"]))
        ]
        assert reward.score(samples) == [1.0, 0.0] * len(rows)
    finally:
        reward.close()


def test_sft_data_for_the_functions_task(tmp_path):
    train, val = F.make_splits(64, 10, seed=9)
    F.write_jsonl(train, tmp_path / "train.jsonl")
    F.write_jsonl(val, tmp_path / "val.jsonl")
    data = SFTDataModule(
        task="functions",
        val_path=str(tmp_path / "val.jsonl"),
        rl_train_path=str(tmp_path / "train.jsonl"),
        num_train=300,
    )
    held_out = {r["prompt"] for r in train + val}
    assert not held_out & {r["prompt"] for r in data.train_rows}
    tok = data.tokenizer
    for r in data.val_rows + data.train_rows[:50]:  # every character of the code round-trips
        ids = tok(" " + r["solution"], add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == " " + r["solution"]
    greedy = [" " + r["solution"] for r in data.val_rows]
    assert data.check(greedy, data.val_rows) == [True] * len(val)
    with pytest.raises(ValueError, match="task must be one of"):
        SFTDataModule(task="chess", val_path=str(tmp_path / "val.jsonl"))


def test_the_configs_parse_with_the_real_cli():
    cfg = print_config("fit", "-c", str(ROOT / "configs" / "quickstart_code.yaml"))
    assert cfg["data"]["tests_field"] == "tests" and cfg["data"]["answer_field"] is None
    (reward,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("CodeReward")]
    assert reward["init_args"]["all_or_nothing"] is True
    sft = print_config("sft", "-c", str(ROOT / "configs" / "quickstart_code_sft.yaml"))
    assert sft["data"]["task"] == "functions"


@pytest.mark.slow
def test_short_fit_scores_rollouts_in_the_sandbox(tmp_path):
    """Two rollout steps of the shipped code quickstart (small batches): the CodeReward
    scores reach the logs, with no reward errors, and validation runs before training."""
    main(
        [
            "fit",
            "-c",
            str(ROOT / "configs" / "quickstart_code.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=1",
            "--data.prompts_per_step=4",
            "--data.val_batch_size=8",
            "--model.generation.n=4",
            "--model.val_generation.n=2",
            "--model.algorithm.mini_batch_size=16",
            "--model.algorithm.micro_batch_size=8",
            f"--model.hf_export_dir={tmp_path / 'hf'}",
        ]
    )
    (event_file,) = glob.glob(f"{tmp_path}/lightning_logs/version_0/events.out.tfevents.*")
    acc = EventAccumulator(event_file, size_guidance={"histograms": 0})
    acc.Reload()
    scalars = {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert len(scalars["reward"]) == 2 and all(0.0 <= v <= 1.0 for v in scalars["reward"])
    assert scalars["reward/errors"] == [0.0, 0.0] and scalars["val/reward_errors"] == [0.0]
    assert scalars["code/samples"] == [16.0, 16.0]  # the sandbox's outcomes, counted per step
    outcomes = ("passed", "failed", "timeout", "error", "no_tests")
    assert [sum(scalars[f"code/{k}"][i] for k in outcomes) for i in (0, 1)] == [16.0, 16.0]
    assert len(scalars["val/accuracy"]) == 1 and 0.0 <= scalars["val/accuracy"][0] <= 1.0
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
