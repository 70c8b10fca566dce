"""The SFT data: each task's generator and checker (`TASKS`), and the data module that draws
the demonstrations, trains the tokenizer and serves (prompt, solution + EOS) pairs."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.tasks import arithmetic, digitwise, functions
from vapo_lightning.tokenization import train_bpe

__all__ = ["IGNORE_INDEX", "TASKS", "SFTDataModule", "SFTTask", "chat_prompt"]

IGNORE_INDEX = -100
_ASSETS = Path(__file__).resolve().parents[1] / "assets"


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


