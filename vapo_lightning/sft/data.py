"""The SFT data: each task's generator and checker (`TASKS`), and the data module that draws
the demonstrations, trains the tokenizer and serves (prompt, solution + EOS) pairs.

A solution may hold tool observations, ``<output>...</output>`` spans that a tool appended
after a tool call (`vapo_lightning.tasks.bignum`). They are context, not actions: the response
is tokenized segment by segment as the rollout builds it (`encode_response`) and the loss
skips the observation tokens."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from vapo_lightning.jsonl import read_jsonl
from vapo_lightning.tasks import arithmetic, bignum, digitwise, functions
from vapo_lightning.tokenization import train_bpe

__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "Example",
    "SFTDataModule",
    "SFTTask",
    "chat_prompt",
    "encode_response",
    "encode_responses",
    "split_observations",
]

IGNORE_INDEX = -100
_ASSETS = Path(__file__).resolve().parents[1] / "assets"
_OBSERVATION = re.compile(r"(<output>.*?</output>)", re.DOTALL)


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
    """The row's solution without its working (``\\boxed{N}`` for arithmetic; for bignum
    without the tool call), or None where the task has no such form (a program is its own
    working)."""
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
    "bignum": SFTTask(bignum.generate, bignum.check, _ASSETS / "bignum", answer_only=bignum.bare),
    "functions": SFTTask(functions.generate, functions.check, _ASSETS / "functions"),
    "digitwise": SFTTask(digitwise.generate, digitwise.check, _ASSETS / "digitwise", with_slips=digitwise.with_slips),
}
"""The tasks `SFTDataModule(task=...)` knows; ``functions`` is checked in the sandbox."""


class Example(NamedTuple):
    """One tokenized SFT pair: the chat prompt, the response + EOS, and the response's labels
    (its ids, with `IGNORE_INDEX` on observation tokens)."""

    prompt_ids: list[int]
    response_ids: list[int]
    labels: list[int]


def split_observations(solution: str) -> list[tuple[str, bool]]:
    """The solution's segments in order, as ``(text, is_observation)``: model text, and the
    ``<output>...</output>`` spans a tool appended (empty model text between spans dropped).
    A solution without observations is one model segment, itself."""
    parts = _OBSERVATION.split(solution)  # odd indices: the captured observations
    return [(text, k % 2 == 1) for k, text in enumerate(parts) if text]


def encode_responses(tokenizer: PreTrainedTokenizerFast, solutions: list[str]) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each response + EOS, tokenized segment by segment as the rollout builds
    it: the model's first segment with the space that starts every response, each
    observation and each later model segment as it is. Labels are the ids, `IGNORE_INDEX` on
    the observation tokens (context the policy did not write); EOS is a label. All segments go
    to the tokenizer in one batch."""
    if not solutions:
        return []
    per_solution = [split_observations(solution) for solution in solutions]
    for solution, segments in zip(solutions, per_solution):
        if not segments or segments[0][1]:
            raise ValueError(f"a response starts with model text, got {solution[:60]!r}")
    texts = [" " + text if k == 0 else text for segments in per_solution for k, (text, _) in enumerate(segments)]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"])
    out = []
    for segments in per_solution:
        ids: list[int] = []
        labels: list[int] = []
        for _, is_observation in segments:
            piece = next(pieces)
            ids += piece
            labels += [IGNORE_INDEX] * len(piece) if is_observation else piece
        out.append(([*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]))
    return out


def encode_response(tokenizer: PreTrainedTokenizerFast, solution: str) -> tuple[list[int], list[int]]:
    """`encode_responses` of one solution."""
    return encode_responses(tokenizer, [solution])[0]


def chat_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """The policy's view of a task prompt: ``User: ...\\nAssistant:`` (the response follows)."""
    chat = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


