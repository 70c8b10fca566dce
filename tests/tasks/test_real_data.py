"""Real data for GPU runs: `vapo_lightning.datasets_math` turns the public math sets (samples
committed in tests/data/eval_sets, the full copies in ../shared/data where present, and
hand-made GSM8K / MATH / DAPO-style files) into rows PromptDataModule
loads, with the gold answers the math reward accepts; the GPU configs read what the prepare
commands in their headers write."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.helpers import build_tokenizer
from vapo_lightning.data import DataError, PromptDataModule, read_rows
from vapo_lightning.datasets_math import convert, main, parser, write_jsonl
from vapo_lightning.rewards.base import Sample
from vapo_lightning.rewards.math import MathReward

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
SAMPLES = Path(__file__).resolve().parents[1] / "data" / "eval_sets"  # in every clone
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
needs_data = pytest.mark.skipif(
    not (DATA / "aime2024.json").exists(), reason=f"reference eval sets not found in {DATA}"
)
DAPO_WRAPPED = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    '\n\n{}\n\nRemember to put your answer on its own line after "Answer:".'
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def load(path: Path, tokenizer, **overrides) -> list[dict]:
    """The rows PromptDataModule makes of a prepared file (the GPU configs' prompt settings)."""
    kwargs = {
        "train": str(path),
        "chat_template": True,
        "prompt_template": "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        "max_prompt_length": 100_000,  # the toy tokenizer's lengths say nothing about Qwen's
    }
    dm = PromptDataModule(**(kwargs | overrides))
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(tokenizer=tokenizer))
    dm.setup("fit")
    return dm.train_rows


@pytest.fixture
def prepare(tmp_path, tokenizer):
    """fmt, sources -> the rows PromptDataModule loads from the converted file."""

    def run(fmt: str, *sources: str | Path) -> list[dict]:
        result = convert(fmt, [str(s) for s in sources])
        assert result.errors == []
        return load(write_jsonl(result.rows, tmp_path / f"{fmt}.jsonl"), tokenizer)

    return run


# --------------------------------------------------------------- the shared eval sets


SETS = {  # fmt: (file, known ground truths by row in the full set)
    "gsm8k": ("gsm8k_test.jsonl", {0: "18", 1: "3", 146: "2125", 201: "114200"}),
    "aime2024": ("aime2024.json", {0: "204", 1: "25", 2: "809"}),
    "amc": ("amc.json", {0: "142", 1: "144", 2: "81"}),
    "math500": ("math500.json", {0: "\\left( 3, \\frac{\\pi}{2} \\right)", 1: "p - q"}),
}
FULL_COUNTS = {"gsm8k": 1319, "aime2024": 30, "amc": 83, "math500": 500}
# the committed GSM8K sample holds rows 0-39, then rows 146 and 201 (tests/data/eval_sets)
SAMPLE_ROW = {"gsm8k": {146: 40, 201: 41}}


def check_eval_set(prepare, fmt: str, folder: Path) -> list[dict]:
    file, known = SETS[fmt]
    rows = prepare(fmt, folder / file)
    _, first = next(iter(read_rows(str(folder / file))))
    for i, answer in known.items():
        i = i if folder == DATA else SAMPLE_ROW.get(fmt, {}).get(i, i)
        if i < len(rows):
            assert rows[i]["ground_truth"] == answer, i
    assert {r["data_source"] for r in rows} == {fmt}
    question = "question" if fmt == "gsm8k" else "problem"
    assert rows[0]["prompt_text"].count(first[question].strip()) == 1  # the bare problem, once
    if fmt == "gsm8k":  # every answer: a plain integer, no commas left
        assert all(r["ground_truth"].lstrip("-").isdigit() for r in rows)
    if fmt == "aime2024":  # metadata reaches rewards; the long solution does not
        assert rows[0]["extra_info"] == {
            "year": 2024,
            "aime_number": 1,
            "problem_number": 1,
            "difficulty": 2.0,
        }
    return rows


@pytest.mark.parametrize("fmt", sorted(SETS))
def test_eval_set_samples_convert_and_load(prepare, fmt):
    rows = check_eval_set(prepare, fmt, SAMPLES)
    assert len(rows) == len(list(read_rows(str(SAMPLES / SETS[fmt][0]))))
    assert all(i in range(len(rows)) for i in [SAMPLE_ROW.get(fmt, {}).get(i, i) for i in SETS[fmt][1]])


