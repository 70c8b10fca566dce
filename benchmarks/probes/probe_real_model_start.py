"""Where SmolLM2-135M-Instruct starts on the word-problem task, by prompt and temperature: the
measurement behind configs/smollm2.yaml's prompt and T 0.4 (docs/own_model.md).

The first 48 validation problems × 2 samples of ≤ 192 tokens per cell, native sampler, bf16
autocast, chat template without a system message. Columns: accuracy as MathReward reads
answers (box, `Answer:` line, `####`, `The answer is N`), the share with an answer it reads,
the share boxed, accuracy of the last number in the response (what a looser reader would
give), truncated responses, mean length.

    .venv/bin/python benchmarks/probes/probe_real_model_start.py > benchmarks/results/real_model_start.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_real_model import MODEL, ROOT, cpu_facts
from benchmarks.stamp import stamp
from vapo_lightning.engines.sampler import sample_responses, weights_cast_once
from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
from vapo_lightning.rewards.math_answers import answer_forms, extract_answer

EXAMPLE = (
    "Example: Ann has 5 pens. She buys 7 more pens. How many pens does Ann have now?\n"
    "Solution: Ann starts with 5 pens and buys 7 more, so she has 5 + 7 = 12 pens. The answer is 12.\n\n"
    "Now solve this one the same way.\n{prompt}"
)
PROMPTS = {
    "boxed instruction": "{prompt}\nLet's think step by step and output the final answer within \\boxed{{}}.",
    "the question alone": "{prompt}",
    "one worked example (configs/smollm2.yaml)": EXAMPLE,
}
CELLS = [
    ("boxed instruction", 0.7),
    ("the question alone", 0.7),
    ("the question alone", 0.4),
    ("one worked example (configs/smollm2.yaml)", 0.7),
    ("one worked example (configs/smollm2.yaml)", 0.4),
]
NUMBER = re.compile(r"-?\d[\d,]*")


def as_int(text: str | None) -> int | None:
    try:
        return int(text.replace(",", "").strip().rstrip(".")) if text else None
    except ValueError:
        return None


def main() -> None:
    torch.manual_seed(0)
    tok = load_tokenizer(str(MODEL))
    model = build_policy(ModelSpec(name_or_path=str(MODEL)), tok).eval()
    rows = read_jsonl(ROOT / "vapo_lightning/assets/word_problems/val.jsonl")[:48]
    print("# SmolLM2-135M-Instruct's start on the word problems, by prompt and temperature\n")
    print("Command: `.venv/bin/python benchmarks/probes/probe_real_model_start.py`  ")
    print(f"{stamp()}  \n{cpu_facts()}  ")
    print("48 validation problems × 2 samples of ≤ 192 tokens per row; 4-bit GGUF weights dequantised.\n")
    print(
        "| prompt | T | accuracy (MathReward's reading) | answer read | boxed | last-number accuracy | truncated | mean tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, temperature in CELLS:
        messages = [
            [{"role": "system", "content": ""}, {"role": "user", "content": PROMPTS[name].format(prompt=r["prompt"])}]
            for r in rows
        ]
        prompts = [
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in messages
            for _ in range(2)
        ]
        gold = [int(r["answer"]) for r in rows for _ in range(2)]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), weights_cast_once():
            out = sample_responses(
                model,
                ids,
                mask,
                max_new_tokens=192,
                stop_token_ids=[tok.eos_token_id],
                pad_token_id=tok.pad_token_id,
                temperature=temperature,
            )
        lengths = (out != tok.pad_token_id).sum(-1).tolist()
        texts = [tok.decode(o[:n], skip_special_tokens=True) for o, n in zip(out, lengths)]
        k = len(texts)
        right = sum(as_int(extract_answer(t)) == g for t, g in zip(texts, gold)) / k
        read = sum(answer_forms(t)[0] for t in texts) / k
        boxed = sum(answer_forms(t)[1] for t in texts) / k
        last = sum(as_int((NUMBER.findall(t) or [None])[-1]) == g for t, g in zip(texts, gold)) / k
        truncated = sum(n >= 192 for n in lengths) / k
        print(
            f"| {name} | {temperature} | {right:.1%} | {read:.1%} | {boxed:.1%} | {last:.1%} | "
            f"{truncated:.1%} | {sum(lengths) / k:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
