"""Supervised warm start for the quickstarts: a small Llama trained on a synthetic task.

`SFTDataModule` draws the SFT problems from the seeded generator of its `task` (`TASKS`:
``arithmetic``, or ``functions``, the program-writing task), disjoint from the shipped RL
prompts and the validation set, builds the tokenizer offline with `train_bpe`, and serves
chat-formatted (prompt, solution + EOS) pairs. `SFTModule` builds a `LlamaForCausalLM` from a
config, trains it with the cross-entropy of the *response* tokens only (AdamW, warm-up then
cosine), logs the curve to TensorBoard, measures validation accuracy with the task's own
checker (greedy, and mean@k at temperature 1.0, by difficulty), and at the end of `fit` saves
the model and tokenizer in Hugging Face format (safetensors) to `export_dir`.

    python -m vapo_lightning.sft fit -c configs/quickstart_sft.yaml      # or: vapo sft -c ...
    vapo sft -c configs/quickstart_code_sft.yaml                         # the code task
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.tasks import arithmetic, digitwise, functions
from vapo_lightning.tokenization import train_bpe

__all__ = ["TASKS", "SFTDataModule", "SFTModule", "SFTTask", "chat_prompt", "sft_main"]

_ASSETS = Path(__file__).parent / "assets"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class SFTTask:
    """What the SFT needs of a task: its generator, its checker and its shipped splits."""

    generate: Callable[..., list[dict]]
    """``generate(n, seed, exclude=prompts, distinct=False)`` -> rows with prompt / solution
    / difficulty (see `vapo_lightning.tasks.arithmetic.generate`)."""
    check: Callable[[Sequence[str], Sequence[dict]], list[bool]]
    """``check(responses, rows)`` -> whether each response solves its row."""
    assets: Path
    """Folder of the shipped ``train.jsonl`` (RL prompts) and ``val.jsonl``."""
    answer_only: Callable[[dict], str] | None = None
    """The row's solution without its working (``\\boxed{N}`` for arithmetic), or None
    where the task has no such form (a program is its own working)."""
    with_slips: Callable[[dict, random.Random, float], dict] | None = None
    """``with_slips(row, rng, rate)``: the row with a demonstration that slips at `rate`
    (`vapo_lightning.tasks.digitwise.with_slips`), or None where the task has none."""


def _check_arithmetic(responses: Sequence[str], rows: Sequence[dict]) -> list[bool]:
    return [arithmetic.is_correct(r, row["answer"]) for r, row in zip(responses, rows)]


TASKS = {
    "arithmetic": SFTTask(
        arithmetic.generate,
        _check_arithmetic,
        _ASSETS / "arithmetic",
        answer_only=lambda row: arithmetic.boxed(row["answer"]),
    ),
    "functions": SFTTask(functions.generate, functions.check, _ASSETS / "functions"),
    "digitwise": SFTTask(
        digitwise.generate, digitwise.check, _ASSETS / "digitwise", with_slips=digitwise.with_slips
    ),
}
"""The tasks `SFTDataModule(task=...)` knows; ``functions`` is checked in the sandbox."""


def chat_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """The policy's view of a task prompt: ``User: ...\\nAssistant:`` (the response follows)."""
    chat = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


