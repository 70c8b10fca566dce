"""How much of the return's variance a critic could explain on the digitwise task.

The learning study reports the critic's explained variance (`critic/vf_explained_var`: 1 −
Var[R − V] / Var[R] over response tokens, R the Monte-Carlo return at λ_critic = γ = 1, i.e.
the ±1 outcome at every token). This script puts that number on a scale, on responses sampled
from the study's start (`vapo_lightning/assets/digitwise_sft`, validation problems, T = 1):

- **an oracle critic**: the value of each prefix under the sampling policy, with the reference
  solution in hand. A prefix that has left the reference solution is lost (V = −1); one that
  has not wins with (1 − p)^m, m the steps whose result is still to come, p the per-step
  error rate measured on the same samples (V = 2 (1 − p)^m − 1). It is what a critic that
  reads each step could learn, and what VAPO's token-level credit assignment needs (§3-4);
- **the group mean**: GRPO's baseline, one value per prompt, the same at every token (here
  the mean outcome of the prompt's other n − 1 samples, so that it has not seen the outcome
  it predicts);
- **the difficulty mean**: the mean outcome of the other samples with the same number of
  pairs K, a critic that knows the problem but reads none of the response.

    python benchmarks/bench_critic_ceiling.py --samples 8 --seed 0 --out benchmarks/results/critic_ceiling.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_lightning import core
from vapo_lightning.engines.sampler import sample_responses
from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.tasks import digitwise

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stamp import stamp

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "vapo_lightning/assets/digitwise_sft"
VAL = ROOT / "vapo_lightning/assets/digitwise/val.jsonl"


def lost_at(response: str, reference: str) -> int | None:
    """The character where `response` leaves `reference` (None: it never does)."""
    for i, (a, b) in enumerate(zip(response, reference)):
        if a != b:
            return i
    return None if len(response) == len(reference) else min(len(response), len(reference))


def result_offsets(reference: str) -> list[int]:
    """Character offset of each step's result digit in the reference (``x+y=z``: of z)."""
    return [i + 1 for i, c in enumerate(reference) if c == "="]


def step_error_rate(responses: list[str], references: list[str]) -> float:
    """p: of the steps a response reached while still on the reference, the share where it
    left it (at the step's operands or its result digit)."""
    reached = errors = 0
    for response, reference in zip(responses, references):
        lost = lost_at(response, reference)
        for end in result_offsets(reference):
            reached += 1
            if lost is not None and lost <= end:
                errors += 1
                break
    return errors / max(reached, 1)


def oracle_values(starts: list[int], response: str, reference: str, p: float) -> list[float]:
    """V*(s_t) per response token, t the token that starts at character `starts[t]`: the
    value of the prefix before it (the critic predicts it one position before the token).
    −1 once the prefix has left the reference, else 2 (1 − p)^m − 1 with m the results still
    to come (approximate within a step: its operands' share of p is not split off)."""
    lost = lost_at(response, reference)
    ends = result_offsets(reference)
    return [
        -1.0 if lost is not None and lost < start else 2.0 * (1.0 - p) ** sum(1 for e in ends if e >= start) - 1.0
        for start in starts
    ]


def explained_variance(values: list[float], returns: list[float]) -> float:
    """`core.explained_variance` over every token of the flat lists."""
    v, r = torch.tensor(values), torch.tensor(returns)
    return core.explained_variance(v, r, torch.ones_like(r, dtype=torch.bool)).item()


def leave_one_out(outcome: list[float], members, i: int) -> float:
    """The mean outcome of `members` other than sample i: a baseline that has not seen i's."""
    others = [outcome[j] for j in members if j != i]
    return statistics.mean(others)


def sample(rows: list[dict], tok, n: int, seed: int, max_new_tokens: int = 240) -> list[list[str]]:
    """`n` responses per row from the study's start, at temperature 1."""
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(POLICY).eval()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out: list[list[str]] = [[] for _ in rows]
    for _ in range(n):
        with torch.no_grad():
            ids = sample_responses(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                max_new_tokens=max_new_tokens,
                stop_token_ids=[tok.eos_token_id],
                pad_token_id=tok.pad_token_id,
                temperature=1.0,
            )
        for i, row in enumerate(ids.tolist()):
            out[i].append(tok.decode(row, skip_special_tokens=True))
    return out


def ceiling(rows: list[dict], responses: list[list[str]], tok) -> dict:
    """Explained variances of the oracle, the group mean and the difficulty mean, over every
    response token (and the EOS token) of every sample; also p and the success rate."""
    flat = [(row, r) for row, rs in zip(rows, responses) for r in rs]
    refs = [" " + row["solution"] for row, _ in flat]
    p = step_error_rate([r for _, r in flat], refs)
    outcome = [1.0 if digitwise.is_correct(r, row["answer"]) else -1.0 for row, r in flat]
    by_k: dict[int, list[int]] = defaultdict(list)  # K -> indices of its samples
    for i, (row, _) in enumerate(flat):
        by_k[row["difficulty"]].append(i)
    n = len(responses[0])
    returns, oracle, group, difficulty = [], [], [], []
    for i, ((row, response), ref, o) in enumerate(zip(flat, refs, outcome)):
        enc = tok(response, add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in enc["offset_mapping"]] + [len(response)]  # + EOS
        returns += [o] * len(starts)
        oracle += oracle_values(starts, response, ref, p)
        first = i - i % n
        group += [leave_one_out(outcome, range(first, first + n), i)] * len(starts)
        difficulty += [leave_one_out(outcome, by_k[row["difficulty"]], i)] * len(starts)
    return {
        "samples": len(flat),
        "tokens": len(returns),
        "success": statistics.mean(o > 0 for o in outcome),
        "p": p,
        "oracle": explained_variance(oracle, returns),
        "group mean": explained_variance(group, returns),
        "difficulty mean": explained_variance(difficulty, returns),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=8, help="samples per validation problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = list(read_jsonl(VAL))
    tok = AutoTokenizer.from_pretrained(POLICY)
    responses = sample(rows, tok, args.samples, args.seed)
    c = ceiling(rows, responses, tok)
    text = "\n".join(
        [
            "# What a critic could explain on the digitwise task\n",
            f"Command: `python benchmarks/bench_critic_ceiling.py --samples {args.samples} "
            f"--seed {args.seed}{f' --out {os.path.relpath(args.out.resolve(), ROOT)}' if args.out else ''}`  ",
            f"{stamp()}; one thread. {c['samples']} responses "
            f"({len(rows)} validation problems × {args.samples}, T = 1.0) of the study's start "
            f"`vapo_lightning/assets/digitwise_sft`, {c['tokens']} response tokens; success "
            f"{100 * c['success']:.1f} %, per-step error rate p = {100 * c['p']:.1f} %.\n",
            "Explained variance of the Monte-Carlo return (the ±1 outcome at every token, "
            "λ_critic = γ = 1), 1 − Var[R − V] / Var[R] over the tokens, as "
            "`critic/vf_explained_var`:\n",
            "| value | explained variance |",
            "|---|---|",
            f"| oracle critic (reads each step: −1 once a response has left the solution, else 2 (1 − p)^m − 1) | {c['oracle']:.2f} |",
            f"| group mean of the prompt's other {args.samples - 1} outcomes (GRPO's baseline, leave-one-out) | {c['group mean']:.2f} |",
            f"| mean outcome of the other samples at the problem's K (knows the problem, reads no response) | {c['difficulty mean']:.2f} |",
            "",
        ]
    )
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