class SFTDataModule(L.LightningDataModule):
    """SFT pairs and validation prompts of one task, and the tokenizer they define.

    Args:
        task: which generator and checker (`TASKS`): ``"arithmetic"``, ``"functions"``,
            ``"digitwise"`` or ``"bignum"``.
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
            by choosing to work problems out (the quickstart's 0.5). For ``bignum`` it is
            the share answered without the tool.
        answer_only_from_step: optimiser steps at the start of training whose
            demonstrations all keep their full solution (the first rows drawn, before any
            becomes answer-only); the answer-only share applies to the batches after them.
            Answer-only demonstrations slow down learning what only full solutions teach:
            from a 50/50 start, a small bignum model still guesses the digits its tool calls
            copy after 1,500 steps. These batches open every pass over the data.
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
        task: Literal["arithmetic", "functions", "digitwise", "bignum"] = "arithmetic",
        val_path: str | None = None,
        rl_train_path: str | None = None,
        num_train: int = 40_000,
        seed: int = 1234,
        answer_only_fraction: float = 0.0,
        answer_only_from_step: int = 0,
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
            raise ValueError(f"data.answer_only_fraction must be in [0, 1], got {answer_only_fraction}")
        if answer_only_fraction > 0 and self.task.answer_only is None:
            raise ValueError(f"data.answer_only_fraction: task {task!r} has no answer-only form")
        if not 0 <= answer_only_from_step * batch_size <= num_train:
            raise ValueError(
                f"data.answer_only_from_step: {answer_only_from_step} steps of {batch_size} need "
                f"that many of the {num_train} problems (data.num_train)"
            )
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
        self.warmup_rows = self.train_rows[: answer_only_from_step * batch_size]
        if answer_only_fraction > 0:
            style = random.Random(seed + 1)
            self.train_rows = [
                {**r, "solution": self.task.answer_only(r)} if style.random() < answer_only_fraction else r
                for r in self.train_rows
            ]
        if slip_rate > 0:
            slips = random.Random(seed + 2)
            self.train_rows = [self.task.with_slips(r, slips, slip_rate) for r in self.train_rows]
        # The BPE sees each segment on its own, as `encode_response` tokenizes it, so no merge
        # spans a tool call and its observation (one segment per solution without them).
        solutions = [r["solution"] for r in self.train_rows + self.warmup_rows]
        segments = [text for sol in solutions for text, _ in split_observations(sol)]
        texts = [r["prompt"] for r in self.train_rows] + segments
        self.tokenizer = train_bpe(texts, vocab_size=vocab_size)
        self.train_examples = self._encode(self.train_rows)
        self.warmup_examples = self._encode(self.warmup_rows)

    def _encode(self, rows: list[dict]) -> list[Example]:
        """The chat prompt's ids and the response's (`encode_responses`) of each row."""
        tok = self.tokenizer
        prompts = [chat_prompt(tok, row["prompt"]) for row in rows]
        prompt_ids = tok(prompts, add_special_tokens=False)["input_ids"] if rows else []
        responses = encode_responses(tok, [row["solution"] for row in rows])
        return [Example(p, *r) for p, r in zip(prompt_ids, responses)]

    def _collate_train(self, examples: list[Example]) -> dict:
        """Right-padded sequences; labels are the response's (`Example.labels`), -100 on the
        prompt and the padding."""
        T = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
        input_ids = torch.full((len(examples), T), self.tokenizer.pad_token_id)  # (B, T)
        labels = torch.full((len(examples), T), IGNORE_INDEX)
        attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
        for i, (p, r, lab) in enumerate(examples):
            n = len(p) + len(r)
            input_ids[i, :n] = torch.tensor(p + r)
            labels[i, len(p) : n] = torch.tensor(lab)
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
        batch = self._collate_train(self._encode(rows))
        batch.update(prompt_ids=prompts["input_ids"], prompt_mask=prompts["attention_mask"], rows=rows)
        return batch

    def check(self, responses: Sequence[str], rows: Sequence[dict]) -> list[bool]:
        """The task's verdict on each response (the arithmetic grader, or the sandbox)."""
        return self.task.check(responses, rows)

    def _shuffled_batches(self, order: list[int], rng: random.Random) -> list[list[int]]:
        """`order` (indices of `_examples`) in shuffled batches of `batch_size`."""
        rng.shuffle(order)
        B = self.batch_size
        if self.bucket_batches:  # sort within pools of 50 batches, then shuffle the batches
            pool = 50 * B
            length = [len(e.prompt_ids) + len(e.response_ids) for e in self._examples]
            order = [i for s in range(0, len(order), pool) for i in sorted(order[s : s + pool], key=length.__getitem__)]
        batches = [order[s : s + B] for s in range(0, len(order) - B + 1, B)]
        rng.shuffle(batches)
        return batches

    @property
    def _examples(self) -> list[Example]:
        """What the training batches index: the warm-up examples, then the mixed ones."""
        return self.warmup_examples + self.train_examples

    def _batches(self, epoch_seed: int) -> list[list[int]]:
        """One pass: the warm-up batches (`answer_only_from_step`), then `train_examples`."""
        rng, W = random.Random(epoch_seed), len(self.warmup_examples)
        warmup = self._shuffled_batches(list(range(W)), rng) if W else []
        return warmup + self._shuffled_batches(list(range(W, W + len(self.train_examples))), rng)

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return DataLoader(
            self._examples,
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
