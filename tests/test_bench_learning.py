"""The learning study's bookkeeping (benchmarks/bench_learning.py): fair budgets per row,
the statistics against slow references, and the per-bucket reading of validation samples."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from scipy import stats

from benchmarks import bench_learning as B


@pytest.mark.parametrize("task", sorted(B.TASKS))
def test_every_row_gets_the_same_policy_updates_and_responses(task):
    t = B.TASKS[task]
    base = B.load(t.config)
    responses = base["data"]["prompts_per_step"] * base["model"]["generation"]["n"]
    for name, layer, _ in B.RUNS:
        layer = t.layers.get(name, layer)
        p, args = B.row_overrides(t, layer)
        merged = {a.split("=")[0]: a.split("=")[1] for a in args}
        assert int(merged["--trainer.max_steps"]) - p == t.updates, name
        assert int(merged["--trainer.val_check_interval"]) == t.updates
        n = ((B.load(layer).get("model") or {}).get("generation") or {}).get("n") if layer else None
        per_step = int(merged.get("--data.prompts_per_step", base["data"]["prompts_per_step"]))
        assert per_step * (n or base["model"]["generation"]["n"]) == responses, name
        without = name in ("vanilla PPO", "GRPO", "DAPO", "w/o value-pretraining")
        assert p == (0 if without else 5), name


@pytest.mark.parametrize("task", ["arithmetic", "digitwise"])
def test_dapo_overlong_window_starts_above_the_longest_correct_answer(task):
    """The soft window must not penalise correct answers: it starts above the longest
    reference response (+ EOS) of the task's prompts, with the policy's tokenizer (the
    shipped quickstart policy's; for digitwise the BPE its SFT trains on the task's texts)."""
    from transformers import AutoTokenizer

    from vapo_lightning.jsonl import read_jsonl
    from vapo_lightning.tokenization import train_bpe

    t = B.TASKS[task]
    rows = read_jsonl(B.ROOT / t.val) + read_jsonl(
        B.ROOT / t.val.replace("val.jsonl", "train.jsonl")
    )
    if task == "arithmetic":
        tok = AutoTokenizer.from_pretrained(B.ROOT / "vapo_lightning/assets/quickstart_sft")
    else:
        tok = train_bpe([r["prompt"] for r in rows] + [r["solution"] for r in rows])
    longest = (
        max(len(tok(" " + r["solution"], add_special_tokens=False)["input_ids"]) for r in rows) + 1
    )
    layer = B.load(t.layers.get("DAPO", "configs/baselines/dapo.yaml"))
    (cb,) = [
        c for c in layer["trainer"]["callbacks"] if c["class_path"].endswith("OverlongPenalty")
    ]
    assert cb["init_args"]["max_length"] - cb["init_args"]["cache_length"] > longest
    assert (
        cb["init_args"]["max_length"] <= B.load(t.config)["model"]["generation"]["max_new_tokens"]
    )


def test_welch_holm_matches_hand_computed_values():
    ref = [0.50, 0.52, 0.48, 0.51, 0.49]
    rows = {
        "same": [0.50, 0.49, 0.51, 0.52, 0.48],
        "better": [0.60, 0.62, 0.59, 0.61, 0.63],
        "worse": [0.40, 0.45, 0.42, 0.41, 0.44],
    }
    got = B.welch_holm(ref, rows)

    def welch_p(a, b):  # the textbook formula, two-sided
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        t = (statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
        return 2 * stats.t.sf(abs(t), df)

    raw = {k: welch_p(v, ref) for k, v in rows.items()}
    order = sorted(raw, key=raw.get)
    holm, running = {}, 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (len(raw) - i) * raw[k]))
        holm[k] = running
    for k in rows:
        assert got[k][0] == pytest.approx(statistics.mean(rows[k]) - statistics.mean(ref))
        assert got[k][1] == pytest.approx(holm[k], rel=1e-6)
    assert got["same"][1] > 0.5 and got["better"][1] < 0.01 and got["worse"][1] < 0.01


def test_ci95_is_the_t_interval():
    xs = [0.1, 0.2, 0.3, 0.4]
    half = 3.182446 * statistics.stdev(xs) / 2  # t_{0.975, 3}
    assert B.ci95(xs) == f"{100 * 0.25:.1f} ± {100 * half:.1f}"


def test_bucket_accuracy_reads_the_last_validation(tmp_path):
    difficulty = {
        "Start at 3. a) + 1": 1,
        "Start at 3. a) + 1 b) + 2": 2,
        "Start at 5. a) - 1 b) + 2 c) + 1": 3,
    }
    samples = [
        (0, "User: Start at 3. a) + 1\nAssistant:", False),  # an earlier validation: ignored
        (10, "User: Start at 3. a) + 1\nAssistant:", True),
        (
            10,
            "User: Start at 3. a) + 1 b) + 2\nAssistant:",
            False,
        ),  # holds the difficulty-1 prompt too
        (10, "User: Start at 3. a) + 1 b) + 2\nAssistant:", True),
        (10, "User: Start at 5. a) - 1 b) + 2 c) + 1\nAssistant:", False),
    ]
    with (tmp_path / "val_samples.jsonl").open("w") as f:
        for step, prompt, ok in samples:
            f.write(json.dumps({"step": step, "prompt": prompt, "correct": ok}) + "\n")
    assert B.bucket_accuracy(tmp_path, difficulty, ((1, 1), (2, 3))) == [1.0, 1 / 3]
