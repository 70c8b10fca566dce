"""Rollout-step cost of VAPOModule against the floor of its bare operations.

Shapes: the quickstart policy's architecture (Llama, 3 layers, hidden 256), random init,
16 prompts × 4 samples = 64 responses × 128 new tokens (fixed length), one mini-batch.
The floor is the sum of what any PPO implementation must do on these shapes: sampling the
responses (with the same sampler, `engines.sampler.sample_responses`: this measures the trainer's
overhead, not the sampler) and one forward/backward/AdamW step of each model. At one epoch
over one mini-batch pi_old needs no separate no-grad forward (the policy as it stands is
pi_old; `VAPOModule` takes it from the actor update's first forward, `model.algorithm.one_pass`);
V_old is always a no-grad pass of the critic. Both are measured alternately in one process;
then the trainer again with `one_pass: false`, for what taking pi_old so saves.

    .venv/bin/python benchmarks/bench_trainer.py > benchmarks/results/trainer.md
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stamp import stamp
from vapo_lightning.config import Algorithm, Generation, Optim
from vapo_lightning.data import PromptDataModule
from vapo_lightning.engines.sampler import sample_responses
from vapo_lightning.models import ModelSpec
from vapo_lightning.module import VAPOModule
from vapo_lightning.rewards.math import MathReward

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "vapo_lightning/assets/quickstart_sft"
POLICY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
PROMPTS, N, T = 16, 4, 128


class StepRecorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("timing_s/")})


def make_module(one_pass: bool = True) -> VAPOModule:
    return VAPOModule(
        policy=ModelSpec(config=POLICY, tokenizer=str(TOKENIZER)),
        algorithm=Algorithm(mini_batch_size=PROMPTS * N, micro_batch_size=PROMPTS * N, one_pass=one_pass),
        generation=Generation(n=N, max_new_tokens=T, min_new_tokens=T),
        optim=Optim(actor_lr=1e-5, critic_lr=1e-5, warmup_steps=0),
        val_before_train=False,
    )


def run_trainer(steps: int, one_pass: bool = True) -> tuple[VAPOModule, list[dict[str, float]]]:
    module, recorder = make_module(one_pass), StepRecorder()
    data = PromptDataModule(
        train=str(ROOT / "vapo_lightning/assets/arithmetic/train.jsonl"), prompts_per_step=PROMPTS, chat_template=False
    )
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MathReward(num_workers=1), recorder],
    )
    trainer.fit(module, datamodule=data)
    return module, recorder.steps


def floor_once(module: VAPOModule, prompt_ids: list[list[int]]) -> dict[str, float]:
    """The bare operations of one rollout step, timed; same shapes as the trainer's."""
    policy, critic, tok = module.policy, module.critic, module.tokenizer
    P = max(map(len, prompt_ids))
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompt_ids]).repeat_interleave(N, 0)
    attn = (ids != tok.pad_token_id).long()
    t: dict[str, float] = {}
    start = time.perf_counter()
    with torch.no_grad():
        policy.eval()
        response = sample_responses(
            policy,
            ids,
            attn,
            max_new_tokens=T,
            min_new_tokens=T,
            stop_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
        )
        t["generate"] = time.perf_counter() - start
        out = torch.cat([ids, response], 1)
        full_attn = torch.cat([attn, torch.ones(len(ids), T, dtype=torch.long)], 1)
    start = time.perf_counter()
    for model in (critic, policy):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-9)
        o = model(input_ids=out, attention_mask=full_attn, **({"logits_to_keep": T + 1} if model is policy else {}))
        o.logits.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    t["forward/backward/step"] = time.perf_counter() - start
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(2)
    L.seed_everything(0, verbose=False)
    module, steps = run_trainer(args.steps)
    steps = steps[1:]  # the first step pays one-off start-up costs (worker spawn, allocator)
    prompts = [r["prompt_ids"] for r in module.trainer.datamodule.train_rows[:PROMPTS]]
    floors = [floor_once(module, prompts) for _ in range(len(steps))]
    # Alternate once more: a trainer step right after the floor measurements.
    _, more = run_trainer(2)
    steps += more[1:]
    floors += [floor_once(module, prompts)]
    # What pi_old from the actor's first forward saves: the same steps with the policy's pass.
    _, two_pass = run_trainer(args.steps, one_pass=False)
    two_pass = two_pass[1:]

    step_times = [s["timing_s/step"] for s in steps]
    floor_times = [sum(f.values()) for f in floors]
    med_step, med_floor = statistics.median(step_times), statistics.median(floor_times)
    gen_tokens = PROMPTS * N * T
    print("# Trainer rollout step vs the floor of its bare operations\n")
    print("Command: `.venv/bin/python benchmarks/bench_trainer.py`  ")
    print(f"{stamp()}  ")
    print(f"2 threads; load average before: {Path('/proc/loadavg').read_text().split()[:3]}  ")
    print(
        f"Shapes: {PROMPTS} prompts × {N} samples × {T} new tokens (fixed), policy and critic "
        f"{sum(p.numel() for p in module.policy.parameters()) / 1e6:.1f} M parameters each, fp32\n"
    )
    print("| phase (VAPOModule) | median s |\n|---|---|")
    for key in sorted(steps[0]):
        print(f"| {key} | {statistics.median(s[key] for s in steps):.3f} |")
    print("\n| bare operation (floor) | median s |\n|---|---|")
    for key in floors[0]:
        print(f"| {key} | {statistics.median(f[key] for f in floors):.3f} |")
    print("\n| | min s | median s | max s |\n|---|---|---|---|")
    print(f"| VAPOModule rollout step | {min(step_times):.3f} | {med_step:.3f} | {max(step_times):.3f} |")
    print(f"| floor | {min(floor_times):.3f} | {med_floor:.3f} | {max(floor_times):.3f} |")
    print(f"\n**Overhead ratio (median step / median floor): {med_step / med_floor:.3f}** (target <= 1.15)  ")
    gen = statistics.median(s["timing_s/gen"] for s in steps)
    train = statistics.median(s["timing_s/update_actor"] + s["timing_s/update_critic"] for s in steps)
    print(
        f"Generation: {gen_tokens / gen:.0f} tokens/s; training (both models, fwd+bwd+step): "
        f"{2 * len(prompts) * N * (T + max(map(len, prompts))) / train:.0f} tokens/s  "
    )
    reward = statistics.median(s["timing_s/reward"] for s in steps)
    print(f"Reward phase (MathReward, 1 worker): {reward:.3f} s = {100 * reward / med_step:.1f}% of the step  ")
    print(f"Peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB over {len(steps)} steps\n")
    two = statistics.median(s["timing_s/step"] for s in two_pass)
    passes = [
        statistics.median(s.get("timing_s/old_log_prob", 0) + s.get("timing_s/values", 0) for s in run)
        for run in (steps, two_pass)
    ]
    print("| `model.algorithm.one_pass` | median step s | of which no-grad passes s |\n|---|---|---|")
    print(f"| true (pi_old from the actor's first forward; V_old a pass) | {med_step:.3f} | {passes[0]:.3f} |")
    print(f"| false (pi_old and V_old, no-grad passes) | {two:.3f} | {passes[1]:.3f} |")
    print(f"\npi_old from the first forward saves {100 * (1 - med_step / two):.1f} % of the step at these shapes.")


if __name__ == "__main__":
    main()
