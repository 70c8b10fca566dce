"""`ValidationSamples`: `vapo validate` (or fit) writes what the model answered, as JSONL."""

import json

from tests.helpers import build_tokenizer, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.callbacks import ValidationSamples


def test_validation_generations_go_to_a_jsonl_file(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    out = tmp_path / "val" / "samples.jsonl"
    trainer = tiny_trainer(tmp_path, callbacks=[ValidationSamples(str(out))])
    trainer.validate(tiny_module(tok), datamodule=tiny_data(tmp_path))  # 6 prompts × n=2
    rows = [json.loads(line) for line in out.open()]
    assert len(rows) == 12
    assert {
        "step",
        "data_source",
        "prompt",
        "response",
        "reward",
        "correct",
        "ground_truth",
    } <= rows[0].keys()
    assert all(r["reward"] in (1.0, -1.0) and r["correct"] == (r["reward"] > 0) for r in rows)
    assert {r["prompt"] for r in rows} == {f"What is {a} + {b}?" for a, b in
                                            (((i % 7) + 1, (3 * i) % 5 + 1) for i in range(100, 106))}  # fmt: skip
