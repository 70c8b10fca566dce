"""PromptDataModule (`vapo_lightning/data.py`): a bad row, an overlong prompt or an empty or
missing file is named by file, line and field before training starts, or skipped when asked."""

from pathlib import Path
from unittest import mock

import pytest

from tests.helpers import (
    make_rows,
    tiny_data,
    tiny_module,
    tiny_trainer,
    write_jsonl,
)
from vapo_lightning.data import DataError


@pytest.mark.slow
def test_malformed_data_is_reported_with_file_and_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", make_rows(3))
    with path.open("a") as f:
        f.write('{"prompt": "What is 1 + 1?", "answer": "2"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:4: malformed JSON"):
        tiny_trainer(tmp_path).fit(tiny_module(tok), datamodule=tiny_data(tmp_path, train=str(path)))

    write_jsonl(path, [*make_rows(2), {"prompt": "What is 1 + 1?"}])
    with pytest.raises(
        DataError, match=r"bad\.jsonl:3: no field 'answer' \(the row has 'prompt'\); set data\.answer_field"
    ):
        tiny_trainer(tmp_path).fit(tiny_module(tok), datamodule=tiny_data(tmp_path, train=str(path)))

    dm = tiny_data(tmp_path, train=str(path), bad_rows="skip", val=None)
    tiny_trainer(tmp_path, max_steps=1).fit(tiny_module(tok), datamodule=dm)
    assert dm.skipped["train/bad_rows"] == 1 and len(dm.train_rows) == 2

    with path.open("a") as f:  # a line that is not JSON is skipped too
        f.write('{"prompt": "What is 1 + 1?", "answer": "2"\n')
    dm = tiny_data(tmp_path, train=str(path), bad_rows="skip", val=None)
    tiny_trainer(tmp_path, max_steps=1).fit(tiny_module(tok), datamodule=dm)
    assert dm.skipped["train/bad_rows"] == 2 and len(dm.train_rows) == 2


@pytest.mark.slow
def test_overlong_prompts_error_or_drop(tok, tmp_path):
    rows = [*make_rows(4), {"prompt": "What is " + " + ".join(["1"] * 50) + "?", "answer": "50"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataError, match=r"long\.jsonl:5: prompt is \d+ tokens, over data.max_prompt_length=20"):
        tiny_trainer(tmp_path).fit(
            tiny_module(tok), datamodule=tiny_data(tmp_path, train=str(path), max_prompt_length=20)
        )
    dm = tiny_data(tmp_path, train=str(path), max_prompt_length=20, overlong_prompts="drop", val=None)
    tiny_trainer(tmp_path, max_steps=1).fit(tiny_module(tok), datamodule=dm)
    assert dm.skipped["train/overlong_prompts"] == 1


@pytest.mark.parametrize(
    "row,match",
    [
        ({"prompt": "   ", "answer": "1"}, r"bad\.jsonl:3: field 'prompt' is empty"),
        ({"prompt": 17, "answer": "1"}, r"bad\.jsonl:3: field 'prompt' must be a non-empty string"),
        (
            {"prompt": "What is 1 + 1?", "answer": ""},
            r"bad\.jsonl:3: field 'answer' is missing or empty",
        ),
        (
            {"prompt": "What is 1 + 1?", "answer": "2", "data_source": 3},
            r"bad\.jsonl:3: field 'data_source' must be a string",
        ),
        (["not", "an", "object"], r"bad\.jsonl:3: expected a JSON object"),
        (
            {"question": "What is 1 + 1?", "answer": "2"},
            r"bad\.jsonl:3: no field 'prompt' \(the row has 'question', 'answer'\); set data\.prompt_field",
        ),
    ],
    ids=["empty-prompt", "mistyped-prompt", "empty-answer", "mistyped-source", "not-an-object", "gsm8k-fields"],
)
def test_bad_rows_name_file_line_and_field(tok, tmp_path, row, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [*make_rows(2), row])
    with pytest.raises(DataError, match=match):
        tiny_trainer(tmp_path).fit(tiny_module(tok), datamodule=tiny_data(tmp_path, train=str(path)))


def test_empty_or_missing_dataset_is_an_error_before_training(tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"data.train: no usable rows"):
        tiny_trainer(tmp_path).fit(tiny_module(tok), datamodule=tiny_data(tmp_path, train=str(empty)))
    with pytest.raises(DataError, match=r"data.train: file .*nope.jsonl does not exist"):
        tiny_trainer(tmp_path).fit(tiny_module(tok), datamodule=tiny_data(tmp_path, train=str(tmp_path / "nope.jsonl")))


def test_a_prompt_template_with_a_single_brace_is_one_line_before_any_work(tmp_path, monkeypatch):
    """`\\boxed{}` in a template (the obvious way to write it) would stop the run at the first
    row with an IndexError 15 frames deep; it is refused in one line naming the field and the
    fix. Doubled braces work, and give the single ones."""
    from vapo_lightning import module as vapo_module
    from vapo_lightning.cli import main
    from vapo_lightning.data import PromptDataModule

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the template was checked")

    monkeypatch.setattr(vapo_module, "build_policy", no_model)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "fit",
                "-c",
                "configs/tiny_cpu.yaml",
                f"--trainer.default_root_dir={tmp_path}",
                "--data.prompt_template={prompt} Put it in \\boxed{}.",
            ]
        )
    line = str(stop.value.code)
    assert line.startswith("vapo: error: data.prompt_template=") and "\n" not in line
    assert "found '{}'" in line and "\\boxed{{}}" in line
    for bad in ("no field here", "{prompt} {answer}", "{prompt} }"):
        with pytest.raises(ValueError, match=r"data\.prompt_template"):
            PromptDataModule(train="x.jsonl", prompt_template=bad)
    dm = PromptDataModule(train="x.jsonl", prompt_template="{prompt} Put it in \\boxed{{}}.")
    assert dm.hparams.prompt_template.format(prompt="1 + 1?") == "1 + 1? Put it in \\boxed{}."


