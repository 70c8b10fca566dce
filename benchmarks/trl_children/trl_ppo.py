"""TRL PPO child: `trl.experimental.ppo.PPOTrainer` (trl 1.12.0 venv) on the shared artefacts."""

from __future__ import annotations

import argparse
import json
import os
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
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    n, T = cfg["n"], cfg["max_new_tokens"]
    batch = cfg["prompts"] * n
    seen: dict[str, int] = {}

    # PPOTrainer builds its GenerationConfig inside train() (max_new_tokens, temperature,
    # top_k=0, top_p=1); stop_token=None already disables EOS. min_new_tokens is set here too,
    # so the length is forced exactly as in the other two systems; widths are recorded.
    orig_batch_generation = ppo_mod.batch_generation

    def batch_generation(model, queries, fwd_bs, pad_token_id, generation_config):
        generation_config.min_new_tokens = T
        qr, logits = orig_batch_generation(model, queries, fwd_bs, pad_token_id, generation_config)
        seen["width"] = qr.shape[1] - queries.shape[1]
        seen["rows"] = qr.shape[0]
        seen["eos_inside"] = int((qr[:, queries.shape[1] :] == tok.eos_token_id).any(-1).sum())
        return qr, logits

    ppo_mod.batch_generation = batch_generation

    micro = cfg["micro_batch"]["trl_ppo"]
    tok = AutoTokenizer.from_pretrained(art / "policy", padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(art / "policy", dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(art / "reward", num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(art / "value", num_labels=1, dtype=torch.float32)
    prompts = [json.loads(line) for line in (art / "prompts.jsonl").read_text().splitlines()]
    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in prompts]
    dataset = Dataset.from_dict({"input_ids": [x for x in ids for _ in range(n)]})  # prompts × n

    static = versions("torch", "transformers", "trl", "accelerate", device=cfg["device"])
    driver = StepDriver(args.steps, static)

    class Report(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            driver.start()

        def on_step_end(self, a, state, control, **kw):
            w = seen.pop("width")
            driver.end(gen_tokens=w * seen["rows"], len_min=w, len_max=w, eos_inside=seen["eos_inside"])

    out = str(art / "trainer_out_ppo")  # removed with the artefacts
    config = PPOConfig(
        output_dir=out,
        per_device_train_batch_size=micro,  # one mini-batch of `batch`, in micro-batches
        gradient_accumulation_steps=batch // micro,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=batch * args.steps,
        local_rollout_forward_batch_size=batch,
        response_length=T,
        temperature=1.0,
        stop_token=None,
        num_sample_generations=0,
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
        seed=0,
        dataloader_num_workers=0,
    )
    if cfg.get("compile"):
        # PPOTrainer builds its own Accelerator, without the Trainer's dynamo plugin: with
        # accelerate >= 1.2, torch_compile=True alone compiles nothing (warm-up 8 s, checked).
        # accelerate's own variable, which that flag used to set, makes prepare() compile the
        # policy-and-value wrapper, as GRPOTrainer's flag compiles its model.
        os.environ["ACCELERATE_DYNAMO_BACKEND"] = "inductor"
    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=None,  # PPOTrainer makes a frozen copy of the policy
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        callbacks=[Report()],
    )
    # bf16=True autocasts only the forward of the model accelerate prepared (the policy-and-value
    # wrapper: the training forward); generation and the reference, reward and value rollout
    # forwards call its submodules directly and would stay fp32. The whole step runs under
    # autocast here, as in the other two systems, so that all of them do the same work in bf16.
    with torch.autocast(cfg["device"], dtype=torch.bfloat16, enabled=cfg.get("precision") == "bf16"):
        trainer.train()


if __name__ == "__main__":
    main()
