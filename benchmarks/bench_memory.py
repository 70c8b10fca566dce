"""Peak memory of one actor update against answer length.

A tiny Llama given Qwen2.5's 151,936-token vocabulary, so the (tokens, vocabulary) logits and
their gradient dominate as they do at 7 B, on the CPU in fp32. Each case runs in a process of
its own and reports the growth of its peak resident memory (`ru_maxrss`) over the update.

- by default: micro-batches of a fixed number of responses against micro-batches by a token
  budget (`model.algorithm.max_tokens_per_micro_batch`), 16 responses of `L` tokens after
  64-token prompts, one mini-batch, through the full logits;
- `--head`: one micro-batch of 2,048 answer tokens (4 x 512, 2 x 1,024, 1 x 2,048), its
  log-probs and entropies taken through the full logits and from the LM head's input
  (`vapo_lightning.head_logprobs`, the default for this model).

    python benchmarks/bench_memory.py > benchmarks/results/memory_token_budget.md
    python benchmarks/bench_memory.py --head > benchmarks/results/memory_head_logprobs.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stamp import stamp  # noqa: E402

VOCAB, PROMPT, RESPONSES = 151_936, 64, 16
LENGTHS = (128, 256, 512, 768)
CASES = {
    "4 responses per micro-batch": {"micro_batch_size": 4},
    "2,048 tokens per micro-batch": {"micro_batch_size": 16, "max_tokens_per_micro_batch": 2048},
}
HEAD_TOKENS, HEAD_LENGTHS = 2048, (512, 1024, 2048)  # --head: one micro-batch of 2,048 answer tokens
ONE = "one micro-batch"
PATHS = {"full logits": "logits", "from the head's input": "hidden"}


def one(length: int, algorithm: dict, responses: int = RESPONSES, path: str = "logits") -> dict:
    """One actor update of `responses` answers of `length` tokens; `path` "logits": the
    log-probs through the full logits, as for a model whose head `plain_head` does not take."""
    import torch

    from vapo_lightning import head_logprobs
    from vapo_lightning.config import Algorithm
    from vapo_lightning.models import ModelSpec, build_policy
    from vapo_lightning.rollout import Rollout
    from vapo_lightning.updates import OldPolicy, RankOps, micro_batches, update_actor

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }

    class Tok:  # what build_policy reads of a tokenizer
        pad_token_id, eos_token_id, bos_token_id = 0, 1, 2

        def __len__(self) -> int:
            return VOCAB

    policy = build_policy(ModelSpec(config=cfg), Tok())
    if path == "logits":
        head_logprobs.plain_head = lambda model: None  # (this process only)
    assert (head_logprobs.plain_head(policy) is not None) == (path == "hidden")
    B, T = responses, length
    ids = torch.randint(3, VOCAB, (B, PROMPT + T))
    r = Rollout(
        input_ids=ids,
        attention_mask=torch.ones(B, PROMPT + T, dtype=torch.long),
        response_mask=torch.ones(B, T, dtype=torch.bool),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
        scores=torch.randn(B),
        correct=torch.zeros(B, dtype=torch.bool),
    )
    advantages, old = torch.randn(B, T), OldPolicy(torch.full((B, T), -11.0), None, None)
    algo = Algorithm(mini_batch_size=B, nll_coef=0.0, **algorithm)
    micros = len(list(micro_batches(r, algo.micro_batch_size, max_tokens=algo.max_tokens_per_micro_batch)))
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    update_actor(policy, opt, r, old, advantages, [torch.arange(B)], algo, 1.0, 1.0, RankOps())
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"growth_gib": (after - before) / 2**20, "micro_batches": micros, "seconds": seconds}


def run(length: int, case: str, responses: int = RESPONSES, path: str = "logits") -> dict:
    """`one` in a process of its own (its own peak)."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", str(length), case, str(responses), path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def token_budget() -> None:
    rows = {(case, n): run(n, case) for case in CASES for n in LENGTHS}
    print("# Peak memory of an actor update against answer length\n")
    print("Command: `python benchmarks/bench_memory.py > benchmarks/results/memory_token_budget.md`  ")
    print(f"{stamp()}  ")
    print(f"2 threads, fp32, load average at end {os.getloadavg()[0]:.2f}  ")
    print(
        f"Workload: one actor update (one mini-batch) of {RESPONSES} responses of L tokens after "
        f"{PROMPT}-token prompts; a 2-layer Llama of width 64 with a {VOCAB:,}-token vocabulary "
        "(Qwen2.5's), so the logits and their gradient dominate the memory; log-probs through the "
        "full logits.\n"
    )
    print("| micro-batches | " + " | ".join(f"L = {n}" for n in LENGTHS) + " |")
    print("|---|" + "---|" * len(LENGTHS))
    for case in CASES:
        cells = [
            f"{rows[case, n]['growth_gib']:.2f} GiB ({rows[case, n]['micro_batches']} micro-batches, "
            f"{rows[case, n]['seconds']:.1f} s)"
            for n in LENGTHS
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")
    print(
        "\nGrowth of the process's peak resident memory over the update (`ru_maxrss`), one process "
        "per cell. By responses, the micro-batch's tokens, and so its logits, grow with L; by a "
        "token budget the micro-batches multiply instead and the peak stays flat."
    )


def head() -> None:
    import torch

    from vapo_lightning.head_logprobs import rows_per_chunk

    got = {(p, n): run(n, ONE, HEAD_TOKENS // n, path) for p, path in PATHS.items() for n in HEAD_LENGTHS}
    logits_gib, chunk = HEAD_TOKENS * VOCAB * 4 / 2**30, rows_per_chunk(VOCAB, torch.device("cpu"))
    print("# Peak memory of an actor micro-batch: full logits against the LM head's input\n")
    print("Command: `python benchmarks/bench_memory.py --head > benchmarks/results/memory_head_logprobs.md`  ")
    print(f"{stamp()}  ")
    print(f"2 threads, fp32, load average at end {os.getloadavg()[0]:.2f}  ")
    print(
        f"Workload: one actor update of one micro-batch of {HEAD_TOKENS:,} answer tokens (L tokens "
        f"each, after {PROMPT}-token prompts), its log-probs and entropies; a 2-layer Llama of "
        f"width 64 with a {VOCAB:,}-token vocabulary (Qwen2.5's), tied embeddings. Its (tokens, "
        f"vocabulary) logits are {logits_gib:.2f} GiB in fp32, and so is their gradient.\n"
    )
    answers = {n: f"{HEAD_TOKENS // n} answer{'s' if HEAD_TOKENS // n > 1 else ''}" for n in HEAD_LENGTHS}
    print("| log-probs | " + " | ".join(f"L = {n} ({answers[n]})" for n in HEAD_LENGTHS) + " |")
    print("|---|" + "---|" * len(HEAD_LENGTHS))
    for p in PATHS:
        cells = [f"{got[p, n]['growth_gib']:.2f} GiB ({got[p, n]['seconds']:.1f} s)" for n in HEAD_LENGTHS]
        print(f"| {p} | " + " | ".join(cells) + " |")
    print(
        "\nGrowth of the process's peak resident memory over the update (`ru_maxrss`), one process "
        "per cell, under the load average above (the seconds are noisy). Through the full logits "
        "the peak holds the logits, their gradient and the kernels' chunk temporaries, whatever "
        "the split into answers; from the head's input, the logits exist one chunk of "
        f"{chunk} positions at a time (`head_logprobs.rows_per_chunk`), in the forward and in the "
        "backward, which computes each chunk's logits a second time."
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=4, metavar=("LENGTH", "CASE", "RESPONSES", "PATH"))
    ap.add_argument("--head", action="store_true", help="full logits against the LM head's input")
    args = ap.parse_args()
    if args.one:
        length, case, responses, path = args.one
        algorithm = {"micro_batch_size": int(responses)} if case == ONE else CASES[case]
        print(json.dumps(one(int(length), algorithm, int(responses), path)))
    elif args.head:
        head()
    else:
        token_budget()


if __name__ == "__main__":
    main()
