"""The SFT model: a small Llama fine-tuned on response tokens, exported in HF format."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from vapo_lightning.sft.data import IGNORE_INDEX

__all__ = ["SFTModule"]


class SFTModule(L.LightningModule):
    """A small `LlamaForCausalLM` fine-tuned on response tokens, exported in HF format.

    Validation scores with the data module's `SFTDataModule.check` (the task's own checker).

    Args:
        tokenizer: set by the CLI from the data module (``data.tokenizer``).
        num_layers: decoder layers.
        hidden_size: model width (heads of 64 dimensions).
        intermediate_size: SwiGLU width.
        init_std: standard deviation of the initial weights (``initializer_range``); a
            128-wide model starts copying digits (bignum's tool calls) within hundreds of
            steps from 0.05, and only after thousands from 0.02.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay (on matrices only).
        warmup_steps: linear warm-up steps.
        schedule: ``"cosine"`` (down to `min_lr_ratio`·lr at the trainer's max_steps) or
            ``"constant"`` after warm-up.
        min_lr_ratio: final learning rate of the cosine schedule, relative to `lr`.
        max_new_tokens: generation budget in validation (the longest arithmetic solution is
            ~145 tokens, a functions solution ~30, a digitwise one 325).
        max_position_embeddings: the model's context (prompt + response tokens).
        num_samples: samples per prompt at temperature 1.0 for ``val/accuracy_sampled``.
        eval_seed: seed of validation sampling (the same draws at every validation).
        export_dir: where `on_fit_end` saves model + tokenizer (None: no export).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast | None = None,
        num_layers: int = 4,
        hidden_size: int = 256,
        intermediate_size: int = 768,
        init_std: float = 0.02,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        schedule: str = "cosine",
        min_lr_ratio: float = 0.05,
        max_new_tokens: int = 160,
        max_position_embeddings: int = 256,
        num_samples: int = 4,
        eval_seed: int = 0,
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        if tokenizer is None:
            raise ValueError("SFTModule needs the data module's tokenizer (data.tokenizer)")
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
        self.save_hyperparameters(ignore=["tokenizer"])
        self.tokenizer = tokenizer
        config = LlamaConfig(
            vocab_size=64 * math.ceil(len(tokenizer) / 64),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=hidden_size // 64,
            num_key_value_heads=hidden_size // 64,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            initializer_range=init_std,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        self.model = LlamaForCausalLM(config)
        # Exported defaults: plain sampling at temperature 1.0 (the RL rollout setting).
        self.model.generation_config.update(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        self._correct: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def _response_loss(self, batch: dict) -> torch.Tensor:
        """Mean cross-entropy over response tokens (labels != -100) of the batch."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1),
            batch["labels"][:, 1:].flatten(),
            ignore_index=IGNORE_INDEX,
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._response_loss(batch)
        n_tokens = (batch["labels"] != IGNORE_INDEX).sum()
        self.log_dict(
            {
                "train/loss": loss,
                "train/lr": self.lr_schedulers().get_last_lr()[0],
                "train/response_tokens": n_tokens.float(),
            },
            prog_bar=True,
        )
        return loss

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, do_sample: bool) -> list[str]:
        """Decoded responses of a left-padded prompt batch (special tokens removed)."""
        # Pure temperature-1.0 sampling: no top-k / top-p truncation.
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=self.hparams.max_new_tokens,
            **(sampling if do_sample else {"do_sample": False}),
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        return self.tokenizer.batch_decode(out[:, prompt_ids.shape[1] :], skip_special_tokens=True)

    def on_validation_epoch_start(self) -> None:
        self._correct.clear()
        self._rng_state = torch.get_rng_state()
        torch.manual_seed(self.hparams.eval_seed)  # same draws at every validation

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        rows = batch["rows"]
        self.log("val/loss", self._response_loss(batch), batch_size=len(rows))
        ids, mask = batch["prompt_ids"], batch["prompt_mask"]
        k = self.hparams.num_samples
        greedy = self.generate(ids, mask, do_sample=False)
        sampled = self.generate(ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), True)
        # The data module owns the task, hence its checker (the sandbox for code).
        check = getattr(self.trainer.datamodule, "check", None)
        if check is None:
            raise RuntimeError("SFTModule validation needs an SFTDataModule (its task's checker)")
        greedy_ok = check(greedy, rows)
        sampled_ok = check(sampled, [r for r in rows for _ in range(k)])
        for i, row in enumerate(rows):
            level = row["difficulty"]
            self._correct["greedy"].append((level, float(greedy_ok[i])))
            self._correct["sampled"].append((level, sum(sampled_ok[i * k : (i + 1) * k]) / k))

    def on_validation_epoch_end(self) -> None:
        torch.set_rng_state(self._rng_state)
        metrics = self.accuracy_by_difficulty()
        self.log("val/accuracy_greedy", metrics.pop("val/accuracy_greedy"), prog_bar=True)
        self.log_dict(metrics)

    def _accuracy(self, kind: str, level: int | None = None) -> float:
        scores = [s for d, s in self._correct[kind] if level is None or d == level]
        return sum(scores) / max(len(scores), 1)

    def accuracy_by_difficulty(self) -> dict[str, float]:
        """``val/accuracy_{greedy,sampled}`` overall and per difficulty (``..._d3``)."""
        out = {}
        for kind in self._correct:
            out[f"val/accuracy_{kind}"] = self._accuracy(kind)
            for level in sorted({d for d, _ in self._correct[kind]}):
                out[f"val/accuracy_{kind}_d{level}"] = self._accuracy(kind, level)
        return out

    def configure_optimizers(self):
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        total = max(self.trainer.max_steps, 1) if self.trainer else 1
        warm, cosine = self.hparams.warmup_steps, self.hparams.schedule == "cosine"
        floor = self.hparams.min_lr_ratio

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            if not cosine:
                return 1.0
            progress = min((step - warm) / max(total - warm, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.hparams.export_dir is not None and self.trainer.is_global_zero:
            self.export(self.hparams.export_dir)

    def export(self, path: str | Path) -> None:
        """Saves model (safetensors), tokenizer and generation config in HF format."""
        path = Path(path)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self._correct:
            metrics = {k: round(v, 4) for k, v in self.accuracy_by_difficulty().items()}
            (path / "eval.json").write_text(json.dumps(metrics, indent=1) + "\n")