DEFAULT_SYSTEM_TEMPLATE = (  # SmolLM2's, shortened: a default system message unless one is given
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful AI assistant"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    ("system_prompt", "system_text"),
    [(None, "You are a helpful AI assistant"), ("", ""), ("Be brief.", "Be brief.")],
)
def test_an_empty_system_prompt_drops_the_templates_default(tok, tmp_path, system_prompt, system_text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok)
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE
    data = tiny_data(tmp_path, chat_template=True, system_prompt=system_prompt)
    row = data._prepare({"prompt": "What is 2 + 3?", "answer": "5"}, "train.jsonl:1", tokenizer)
    assert row["prompt_text"] == (
        f"<|im_start|>system\n{system_text}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", [DEFAULT_SYSTEM_TEMPLATE, None], ids=["instruct", "base"])
def test_the_chat_template_is_used_by_default_when_the_tokenizer_has_one(tok, tmp_path, template):
    """An instruct model given raw prompts answers badly and nothing says why: unless the
    config says otherwise, a tokenizer's chat template wraps each prompt, and start-up says
    which was chosen."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok)
    tokenizer.chat_template = template
    data = tiny_data(tmp_path, chat_template=None, val=None)
    data.trainer = SimpleNamespace(lightning_module=SimpleNamespace(tokenizer=tokenizer))
    with mock.patch("vapo_lightning.data.rank_zero_info") as info:
        data.setup("fit")
    text = data.train_rows[0]["prompt_text"]
    if template:
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert "chat template wraps each prompt" in info.call_args[0][0]
    else:
        assert text == make_rows(1)[0]["prompt"]
        assert "has no chat template" in info.call_args[0][0]
    explicit = tiny_data(tmp_path, chat_template=False)._prepare(make_rows(1)[0], "x:1", tokenizer)
    assert explicit["prompt_text"] == make_rows(1)[0]["prompt"]


def test_each_rank_scores_its_share_of_the_validation_rows(tmp_path, tok):
    """The loader the score before training reads (outside Lightning's loop, which would
    shard it): 2 ranks see disjoint halves of the rows, together all of them."""
    from types import SimpleNamespace

    from tests.helpers import tiny_data, tiny_module

    seen = []
    for rank in range(2):
        dm = tiny_data(tmp_path, val_batch_size=2)
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, lightning_module=tiny_module(tok))
        dm.setup("fit")
        seen.append([tuple(row["prompt_ids"]) for batch in dm.val_dataloader() for row in batch])
    every = [tuple(row["prompt_ids"]) for row in dm.val_rows]
    assert len(seen[0]) == len(seen[1]) == len(every) // 2
    assert sorted(seen[0] + seen[1]) == sorted(every)
