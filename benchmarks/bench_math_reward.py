"""Math checks per second: math-verify in-process (reference), and `MathVerifier` with one worker
process and batched across N worker processes, on real gold answers (MATH-500 and GSM8K test)
in a mix of correct responses spelled differently from the gold answer (so they reach
math-verify, not the exact-match fast path) and wrong ones.

    .venv/bin/python benchmarks/bench_math_reward.py --data DIR --workers 1 2 --repeats 3 > benchmarks/results/math_reward.md

The repository does not ship these sets: DIR must hold them as released, `math500.json` (a
JSON list of objects with an "answer", the MATH-500 copy of agentica-project/deepscaler,
`deepscaler/data/test/math.json`) and `gsm8k_test.jsonl` (openai/grade-school-math's
`grade_school_math/data/test.jsonl`, answers ending in `#### N`).

Prints the report: `> benchmarks/results/math_reward.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

from vapo_lightning.rewards.math import MathVerifier, extract_answer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stamp import stamp

DATA_FILES = ("math500.json", "gsm8k_test.jsonl")
TIMEOUT_S = 3.0  # each check's hard limit
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FRAC = re.compile(r"(-?)\\[dt]?frac\{?(\d+)\}?\{?(\d+)\}?")


def correct_form(answer: str) -> str:
    """An equivalent spelling that differs from the gold answer where one is easy to make
    (numbers, fractions); other answers are repeated as they are (the fast path)."""
    plain = answer.replace(",", "") if re.fullmatch(r"[\d,]+", answer) else answer
    if NUMBER.fullmatch(plain):
        return f"{Fraction(plain)}.0" if "." not in plain else f"{plain}0"
    if m := FRAC.fullmatch(answer):
        sign, p, q = m.groups()
        return f"{sign}{p}/{q}"
    return answer


def wrong_form(answer: str, other: str) -> str:
    plain = answer.replace(",", "") if re.fullmatch(r"[\d,]+", answer) else answer
    if NUMBER.fullmatch(plain):
        return str(Fraction(plain) + 1)
    return other  # another problem's gold answer


def make_pairs(data: Path, seed: int = 0) -> list[tuple[str, str]]:
    math500 = [row["answer"] for row in json.loads((data / "math500.json").read_text())]
    with open(data / "gsm8k_test.jsonl") as f:
        gsm8k = [json.loads(line)["answer"] for line in f]
    pairs = []
    for golds in (math500, gsm8k):
        for i, gold in enumerate(golds):
            answer = extract_answer(gold) if "####" in gold else gold
            other = golds[(i + 1) % len(golds)]
            other = extract_answer(other) if "####" in other else other
            pairs.append((f"Reasoning...\nThe answer is $\\boxed{{{correct_form(answer)}}}$.", gold))
            pairs.append((f"Reasoning...\nThe answer is $\\boxed{{{wrong_form(answer, other)}}}$.", gold))
    random.Random(seed).shuffle(pairs)
    return pairs


def bench_in_process(pairs: list[tuple[str, str]]) -> float:
    """math-verify called directly in this process, with no time limit (reference only)."""
    from math_verify import parse, verify

    start = time.perf_counter()
    for response, gold in pairs:
        gold = extract_answer(gold) if "####" in gold else gold
        verify(
            parse("\\boxed{" + gold + "}", parsing_timeout=None),
            parse("\\boxed{" + (extract_answer(response) or "") + "}", parsing_timeout=None),
            timeout_seconds=None,
        )
    return len(pairs) / (time.perf_counter() - start)


def bench_pool(pairs, workers: int, repeats: int, batch: int) -> dict:
    verifier = MathVerifier(num_workers=workers, timeout_s=TIMEOUT_S)
    start = time.perf_counter()
    verifier.check_batch(*zip(*pairs[: workers * 2]))  # start the workers
    startup = time.perf_counter() - start
    rates, correct = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        verdicts = []
        for i in range(0, len(pairs), batch):
            chunk = pairs[i : i + batch]
            verdicts += verifier.check_batch([r for r, _ in chunk], [g for _, g in chunk])
        rates.append(len(pairs) / (time.perf_counter() - start))
        correct = sum(bool(v) for v in verdicts)
    stats = verifier.stats
    verifier.close()
    return {"startup": startup, "rates": rates, "correct": correct, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        metavar="DIR",
        help="directory holding math500.json (MATH-500) and gsm8k_test.jsonl (GSM8K test), "
        "as released; the repository does not ship them",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512, help="checks per check_batch call")
    args = parser.parse_args()
    missing = [name for name in DATA_FILES if not (args.data / name).is_file()]
    if missing:
        parser.error(
            f"--data {args.data}: no {' or '.join(missing)} there. This benchmark needs the "
            "MATH-500 and GSM8K test sets, which the repository does not ship; the docstring "
            "of benchmarks/bench_math_reward.py names their sources"
        )

    pairs = make_pairs(args.data)
    batch = f" --batch {args.batch}" if args.batch != 512 else ""
    workers = " ".join(map(str, args.workers))
    print("# Math reward: checks per second\n\nCommand (repository root):\n")
    print(
        f"    .venv/bin/python benchmarks/bench_math_reward.py --data DIR --workers {workers} "
        f"--repeats {args.repeats}{batch} > benchmarks/results/math_reward.md\n"
    )
    print(
        "DIR holds MATH-500 (`math500.json`) and GSM8K test (`gsm8k_test.jsonl`) as released; the\n"
        "repository does not ship them (the script's docstring names their sources).\n"
    )
    print(f"{stamp()}  ")
    print(
        f"Workload: {len(pairs):,} checks = every MATH-500 answer and every GSM8K test answer, each once\n"
        "with a correct response and once with a wrong one, shuffled, sent in `check_batch` calls of\n"
        f"{args.batch}. Correct responses are spelled differently from the gold answer where that is\n"
        "easy (integers as `N.0`, fractions as `p/q`), so they reach math-verify; other correct answers\n"
        "repeat the gold text and take the exact-match fast path. Wrong responses are gold+1 for\n"
        "numbers (integer fast path) and another problem's gold answer otherwise. Each check has a\n"
        f"{TIMEOUT_S:g} s hard limit.\n"
    )
    ref = bench_in_process(pairs)
    print("| setting | checks/s (median of runs) | runs | judged correct | pooled / fast | start-up s |")
    print("|---|---|---|---|---|---|")
    print(f"| math-verify in-process, no time limit (reference) | {ref:,.0f} | 1 | | | |")
    medians: dict[int, float] = {}
    for workers in args.workers:
        out = bench_pool(pairs, workers, args.repeats, args.batch)
        rates = ", ".join(f"{r:,.0f}" for r in out["rates"])
        s = out["stats"]
        print(
            f"| MathVerifier, {workers} worker process(es) | {statistics.median(out['rates']):,.0f}"
            f" | {rates} | {out['correct']}/{len(pairs)} | {s.pooled} / {s.fast} | "
            f"{out['startup']:.2f} |"
        )
        medians[workers] = statistics.median(out["rates"])
    if 1 in medians and len(medians) > 1:
        most = max(medians)
        print(
            f"\nReading: one worker process checks {medians[1] / ref:.2f}x as fast as math-verify in-process "
            "(the host's fast path, normalised string and integer equality, answers about half of the "
            f"checks without parsing); {most} workers check {medians[most] / medians[1]:.2f}x as fast as one."
        )


if __name__ == "__main__":
    main()