@needs_data
@pytest.mark.parametrize("fmt", sorted(SETS))
def test_shared_eval_sets_convert_and_load(prepare, fmt):
    assert len(check_eval_set(prepare, fmt, DATA)) == FULL_COUNTS[fmt]


def test_aime_gold_answers_score_with_the_math_reward(prepare):
    folder = DATA if (DATA / "aime2024.json").exists() else SAMPLES
    rows = prepare("aime2024", folder / "aime2024.json")
    n = len(rows)
    reward = MathReward(correct_reward=1.0, wrong_reward=0.0, num_workers=1)
    try:

        def scores(answers):
            samples = [
                Sample(
                    r["prompt_text"],
                    f"So the answer is $\\boxed{{{a}}}$.",
                    [1],
                    False,
                    ground_truth=r["ground_truth"],
                    data_source=r["data_source"],
                )
                for r, a in zip(rows, answers)
            ]
            return reward.score(samples)

        golds = [r["ground_truth"] for r in rows]
        assert scores(golds) == [1.0] * n
        assert scores([f"0{g}" for g in golds]) == [1.0] * n  # AIME's three-digit spelling
        assert scores([str(int(g) + 1) for g in golds]) == [0.0] * n
    finally:
        reward.close()


# ------------------------------------------------------------- hand-made training files


def test_gsm8k_style_file(tmp_path, prepare):
    path = tmp_path / "gsm8k_train.jsonl"
    path.write_text(
        json.dumps(
            {
                "question": "Tom has 1200 apples and buys 34 more. How many?",
                "answer": "1200 + 34 = <<1200+34=1234>>1234\n#### 1,234",
            }
        )
        + "\n"
        + json.dumps({"question": "A debt of 5 grows by 2. What is the balance?", "answer": "-5 - 2 = -7\n#### -7"})
        + "\n"
    )
    rows = prepare("gsm8k", path)
    assert [r["ground_truth"] for r in rows] == ["1234", "-7"]
    assert rows[0]["prompt_text"].count("Tom has 1200 apples and buys 34 more. How many?") == 1
    assert "####" not in rows[0]["prompt_text"]


def test_math_style_files_take_the_last_box(tmp_path, prepare):
    solutions = [
        ("What is $1/2 + 0$?", "We get $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("Solve $x^2 = 4$.", "First $\\boxed{-2}$, then $\\boxed{2}$.", "2"),
        ("Compute $\\{1\\}$.", "It is $\\boxed{\\{1\\}}$", "\\{1\\}"),
    ]
    rows = [{"problem": p, "solution": s, "level": "Level 1", "type": "Algebra"} for p, s, _ in solutions]
    jsonl = write_jsonl(rows, tmp_path / "math.jsonl")
    expected = [a for _, _, a in solutions]
    loaded = prepare("math", jsonl)
    assert [r["ground_truth"] for r in loaded] == expected
    assert loaded[0]["extra_info"] == {"level": "Level 1", "type": "Algebra"}
    # the original MATH release: one problem per .json file, one folder per subject
    (tmp_path / "MATH" / "train" / "algebra").mkdir(parents=True)
    for i, row in enumerate(rows):
        (tmp_path / "MATH" / "train" / "algebra" / f"{i}.json").write_text(json.dumps(row))
    assert [r["ground_truth"] for r in prepare("math", tmp_path / "MATH")] == expected


def test_dapo_style_parquet(tmp_path, tokenizer):
    import datasets  # a second to import: only the tests that write parquet pay it

    def row(problem, answer, index):
        return {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_WRAPPED.format(problem), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index},
        }

    rows = [row("Find $2+3$.", "5", "a"), row("Find $4 \\cdot 6$.", "24", "b")] * 3  # as on the hub
    path = tmp_path / "dapo-math-17k.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    result = convert("dapo", [str(path)])
    assert (len(result.rows), result.duplicates, result.errors) == (2, 4, [])
    assert result.rows[0] == {
        "prompt": "Find $2+3$.",
        "answer": "5",
        "data_source": "math_dapo",
        "ability": "MATH",
        "index": "a",
    }
    loaded = load(write_jsonl(result.rows, tmp_path / "dapo.jsonl"), tokenizer)
    assert [r["ground_truth"] for r in loaded] == ["5", "24"]
    assert "Answer:" not in loaded[1]["prompt_text"]  # one instruction: the config's boxed one


# ------------------------------------------------------------------------------ errors