class SFTDataModule(L.LightningDataModule):
    """SFT pairs and validation prompts of one task, and the tokenizer they define.

    Args:
        task: which generator and checker (`TASKS`): ``"arithmetic"`` or ``"functions"``.
        val_path: validation rows (jsonl of the task's rows; None: the task's shipped
            ``assets/<task>/val.jsonl``).
        rl_train_path: the RL prompts, which SFT problems exclude (None: the task's shipped
            ``assets/<task>/train.jsonl``).
        num_train: number of SFT problems drawn from the generator with `seed`.
        seed: generator seed of the SFT problems (distinct from the splits' seeds 0 and 1).
        answer_only_fraction: share of the SFT demonstrations that give the final answer
            alone, with no working (drawn with `seed`), as in real SFT sets where terse
            answers sit beside worked solutions. The model learns both styles; answering
            without working is hard for a small model, so this share is what RL can improve
            by choosing to work problems out (the quickstart's 0.5).
        slip_rate: share of the steps of each demonstration that are slips (drawn with
            `seed`; tasks with `SFTTask.with_slips`), so the warm start errs at about this
            rate per step and leaves RL a token-level credit-assignment problem (digitwise's
            0.075).
        vocab_size: BPE vocabulary size asked of `train_bpe` (byte-level, so every character
            of code is covered; arithmetic needs ~300 tokens).
        batch_size: training sequences per optimiser step.
        bucket_batches: batches formed from length-sorted pools of 50 batches (less padding).
        val_batch_size: prompts per generation batch in validation.
    """

    def __init__(
        self,
        task: Literal["arithmetic", "functions", "digitwise"] = "arithmetic",
        val_path: str | None = None,
        rl_train_path: str | None = None,
        num_train: int = 40_000,
        seed: int = 1234,
        answer_only_fraction: float = 0.0,
        slip_rate: float = 0.0,
        vocab_size: int = 512,
        batch_size: int = 64,
        bucket_batches: bool = True,
        val_batch_size: int = 200,
    ) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"data.task must be one of {sorted(TASKS)}, got {task!r}")
        self.task = TASKS[task]
        if not 0.0 <= answer_only_fraction <= 1.0:
            raise ValueError(
                f"data.answer_only_fraction must be in [0, 1], got {answer_only_fraction}"
            )
        if answer_only_fraction > 0 and self.task.answer_only is None:
            raise ValueError(f"data.answer_only_fraction: task {task!r} has no answer-only form")
        if not 0.0 <= slip_rate < 1.0:
            raise ValueError(f"data.slip_rate must be in [0, 1), got {slip_rate}")
        if slip_rate > 0 and self.task.with_slips is None:
            raise ValueError(f"data.slip_rate: task {task!r} has no demonstrations with slips")
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.bucket_batches, self.seed = bucket_batches, seed
        self.val_rows = read_jsonl(val_path or self.task.assets / "val.jsonl")
        rl_rows = read_jsonl(rl_train_path or self.task.assets / "train.jsonl")
        exclude = [r["prompt"] for r in self.val_rows + rl_rows]
        self.train_rows = self.task.generate(num_train, seed=seed, exclude=exclude, distinct=False)
        if answer_only_fraction > 0:
            style = random.Random(seed + 1)
            self.train_rows = [
                {**r, "solution": self.task.answer_only(r)}
                if style.random() < answer_only_fraction
                else r
                for r in self.train_rows
            ]
        if slip_rate > 0:
            slips = random.Random(seed + 2)
            self.train_rows = [self.task.with_slips(r, slips, slip_rate) for r in self.train_rows]
        texts = [r["prompt"] for r in self.train_rows] + [r["solution"] for r in self.train_rows]
        self.tokenizer = train_bpe(texts, vocab_size=vocab_size)
        self.train_examples = [self._encode(r) for r in self.train_rows]

    def _encode(self, row: dict) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids + EOS) of one row; the response starts with a space."""
        tok = self.tokenizer
        prompt_ids = tok(chat_prompt(tok, row["prompt"]), add_special_tokens=False)["input_ids"]
        response_ids = tok(" " + row["solution"], add_special_tokens=False)["input_ids"]
        return prompt_ids, [*response_ids, tok.eos_token_id]

    def _collate_train(self, examples: list[tuple[list[int], list[int]]]) -> dict:
        """Right-padded sequences; labels are the response tokens, -100 elsewhere."""
        T = max(len(p) + len(r) for p, r in examples)
        input_ids = torch.full((len(examples), T), self.tokenizer.pad_token_id)  # (B, T)
        labels = torch.full((len(examples), T), IGNORE_INDEX)
        attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
        for i, (p, r) in enumerate(examples):
            n = len(p) + len(r)
            input_ids[i, :n] = torch.tensor(p + r)
            labels[i, len(p) : n] = torch.tensor(r)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _collate_val(self, rows: list[dict]) -> dict:
        """Left-padded prompts for generation, plus right-padded pairs for the val loss."""
        tok = self.tokenizer
        prompts = tok(
            [chat_prompt(tok, r["prompt"]) for r in rows],
            padding=True,
            add_special_tokens=False,
            return_tensors="pt",
        )
        batch = self._collate_train([self._encode(r) for r in rows])
        batch.update(
            prompt_ids=prompts["input_ids"], prompt_mask=prompts["attention_mask"], rows=rows
        )
        return batch

    def check(self, responses: Sequence[str], rows: Sequence[dict]) -> list[bool]:
        """The task's verdict on each response (the arithmetic grader, or the sandbox)."""
        return self.task.check(responses, rows)

    def _batches(self, epoch_seed: int) -> list[list[int]]:
        order = list(range(len(self.train_examples)))
        rng = random.Random(epoch_seed)
        rng.shuffle(order)
        B = self.batch_size
        if self.bucket_batches:  # sort within pools of 50 batches, then shuffle the batches
            pool = 50 * B
            length = [sum(map(len, self.train_examples[i])) for i in range(len(order))]
            order = [
                i
                for s in range(0, len(order), pool)
                for i in sorted(order[s : s + pool], key=length.__getitem__)
            ]
        batches = [order[s : s + B] for s in range(0, len(order) - B + 1, B)]
        rng.shuffle(batches)
        return batches

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return DataLoader(
            self.train_examples,
            batch_sampler=self._batches(self.seed + epoch),
            collate_fn=self._collate_train,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_rows,
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=self._collate_val,
        )


class SFTModule(L.LightningModule):
    """A small `LlamaForCausalLM` fine-tuned on response tokens, exported in HF format.

    Validation scores with the data module's `SFTDataModule.check` (the task's own checker).

    Args:
        tokenizer: set by the CLI from the data module (``data.tokenizer``).
        num_layers: decoder layers.
        hidden_size: model width (heads of 64 dimensions).
        intermediate_size: SwiGLU width.
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
        logits = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits  # (B, T, V)
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
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, do_sample: bool
    ) -> list[str]:
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


def plot_training_curve(log_dir: str | Path, out_png: str | Path) -> None:
    """Draws train/val loss and validation accuracy from a TensorBoard run (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    series = {t: events.Scalars(t) for t in events.Tags()["scalars"]}
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for tag in ("train/loss", "val/loss"):
        if tag in series:
            ax_loss.plot(
                [e.step for e in series[tag]],
                [e.value for e in series[tag]],
                marker="o" if tag.startswith("val") else None,
                label=tag,
            )
    ax_loss.set(xlabel="optimiser step", ylabel="response cross-entropy", yscale="log")
    for tag in ("val/accuracy_greedy", "val/accuracy_sampled"):
        if tag in series:
            ax_acc.plot(
                [e.step for e in series[tag]],
                [e.value for e in series[tag]],
                marker="o",
                label=tag.replace("sampled", "sampled (T=1, mean@k)"),
            )
    ax_acc.set(xlabel="optimiser step", ylabel="validation accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


class SFTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.tokenizer", "model.tokenizer", apply_on="instantiate")


_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def sft_main(args: list[str] | None = None) -> SFTCLI:
    """Runs the SFT LightningCLI; ``fit`` is implied when no subcommand is given."""
    if args is not None and (not args or args[0] not in _SUBCOMMANDS):
        args = ["fit", *args]
    return SFTCLI(SFTModule, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    sft_main()
