"""VAPO child: VAPOModule rollout steps on the shared artefacts (main venv)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _protocol import StepDriver, common_setup, versions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--artefacts", required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args()
    art = Path(args.artefacts)
    cfg = json.loads((art / "bench.json").read_text())
    common_setup(cfg["threads"])

    import lightning as L

    from vapo_lightning.config import Algorithm, Generation, Optim
    from vapo_lightning.data import PromptDataModule
    from vapo_lightning.models import ModelSpec
    from vapo_lightning.module import VAPOModule
    from vapo_lightning.rewards.math import MathReward

    batch, T = cfg["prompts"] * cfg["n"], cfg["max_new_tokens"]
    static = versions("torch", "transformers", "lightning", device=cfg["device"])
    driver = StepDriver(args.steps, static)

    class Report(L.Callback):
        def on_train_start(self, trainer, pl_module):
            driver.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, b, idx):
            m = {k: float(v) for k, v in trainer.callback_metrics.items()}
            driver.end(
                gen_tokens=round(m["response_length/mean"] * batch),
                len_min=m["response_length/min"],
                len_max=m["response_length/max"],
                timing={k[len("timing_s/") :]: v for k, v in m.items() if k.startswith("timing_s/")},
            )

    module = VAPOModule(
        policy=ModelSpec(name_or_path=str(art / "policy")),
        critic=ModelSpec(name_or_path=str(art / "value"), tokenizer=str(art / "policy")),
        algorithm=Algorithm(mini_batch_size=batch, micro_batch_size=cfg["micro_batch"]["vapo"], ppo_epochs=1),
        generation=Generation(n=cfg["n"], max_new_tokens=T, min_new_tokens=T),
        optim=Optim(actor_lr=1e-5, critic_lr=1e-5, warmup_steps=0),
        val_before_train=False,
        torch_compile=cfg.get("compile", False),
    )
    data = PromptDataModule(train=str(art / "prompts.jsonl"), prompts_per_step=cfg["prompts"])
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if cfg["device"] == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if cfg.get("precision") == "bf16" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MathReward(num_workers=1), Report()],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