def test_a_bad_row_is_named_by_file_and_line(tmp_path, capsys):
    path = tmp_path / "gsm8k_bad.jsonl"
    path.write_text(
        json.dumps({"question": "ok?", "answer": "#### 4"})
        + "\n"
        + json.dumps({"question": "no final answer", "answer": "It is 4."})
        + "\n"
        + json.dumps({"question": "", "answer": "#### 4"})
        + "\n"
        + json.dumps({"question": "words", "answer": "#### four"})
        + "\n"
    )
    errors = convert("gsm8k", [str(path)]).errors
    assert [e.split(": ", 1)[0] for e in errors] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert "####" in errors[0] and "'question'" in errors[1] and "'four'" in errors[2]

    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit, match="3 bad rows; nothing written"):
        main(["gsm8k", str(path), "--out", str(out)])
    assert f"bad row: {path}:2: " in capsys.readouterr().err and not out.exists()
    main(["gsm8k", str(path), "--out", str(out), "--skip-bad-rows"])
    assert [json.loads(line)["answer"] for line in out.open()] == ["4"]


def test_bad_rows_in_json_lists_and_parquet_name_the_item(tmp_path):
    import datasets  # a second to import: only the tests that write parquet pay it

    path = tmp_path / "math.json"
    path.write_text(json.dumps([{"problem": "p", "solution": "no box"}, {"problem": "q", "answer": "1"}]))
    assert convert("math", [str(path)]).errors == [
        f"{path}:item 0: no 'answer' field and no \\boxed{{}} answer in field 'solution'"
    ]
    parquet = tmp_path / "dapo.parquet"
    datasets.Dataset.from_list(
        [{"prompt": [{"content": "x", "role": "user"}], "reward_model": {"ground_truth": ""}}]
    ).to_parquet(str(parquet))
    (error,) = convert("dapo", [str(parquet)]).errors
    assert error.startswith(f"{parquet}:row 0: field 'reward_model.ground_truth'")


def test_numeric_answers_are_written_out(tmp_path):
    """A float answer becomes the text math-verify reads as that number (1e-05 is e - 5 to
    it); a NaN answer is a bad row, not the answer "nan"."""
    path = tmp_path / "math.json"
    rows = [{"problem": f"p{i}", "answer": a} for i, a in enumerate([1e-05, 142.0, 2.5, 7])]
    path.write_text(json.dumps([*rows, {"problem": "q", "answer": float("nan")}]))
    conversion = convert("math", [str(path)])
    assert [r["answer"] for r in conversion.rows] == ["0.00001", "142", "2.5", "7"]
    assert conversion.errors == [f"{path}:item 4: field 'answer' must be a string or a number, got nan"]


def test_malformed_json_and_missing_files_stop_with_the_location(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": \n')
    (error,) = convert("gsm8k", [str(path)]).errors  # a bad row like the others
    assert error.startswith(f"{path}:2: malformed JSON")
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit, match="1 bad rows; nothing written"):
        main(["gsm8k", str(path), "--out", str(out)])
    main(["gsm8k", str(path), "--out", str(out), "--skip-bad-rows"])
    assert [json.loads(line)["answer"] for line in out.open()] == ["1"]
    broken = tmp_path / "broken.json"
    broken.write_text('[{"question": "q",\n')
    with pytest.raises(DataError, match=re.escape(f"{broken}:2: malformed JSON")):
        convert("gsm8k", [str(broken)])
    with pytest.raises(DataError, match="does not exist"):
        convert("aime2024", [str(tmp_path / "aime2024.json")])
    with pytest.raises(SystemExit, match="loading it from the hub"):  # offline in tests
        main(["math", "no-such-org/no-such-dataset", "--out", str(tmp_path / "x.jsonl")])


# ----------------------------------------------------------------------- the GPU configs

GPU_CONFIGS = sorted((CONFIGS / "gpu").glob("qwen*.yaml"))


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.name for p in GPU_CONFIGS])
def test_gpu_configs_read_what_their_prepare_commands_write(path):
    text = path.read_text()
    assert "Not yet run on a GPU (its code paths are tested on CPU)" in text
    written = set()
    for line in text.splitlines():
        if line.startswith("#") and "python -m vapo_lightning.datasets_math " in line:
            command = shlex.split(line.lstrip("#"), comments=True)
            written.add(parser().parse_args(command[3:]).out)
    data = yaml.safe_load(text)["data"]
    val = data.get("val")
    read = {data["train"], *([val] if isinstance(val, str) else val or [])}
    assert "data/aime2024.jsonl" in read
    assert read <= written, f"{path.name} reads {read - written}, which no header command writes"
