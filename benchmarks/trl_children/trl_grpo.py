"""TRL GRPO child: `trl.GRPOTrainer` (trl 1.16.0 venv) on the shared artefacts."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _protocol import StepDriver, common_setup, versions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--artefacts", required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args()
    art = Path(args.artefacts)
    cfg = json.loads((art / "bench.json").read_text())
    common_setup(cfg["threads"])

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n, T = cfg["n"], cfg["max_new_tokens"]
    batch = cfg["prompts"] * n
    micro = cfg["micro_batch"]["trl_grpo"]
    lengths: list[int] = []

    def boxed_reward(prompts, completions, completion_ids, answer, **kw):
        """A cheap outcome reward (+1 / -1 on the last \\boxed{}), like VAPO's MathReward on
        answers without a box: it never reaches math-verify."""
        lengths.extend(len(c) for c in completion_ids)
        out = []
        for text, gold in zip(completions, answer):
            found = re.findall(r"\\boxed\{([^{}]*)\}", text)
            out.append(1.0 if found and found[-1].strip() == gold else -1.0)
        return out

    tok = AutoTokenizer.from_pretrained(art / "policy", padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(art / "policy", dtype=torch.float32)
    rows = [json.loads(line) for line in (art / "prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})

    static = versions("torch", "transformers", "trl", "accelerate", device=cfg["device"])
    driver = StepDriver(args.steps, static)

    class Report(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            driver.start()

        def on_step_end(self, a, state, control, **kw):
            got = lengths[:]
            lengths.clear()
            driver.end(gen_tokens=sum(got), len_min=min(got), len_max=max(got), responses=len(got))

    out = str(art / "trainer_out_grpo")  # removed with the artefacts
    config = GRPOConfig(
        output_dir=out,
        # One generation of `batch` completions feeds one optimizer step, in micro-batches.
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro,
        num_generations=n,
        num_iterations=1,
        max_steps=args.steps,
        max_completion_length=T,
        generation_kwargs={"min_new_tokens": T},  # fixed length: EOS suppressed until T
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=1e-5,
        optim="adamw_torch",
        gradient_checkpointing=False,
        bf16=cfg.get("precision") == "bf16",
        torch_compile=cfg.get("compile", False),
        fp16=False,
        use_cpu=cfg["device"] == "cpu",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=boxed_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Report()],
    )
    trainer.train()


if __name__ == "__main__":
    main()
