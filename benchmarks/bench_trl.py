"""Throughput vs TRL: a VAPO rollout step against TRL's PPOTrainer (trl 1.12.0, the
last release with `trl.experimental.ppo`) and GRPOTrainer (trl 1.16.0), on the same work.

One entry point. It creates the two TRL virtual environments if missing (torch==2.13.0 first,
then trl), writes ONE set of artefacts all three load (the quickstart policy's shape: Llama,
4 layers, hidden 256, random init, fp32; the quickstart tokenizer; 16 arithmetic prompts; a
reward model and a value model on the same architecture), starts one child per system
(benchmarks/trl_children/, each with its own venv's python) and then alternates their
rollout steps one at a time: each child does a discarded warm-up step, then the parent hands
out "go"s round-robin (rotating the order each round), so no two systems ever run at once.

Per step, all three: 16 prompts × 4 samples = 64 responses of exactly 128 new tokens
(EOS suppressed by min_new_tokens), one epoch, one mini-batch of 64 (one optimizer step per
model), no gradient checkpointing; by default fp32 (`--precision bf16`: mixed precision) and
1 torch thread per child (`--threads`).

    .venv/bin/python benchmarks/bench_trl.py --precision bf16 --compile --micro-batch 32 \
        --out benchmarks/results/trl_bf16_compile_micro32_xeon.md

The report goes to `--out` (default `benchmarks/results/trl.md`, which is not kept in the
repository: the committed reports are named by settings and CPU, `benchmarks/results/trl_*.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
VENVS = BENCH / ".venvs"
CHILDREN = BENCH / "trl_children"
TOKENIZER = ROOT / "vapo_lightning/assets/quickstart_sft"
PROMPTS_FILE = ROOT / "vapo_lightning/assets/arithmetic/train.jsonl"
SHAPES = {  # the policy's shape; critic, reward and value models share its backbone
    "quickstart": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
    },
    "gpt2-small": {
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "max_position_embeddings": 512,
    },
}
TRL = {"trl_ppo": "1.12.0", "trl_grpo": "1.16.0"}
PRECISION = {
    "fp32": "fp32 (`bf16=False`: TRL's configs default bf16 to True)",
    "bf16": "bf16 mixed precision in all three: fp32 weights and optimizer, bf16 autocast around "
    "every forward (VAPO: Lightning `precision='bf16-mixed'`; TRL: `bf16=True`, its default, "
    "through accelerate; that reaches only the forward of the model accelerate prepared, so TRL "
    "PPO's generation and reference, reward and value forwards would stay fp32: its child runs "
    "the whole step under `torch.autocast` as well)",
}
NAMES = {"vapo": "VAPO (vapo-lightning)", "trl_ppo": "TRL PPOTrainer 1.12.0", "trl_grpo": "TRL GRPOTrainer 1.16.0"}


def log(msg: str) -> None:
    print(f"[bench_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------- environments


def venv_python(system: str, sites: dict[str, str]) -> Path:
    if system == "vapo" or system in sites:
        return Path(sys.executable)
    return VENVS / f"trl-{TRL[system]}" / "bin" / "python"


def ensure_venv(version: str) -> None:
    """torch==2.13.0 first (the local CPU wheel; unpinned, pip would fetch a CUDA build),
    then trl==version, letting pip resolve transformers & co. with torch already pinned."""
    env = VENVS / f"trl-{version}"
    py = env / "bin" / "python"
    ok = (
        py.exists()
        and subprocess.run(
            [str(py), "-c", f"import trl, torch; assert trl.__version__ == '{version}'"],
            capture_output=True,
        ).returncode
        == 0
    )
    if ok:
        return
    log(f"creating {env.relative_to(ROOT)} (torch==2.13.0, then trl=={version})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"trl=={version}", "torch==2.13.0"], check=True)


# ---------------------------------------------------------------- shared artefacts


def write_artefacts(
    out: Path,
    prompts: int,
    n: int,
    T: int,
    threads: int,
    shape: str,
    device: str,
    precision: str,
    compile: bool = False,
    micro_batch: dict[str, int] | None = None,
) -> dict:
    """The one set of inputs all three systems load (save_pretrained, safetensors, fp32)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    sys.path.insert(0, str(ROOT))
    from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(str(TOKENIZER))
    policy = build_policy(ModelSpec(config=SHAPES[shape]), tok)  # vocab = len(tok), special ids aligned
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    heads = {}
    for name in ("reward", "value"):
        cfg = policy.config.__class__.from_dict(policy.config.to_dict())
        cfg.num_labels, cfg.architectures = 1, None
        # VAPO's build_critic passes classifier_dropout=0.0 to from_pretrained, which a Llama
        # config only accepts when it already has the attribute.
        cfg.classifier_dropout = 0.0
        model = AutoModelForSequenceClassification.from_config(cfg).float()
        # Both start from the policy's backbone (the usual PPO set-up); fresh scalar heads.
        model.model.load_state_dict(policy.model.state_dict())
        torch.nn.init.normal_(model.score.weight, std=1.0 / (cfg.hidden_size + 1))
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
        heads[name] = sum(p.numel() for p in model.parameters())
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    rows = rows[:prompts]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lens = [len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    bench = {
        "prompts": prompts,
        "n": n,
        "max_new_tokens": T,
        "threads": threads,
        "device": device,
        "precision": precision,
        "compile": compile,
        "micro_batch": {s: (micro_batch or {}).get(s, prompts * n) for s in NAMES},
    }
    (out / "bench.json").write_text(json.dumps(bench))
    return {
        "policy_params": sum(p.numel() for p in policy.parameters()),
        "head_params": heads,
        "vocab": len(tok),
        "prompt_tokens": (min(lens), max(lens)),
    }


# ---------------------------------------------------------------- children


class Child:
    def __init__(self, system: str, artefacts: Path, steps: int, logdir: Path, threads: int, site: str | None):
        self.system = system
        self.log_path = logdir / f"{system}.log"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "WANDB_DISABLED": "true",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("VIRTUAL_ENV", None)
        if site:  # this TRL release installed in a folder (--trl-site), not in a venv
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        cmd = [
            str(venv_python(system, {system: site} if site else {})),
            str(CHILDREN / f"{system}.py"),
            "--artefacts",
            str(artefacts),
            "--steps",
            str(steps),
        ]
        self.stderr = self.log_path.open("w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env, cwd=str(ROOT)
        )
        self.steps: list[dict] = []

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"{self.system} child exited ({self.proc.returncode}):\n{tail}")
        msg = json.loads(line)
        self.steps.append(msg)
        return msg

    def go(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


# ---------------------------------------------------------------- report


def stats(xs: list[float]) -> tuple[float, float, float]:
    return min(xs), statistics.median(xs), max(xs)


def fmt3(xs: list[float], digits: int = 2) -> str:
    lo, med, hi = stats(xs)
    return f"{lo:.{digits}f} / **{med:.{digits}f}** / {hi:.{digits}f}"


def machine_facts(gpu: str | None) -> list[str]:
    """The stamp, and what else the timings depend on: RAM, the GPU the children used, the OS."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.stamp import stamp

    mem = next(
        line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    return [stamp(), f"{int(mem) / 2**20:.1f} GiB RAM, {gpu or 'no GPU'}; {platform.platform()}"]


def report(args, facts, art_info, children, load_start, load_end, wall, cmd) -> str:
    order = ["vapo", "trl_ppo", "trl_grpo"]
    meas = {s: children[s].steps[1:] for s in order}
    secs = {s: [m["seconds"] for m in meas[s]] for s in order}
    tps = {s: [m["gen_tokens"] / m["seconds"] for m in meas[s]] for s in order}
    rss = {s: children[s].steps[-1]["peak_rss_mib"] for s in order}
    gpu_mem = {s: children[s].steps[-1]["peak_gpu_mib"] for s in order if "peak_gpu_mib" in children[s].steps[-1]}
    med = {s: statistics.median(secs[s]) for s in order}
    lens = {
        s: (min(m["len_min"] for m in children[s].steps), max(m["len_max"] for m in children[s].steps)) for s in order
    }
    tokens = {s: sorted({m["gen_tokens"] for m in children[s].steps}) for s in order}
    timing = [m["timing"] for m in meas["vapo"]]
    t_med = {k: statistics.median(t[k] for t in timing) for k in timing[0]}
    critic_upd = [t["update_critic"] for t in timing]
    critic_all = [t["update_critic"] + t.get("values", 0.0) for t in timing]
    L = []
    w = L.append
    w("# Throughput vs TRL: one rollout step, same work\n")
    w(f"Command: `{cmd}`  ")
    w(f"{facts[0]}  ")
    w(f"Machine: {facts[1]}  ")
    w(
        f"Load average (1/5/15 min) at start: {load_start}; at end: {load_end} (the end includes "
        f"the benchmark's own children; this is one run, {wall / 60:.1f} min wall in all)  "
    )
    vers = {s: children[s].steps[0].get("versions", {}) for s in order}
    w(
        "Versions: "
        + "; ".join(f"{NAMES[s]}: " + ", ".join(f"{k} {v}" for k, v in vers[s].items()) for s in order)
        + "\n"
    )
    w("## The work, per rollout step (identical in all three)\n")
    shape = SHAPES[args.shape]
    w(
        f"- Model: shape `{args.shape}` (Llama, {shape['num_hidden_layers']} layers, hidden "
        f"{shape['hidden_size']}, {shape['num_attention_heads']} heads, vocab {art_info['vocab']}), "
        f"{art_info['policy_params'] / 1e6:.2f} M parameters, random init (seed 0), fp32, saved once with "
        "`save_pretrained` and loaded by every child; the quickstart tokenizer; "
        + ("on the GPU (fp32 matmuls without TF32, torch's default)." if args.device == "cuda" else "on the CPU.")
    )
    w(
        f"- Prompts: the first {args.prompts} prompts of `vapo_lightning/assets/arithmetic/train.jsonl` "
        f"({art_info['prompt_tokens'][0]}–{art_info['prompt_tokens'][1]} tokens), the same {args.prompts} "
        f"every step, × {args.n} samples = {args.prompts * args.n} responses."
    )
    w(
        f"- Response length forced to exactly {args.tokens} new tokens (EOS suppressed by `min_new_tokens`; "
        "TRL PPO additionally runs with `stop_token=None`). Measured lengths (min–max over all steps, "
        "warm-up included): "
        + "; ".join(f"{NAMES[s]} {lens[s][0]}–{lens[s][1]}" for s in order)
        + "; generated tokens per step: "
        + "; ".join(f"{NAMES[s]} {tokens[s]}" for s in order)
        + "."
    )
    batch = args.prompts * args.n
    micro = {s: args.micro_batch.get(s, batch) for s in order}

    def split(s: str) -> str:
        m = micro[s]
        if m == batch:
            return f"{NAMES[s]} in one forward + backward per model"
        knob = (
            f"`micro_batch_size={m}`"
            if s == "vapo"
            else f"`per_device_train_batch_size={m}`, `gradient_accumulation_steps={batch // m}`"
            + (
                f", `steps_per_generation={batch // m}` (one generation still feeds one optimizer step)"
                if s == "trl_grpo"
                else ""
            )
        )
        return f"{NAMES[s]} in micro-batches of {m} rows, gradients accumulated ({knob})"

    w(
        f"- One epoch, one mini-batch of {batch} (one optimizer step per model per rollout): "
        + "; ".join(split(s) for s in order)
        + ". "
        + "AdamW (`torch.optim.AdamW` everywhere: TRL with `optim='adamw_torch'`), grad-norm "
        f"clipping 1.0, {PRECISION[args.precision]}, {args.threads} torch "
        "thread(s) per child, gradient checkpointing OFF in all three (TRL's default is ON; it "
        "would add a recomputed forward to its updates)."
    )
    if args.compile:
        w(
            "- `torch.compile` in all three, each through its own switch (the compile itself happens "
            "in the discarded warm-up step): VAPO `VAPOModule(torch_compile=True)` compiles the policy "
            "and the critic for every forward but the sampler's; TRL `torch_compile=True` makes "
            "accelerate compile the model it prepares (GRPO: the policy). PPOTrainer 1.12 ignores "
            "that flag (it builds its own Accelerator without the Trainer's dynamo plugin), so its "
            "child sets accelerate's `ACCELERATE_DYNAMO_BACKEND=inductor`, which compiles the "
            "policy-and-value wrapper's training forward. `generate` and PPO's reference, reward "
            "and rollout value forwards run eager there."
        )
    w(
        f'- Timing: seconds from the parent\'s "go" to the end of the step, measured inside each '
        "child (process start-up and model loading excluded; the trainer loop's work between "
        f"steps included). {args.reps} measured steps per system after one discarded warm-up step, "
        "alternated one step at a time (round-robin, order rotated each round), so the three "
        "never ran at the same time. Peak RSS: the child's `ru_maxrss` after its last step.\n"
    )
    w("## Results\n")
    w(
        "| system | s / rollout step, min / **median** / max | generated tokens/s, min / **median** / max | peak RSS MiB |"
        + (" peak GPU MiB (allocated) |" if gpu_mem else "")
    )
    w("|---|---|---|---|" + ("---|" if gpu_mem else ""))
    for s in order:
        w(
            f"| {NAMES[s]} | {fmt3(secs[s])} | {fmt3(tps[s], 0)} | {rss[s]:.0f} |"
            + (f" {gpu_mem[s]:.0f} |" if gpu_mem else "")
        )
    w("")
    r_ppo, r_grpo = med["vapo"] / med["trl_ppo"], med["vapo"] / med["trl_grpo"]
    w(f"Ratios of medians: **VAPO / TRL PPO = {r_ppo:.3f}**, **VAPO / TRL GRPO = {r_grpo:.3f}**  ")
    w(
        f"(per-round ratios VAPO / TRL PPO: min {min(a / b for a, b in zip(secs['vapo'], secs['trl_ppo'])):.3f}, "
        f"max {max(a / b for a, b in zip(secs['vapo'], secs['trl_ppo'])):.3f}; VAPO / TRL GRPO: min "
        f"{min(a / b for a, b in zip(secs['vapo'], secs['trl_grpo'])):.3f}, max "
        f"{max(a / b for a, b in zip(secs['vapo'], secs['trl_grpo'])):.3f})\n"
    )
    w("VAPO's phases (median s over the measured steps, from the module's `timing_s/*` metrics):\n")
    w("| " + " | ".join(sorted(t_med)) + " |\n|" + "---|" * len(t_med))
    w("| " + " | ".join(f"{t_med[k]:.3f}" for k in sorted(t_med)) + " |\n")
    extra = med["vapo"] - med["trl_grpo"]
    cu, ca = statistics.median(critic_upd), statistics.median(critic_all)
    w("## Targets\n")
    w("| target | measured | met? |\n|---|---|---|")
    w(
        f"| VAPO step ≤ 0.5 × TRL PPO's step | {med['vapo']:.2f} s vs 0.5 × {med['trl_ppo']:.2f} = "
        f"{0.5 * med['trl_ppo']:.2f} s (ratio {r_ppo:.3f}) | {'**met**' if r_ppo <= 0.5 else '**not met**'} |"
    )
    w(
        f"| VAPO's extra time over TRL GRPO ≤ its critic's own forward/backward time | extra = "
        f"{med['vapo']:.2f} − {med['trl_grpo']:.2f} = {extra:.2f} s; critic update (fwd + bwd + AdamW step, "
        f"`timing_s/update_critic`) = {cu:.2f} s; critic incl. any separate no-grad value forward "
        f"(`+ timing_s/values`, none at one epoch over one mini-batch) = {ca:.2f} s | {'**met**' if extra <= cu else ('**met only counting the value forward**' if extra <= ca else '**not met**')} |\n"
    )
    olp = t_med.get("old_log_prob", 0.0)
    if olp > 0:  # a two-pass update (more than one mini-batch or epoch)
        w(
            f"For context (not the target): VAPO's extra time less its old-log-prob forward, which GRPO "
            f"skips by configuration = {extra - olp:.2f} s, against the critic's {cu:.2f} s (update) / "
            f"{ca:.2f} s (update + value forward).\n"
        )
    w("## What makes the comparison unequal (beyond the settings forced equal above)\n")
    w(
        "- **TRL PPO does more work per step by design**: a frozen reference policy (a no-grad "
        "forward for the KL penalty, which runs even at kl_coef=0: PPOTrainer has no switch to "
        "skip it) and a separate reward *model* forward (VAPO and GRPO use a rule-based reward). "
        "It also returns the generation scores (`output_scores=True`) and computes old log-probs from "
        "them instead of a separate forward, and trains policy and value in one joint backward "
        "with one optimizer over both (vf_coef 0.1), where VAPO does two separate updates."
    )
    w(
        "- **TRL GRPO does less work per step by design**: no critic (no value forward, no critic "
        "update). With one iteration and steps_per_generation=1 it skips the no-grad old-log-prob "
        "forward (it uses the detached current log-probs); VAPO does the same at one epoch over one "
        "mini-batch (on-policy, `model.algorithm.one_pass`: pi_old from the actor update's forward; "
        "V_old is a no-grad pass of the critic; "
        f"`timing_s/old_log_prob` = {t_med.get('old_log_prob', 0.0):.2f} s, `timing_s/values` = "
        f"{t_med.get('values', 0.0):.2f} s in this run). With beta=0 neither has a reference model. "
        "So VAPO's extra time over GRPO is the critic's update + GAE."
    )
    w(
        "- **Generation**: VAPO samples with its own decoding loop over the model's forward "
        "(`engines.sampler.sample_responses`: KV cache written in place, finished responses leave the "
        "batch; at this forced length only the first matters, 1.6-1.7x faster per token than "
        "`generate` in `benchmarks/results/generation.md`); both TRL trainers call `transformers`' "
        "`generate`. This is part of what is compared: each system's own rollout path."
    )
    if args.precision == "bf16" and args.device == "cpu":
        from vapo_lightning.attention import cpu_has_amx

        decode = (
            "but decoding's, which runs in bf16 over a bf16 KV cache on a CPU with AMX "
            "(`generation.cache_dtype`); this one has AMX"
            if cpu_has_amx()
            else "including decoding's, over an fp32 KV cache, as on every CPU without AMX, where "
            "torch's bf16 attention kernels are the slow ones (`attention.decodes_in_autocast_dtype`)"
            "; this one has none"
        )
        w(
            "- **Attention under bf16 autocast**: VAPO's models run attention in fp32 on the CPU in "
            f"every forward {decode} (`vapo_lightning/attention.py`: torch's bf16 "
            "flash-attention backward is the slower one there); both TRL trainers run "
            "transformers' SDPA as it comes (bf16 under autocast, an fp32 key cache cast at every "
            "decoding step). These are VAPO's own optimisations, compared as part of each "
            "system's path."
        )
    w(
        "- Rewards: VAPO runs its MathReward (math-verify in 1 worker process; random-init responses "
        "hold no `\\boxed{}`, so it reduces to answer extraction); GRPO a regex `\\boxed{}` check in "
        "process; PPO a reward-model forward. VAPO's reward phase: "
        f"{t_med.get('reward', float('nan')):.3f} s median."
    )
    w(
        "- Losses differ in detail (VAPO: token-level clipped PG with clip-higher, positive-example "
        "NLL term, value clipping, length-adaptive GAE; GRPO: loss_type='dapo', epsilon_high 0.28 set "
        "to match VAPO; PPO: symmetric 0.2 clip, per-step KL reward); their cost is negligible next to "
        "the forwards and backwards on these shapes."
    )
    w(
        f"- Threads: {args.threads} torch thread(s) per child, for all three"
        + (" (CPU-side work only: the model runs on the GPU)." if args.device == "cuda" else ".")
        + " On this shared 2-core "
        "machine under load (other engineers' jobs), 2 OpenMP threads per process were pathological "
        "in a probe before this run: `generate` took ~0.35 s per token instead of ~0.02 s with 1 "
        "thread (a descheduled peer stalls every parallel region of the many tiny ops), which would "
        "have measured the machine's scheduler rather than the trainers; `--threads 2` reruns it so."
    )
    w(
        "- Random weights: EOS is suppressed, so the sampled text is gibberish and rewards are all "
        "wrong (GRPO's group advantages are then all zero: its backward still runs in full, with a "
        "zero gradient); that does not change the work. Tiny model, few CPU threads: Python / framework "
        "overhead weighs far more than it would on a GPU at the paper's scale.\n"
    )
    w("## Raw steps (seconds; step 0 is the discarded warm-up)\n")
    w("| system | " + " | ".join(f"step {i}" for i in range(args.reps + 1)) + " |")
    w("|---|" + "---|" * (args.reps + 1))
    for s in order:
        w(f"| {NAMES[s]} | " + " | ".join(f"{m['seconds']:.2f}" for m in children[s].steps) + " |")
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=8, help="measured steps per system (after 1 warm-up)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per response (fixed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per child (see the report)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="quickstart", help="the policy's shape")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: mixed precision in all three (fp32 weights, bf16 autocast): VAPO "
        "--trainer.precision=bf16-mixed, TRL bf16=True (its default)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile in all three, through each system's own switch: VAPO "
        "--model.torch_compile=true, TRL torch_compile=True",
    )
    p.add_argument(
        "--micro-batch",
        action="append",
        default=[],
        metavar="[SYSTEM=]N",
        help="rows per forward + backward in the updates, gradients accumulated over the "
        "mini-batch (VAPO micro_batch_size; TRL per_device_train_batch_size with "
        "gradient_accumulation_steps = mini-batch / N): N for all three, SYSTEM=N for one "
        "(vapo, trl_ppo, trl_grpo); default: the whole mini-batch in one",
    )
    p.add_argument(
        "--trl-site",
        action="append",
        default=[],
        metavar="SYSTEM=DIR",
        help="run trl_ppo / trl_grpo with this interpreter and DIR on PYTHONPATH (the TRL release "
        "installed there with pip --target) instead of a venv: for machines without a registry",
    )
    p.add_argument("--out", default=str(BENCH / "results" / "trl.md"))
    p.add_argument("--keep", action="store_true", help="keep the artefacts and child logs")
    args = p.parse_args()
    in_venv = Path(sys.executable).is_relative_to(ROOT / ".venv")
    cmd = (
        (".venv/bin/python" if in_venv else "python3")
        + " benchmarks/bench_trl.py"
        + "".join(
            f" --{k} {getattr(args, k)}"
            for k, d in [
                ("reps", 8),
                ("prompts", 16),
                ("n", 4),
                ("tokens", 128),
                ("threads", 1),
                ("shape", "quickstart"),
                ("device", "cpu"),
                ("precision", "fp32"),
            ]
            if getattr(args, k) != d
        )
        + (" --compile" if args.compile else "")
    )
    cmd += "".join(f" --micro-batch {item}" for item in args.micro_batch)
    micro: dict[str, int] = {}
    for item in args.micro_batch:
        system, _, n = item.rpartition("=")
        if system and system not in NAMES:
            p.error(f"--micro-batch {item}: unknown system {system!r}; expected one of {sorted(NAMES)}")
        if not n.isdigit() or int(n) < 1 or (args.prompts * args.n) % int(n):
            p.error(f"--micro-batch {item}: N must divide prompts × n = {args.prompts * args.n}")
        micro.update({s: int(n) for s in ([system] if system else NAMES)})
    args.micro_batch = micro
    cmd += "".join(f" --trl-site {item}" for item in args.trl_site)
    if Path(args.out).resolve() != (BENCH / "results" / "trl.md").resolve():
        cmd += f" --out {os.path.relpath(Path(args.out).resolve(), ROOT)}"
    sites = dict(item.split("=", 1) for item in args.trl_site)
    if unknown := set(sites) - set(TRL):
        p.error(f"--trl-site: unknown system(s) {sorted(unknown)}; expected {sorted(TRL)}")
    for system, version in TRL.items():
        if system not in sites:
            ensure_venv(version)
    load_start, t_start = loadavg(), time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_trl_"))
    try:
        art_info = write_artefacts(
            work,
            args.prompts,
            args.n,
            args.tokens,
            args.threads,
            args.shape,
            args.device,
            args.precision,
            args.compile,
            args.micro_batch,
        )
        children: dict[str, Child] = {}
        order = ["vapo", "trl_ppo", "trl_grpo"]
        for s in order:  # start one at a time: loading and warm-up never overlap another step
            children[s] = Child(s, work, args.reps + 1, work, args.threads, sites.get(s))
            m = children[s].read()
            log(f"{s}: warm-up step {m['seconds']:.2f} s, lengths {m['len_min']}-{m['len_max']}")
        for r in range(args.reps):
            for s in order[r % 3 :] + order[: r % 3]:
                m = children[s].go()
                log(f"round {r}: {s} {m['seconds']:.2f} s")
        for c in children.values():
            c.close()
        wall = time.perf_counter() - t_start
        gpu = children["vapo"].steps[0].get("versions", {}).get("gpu")
        text = report(args, machine_facts(gpu), art_info, children, load_start, loadavg(), wall, cmd)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(text)
    finally:
        for c in locals().get("children", {}).values():
            if c.proc.poll() is None:
                c.proc.kill()
        if args.keep:
            log(f"artefacts and child logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
