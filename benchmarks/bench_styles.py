"""How a policy answers the quickstart's arithmetic: worked solutions vs bare answers.

For each model (an HF folder: the shipped SFT checkpoint, or the policy a quickstart run
exported), samples `k` responses per validation prompt at temperature 1.0 (fixed seed) and
reports, overall and by difficulty, the share of responses that show their working (contain
``=``), and the accuracy of worked and of bare responses. This is what the quickstart's RL
changes: the SFT model answers most problems bare, which a 2.0 M-parameter model cannot do
reliably; reward teaches it to work problems out.

    .venv/bin/python benchmarks/bench_styles.py vapo_lightning/assets/quickstart_sft \\
        runs/quickstart/hf/policy --out benchmarks/results/quickstart_styles.md
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_lightning.sft import chat_prompt
from vapo_lightning.tasks import arithmetic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stamp import stamp  # noqa: E402

VAL = ROOT / "vapo_lightning" / "assets" / "arithmetic" / "val.jsonl"


def shows_work(response: str) -> bool:
    """A worked response writes at least one ``x op b = y`` step; a bare one only the box."""
    return "=" in response


@torch.no_grad()
def sample(path: str, rows: list[dict], k: int, seed: int, batch: int = 100) -> list[str]:
    """`k` temperature-1.0 responses per row (row-major), plain sampling, fixed seed."""
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(seed)
    out: list[str] = []
    for s in range(0, len(rows), batch):
        chunk = rows[s : s + batch]
        enc = tok(
            [chat_prompt(tok, r["prompt"]) for r in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        ids = model.generate(
            input_ids=enc["input_ids"].repeat_interleave(k, 0),
            attention_mask=enc["attention_mask"].repeat_interleave(k, 0),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=160,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        out += tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def table(path: str, rows: list[dict], k: int, seed: int) -> str:
    responses = sample(path, rows, k, seed)
    by_level: dict[int | str, Counter] = defaultdict(Counter)
    for i, response in enumerate(responses):
        row = rows[i // k]
        style = "worked" if shows_work(response) else "bare"
        ok = arithmetic.is_correct(response, row["answer"])
        for key in (row["difficulty"], "all"):
            by_level[key][style] += 1
            by_level[key][f"{style}_ok"] += ok

    def pct(a: int, b: int) -> str:
        return f"{100 * a / b:.1f}" if b else "-"

    lines = [
        f"### `{path}`",
        "",
        "| difficulty | accuracy % | worked share % | worked accuracy % | bare accuracy % |",
        "|---|---|---|---|---|",
    ]
    for key in [*range(1, arithmetic.MAX_DIFFICULTY + 1), "all"]:
        c = by_level[key]
        n = c["worked"] + c["bare"]
        lines.append(
            f"| {key} | {pct(c['worked_ok'] + c['bare_ok'], n)} | {pct(c['worked'], n)} "
            f"| {pct(c['worked_ok'], c['worked'])} | {pct(c['bare_ok'], c['bare'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="HF model folders (with their tokenizer)")
    parser.add_argument("--k", type=int, default=4, help="samples per validation prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    rows = arithmetic.read_jsonl(VAL)
    parts = [
        "# Worked vs bare answers on the quickstart's validation set",
        "",
        f"Regenerate: `.venv/bin/python benchmarks/bench_styles.py {' '.join(ns.models)}"
        f" --k {ns.k} --seed {ns.seed}`  ",
        stamp(),
        "",
        f"{len(rows)} validation prompts x {ns.k} samples at temperature 1.0 (seed {ns.seed});"
        " a response is *worked* if it writes a step (`=`), *bare* if it gives only"
        " `\\boxed{N}`.",
    ]
    for path in ns.models:
        parts += ["", table(path, rows, ns.k, ns.seed)]
    text = "\n".join(parts) + "\n"
    print(text)
    if ns.out is not None:
        ns.out.write_text(text)


if __name__ == "__main__":
    main()
