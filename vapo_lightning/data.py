"""Prompt data: local jsonl / json / parquet files or a hub dataset, checked before training.

Every row becomes {prompt_text, prompt_ids, ground_truth, data_source, extra_info}; the
ground truth is the answer (math) or the tests (code) from the configured field. A
malformed row stops the run before any work with an error naming the file, line and field
(or is skipped and counted, by config); so do prompts over the length limit.
"""

from __future__ import annotations

import json
import string
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler

from vapo_lightning.config import SetupError

__all__ = ["DataError", "PromptDataModule", "ResumableDataLoader", "ResumableSampler", "read_rows"]


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, line and field."""


def read_rows(source: str, malformed: list[str] | None = None) -> Iterable[tuple[str, dict[str, Any]]]:
    """Yields (location, row) from a .jsonl / .json / .parquet file or a hub dataset
    ("name" or "name:split"); location is "file:line" (or "file:row N") for messages.
    A .jsonl line that is not JSON raises `DataError`, or, given a `malformed` list, is
    skipped and its message appended there."""
    path = Path(source)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    message = f"{source}:{i}: malformed JSON ({err.msg} at column {err.colno})"
                    if malformed is None:
                        raise DataError(message) from None
                    malformed.append(message)
                    continue
                yield f"{source}:{i}", row
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{source}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{source}: expected a JSON list of objects, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            yield f"{source}:item {i}", row
    else:
        import datasets

        if path.suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        elif path.exists():
            raise DataError(f"{source}: unsupported file type (use .jsonl, .json or .parquet)")
        else:
            name, _, split = source.partition(":")
            try:
                ds = datasets.load_dataset(name, split=split or "train")
            except Exception as err:
                raise DataError(f"{source}: not a local file, and loading it from the hub failed: {err}") from err
        for i, row in enumerate(ds):
            yield f"{source}:row {i}", row


class ResumableSampler(DistributedSampler):
    """The epoch's order is a function of (seed, epoch) alone, sharded over ranks
    (indices rank, rank + world, ...), and can start mid-epoch after a resume. A
    `DistributedSampler`, so Lightning neither replaces it nor forgets `set_epoch`."""

    def __init__(self, size: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(
            range(size),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.skip = 0  # indices of this rank's shard already consumed (set on resume)

    def __iter__(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        mine = order[self.rank : self.total_size : self.num_replicas].tolist()
        start, self.skip = self.skip, 0
        return iter(mine[start:])


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position in the epoch is saved in checkpoints (Lightning restores
    stateful loaders), so `--ckpt_path last` continues with the same data order."""

    def __init__(self, *args: Any, batches_done: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches": int(self.batches_done())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.sampler.skip = state["batches"] * self.batch_size


class PromptDataModule(L.LightningDataModule):
    """Prompts for rollouts and validation.

    Args:
        train: training files or a hub dataset name (prompts for rollouts); not needed to
            validate.
        val: validation files (scored as mean@k accuracy); None: no validation.
        prompt_field: the prompt: a string, or a list of chat messages.
        answer_field: the math answer used as ground truth (None for code).
        tests_field: the code tests used as ground truth (instead of answer_field).
        data_source_field: optional per-row source name (per-source metrics and rewards).
        prompt_template: format string applied to a string prompt, e.g.
            "{prompt} Put the final answer in \\boxed{{}}." (braces other than {prompt}
            doubled, as in Python's str.format).
        chat_template: wrap the prompt with the tokenizer's chat template (what an instruct
            model was trained on); None: when the tokenizer has one (said once at start-up),
            false: the raw text (base models, or a prompt_template that is the whole prompt).
        system_prompt: a system message (with chat_template); "" gives an empty one, which
            drops the default system message some templates add (SmolLM2's, Qwen2.5's).
        prompts_per_step: prompts per rollout step (per device); each gets n responses.
        val_batch_size: prompts per validation batch.
        max_prompt_length: prompts longer than this (in tokens) are `overlong_prompts`.
        overlong_prompts: "error" stops before training; "drop" skips and counts them.
        bad_rows: "error" stops on a malformed row; "skip" skips and counts it.
        seed: shuffling seed (the order is a function of seed and epoch).
    """

    def __init__(
        self,
        train: str | list[str] | None = None,
        val: str | list[str] | None = None,
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        tests_field: str | None = None,
        data_source_field: str = "data_source",
        prompt_template: str | None = None,
        chat_template: bool | None = None,
        system_prompt: str | None = None,
        prompts_per_step: int = 8,
        val_batch_size: int = 64,
        max_prompt_length: int = 512,
        overlong_prompts: Literal["error", "drop"] = "error",
        bad_rows: Literal["error", "skip"] = "error",
        seed: int = 0,
    ) -> None:
        super().__init__()
        if answer_field and tests_field:
            raise ValueError("data: set answer_field (math) or tests_field (code), not both")
        if prompts_per_step < 1 or val_batch_size < 1 or max_prompt_length < 1:
            raise ValueError("data: prompts_per_step, val_batch_size and max_prompt_length must be >= 1")
        if prompt_template is not None:
            check_prompt_template(prompt_template)
        self.save_hyperparameters()
        self.prompts_per_step = prompts_per_step
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.skipped: dict[str, int] = {}
        self._sampler_generator, self._sampler_seeded = torch.Generator(), False

    @property
    def has_val(self) -> bool:
        return bool(self.hparams.val)

    def setup(self, stage: str) -> None:
        if self.train_rows or self.val_rows:
            return
        tokenizer = self.trainer.lightning_module.tokenizer
        if self.hparams.chat_template is None:
            rank_zero_info(
                "data.chat_template: the tokenizer's chat template wraps each prompt (set it false for raw text)"
                if self.uses_chat_template(tokenizer)
                else "data.chat_template: the tokenizer has no chat template; prompts are raw text"
            )
        if stage == "fit":
            if self.hparams.train is None:
                raise SetupError("data.train: training needs prompts (a jsonl / json / parquet file or a hub dataset)")
            self.train_rows = self._load(self.hparams.train, tokenizer, "train")
        if self.has_val:
            self.val_rows = self._load(self.hparams.val, tokenizer, "val")

    def load_rows(self, split: str, tokenizer: Any) -> list[dict]:
        """The prompt rows of `split` ("train" or "val"), tokenised, outside a run."""
        source = self.hparams.train if split == "train" else self.hparams.val
        if source is None:
            raise SetupError(f"data.{split}: no prompts given")
        return self._load(source, tokenizer, split)

    def uses_chat_template(self, tokenizer: Any) -> bool:
        """`chat_template`, or left None, whether the tokenizer has a chat template."""
        if self.hparams.chat_template is not None:
            return self.hparams.chat_template
        return bool(getattr(tokenizer, "chat_template", None))

    def _load(self, sources: str | list[str], tokenizer: Any, split: str) -> list[dict]:
        hp = self.hparams
        rows, skipped = [], {"bad_rows": 0, "overlong_prompts": 0}
        for source in [sources] if isinstance(sources, str) else sources:
            if not Path(source).exists() and Path(source).suffix in (".jsonl", ".json", ".parquet"):
                raise DataError(f"data.{split}: file {source} does not exist")
            malformed: list[str] | None = [] if hp.bad_rows == "skip" else None
            for where, raw in read_rows(source, malformed):
                try:
                    row = self._prepare(raw, where, tokenizer)
                except DataError:
                    if hp.bad_rows == "error":
                        raise
                    skipped["bad_rows"] += 1
                    continue
                if len(row["prompt_ids"]) > hp.max_prompt_length:
                    if hp.overlong_prompts == "error":
                        raise DataError(
                            f"{where}: prompt is {len(row['prompt_ids'])} tokens, over data.max_prompt_length="
                            f"{hp.max_prompt_length} (raise it, or set data.overlong_prompts=drop)"
                        )
                    skipped["overlong_prompts"] += 1
                    continue
                rows.append(row)
            skipped["bad_rows"] += len(malformed or ())
        if not rows:
            raise DataError(f"data.{split}: no usable rows in {sources} (skipped: {skipped})")
        if any(skipped.values()):
            warnings.warn(
                f"data.{split}: skipped {skipped} of {len(rows) + sum(skipped.values())} rows",
                stacklevel=2,
            )
        self.skipped.update({f"{split}/{k}": v for k, v in skipped.items()})
        return rows

    def _prepare(self, raw: Any, where: str, tokenizer: Any) -> dict:
        hp = self.hparams
        if not isinstance(raw, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        truth = ("tests_field", hp.tests_field) if hp.tests_field else ("answer_field", hp.answer_field)
        for setting, name in (("prompt_field", hp.prompt_field), truth):
            if name and name not in raw:  # e.g. GSM8K's "question"
                raise DataError(
                    f"{where}: no field '{name}' (the row has {', '.join(map(repr, raw)) or 'none'}); "
                    f"set data.{setting} to the field that holds it"
                )
        prompt = raw.get(hp.prompt_field)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"{where}: field '{hp.prompt_field}' is empty")
            text = hp.prompt_template.format(prompt=prompt) if hp.prompt_template else prompt
            messages = [{"role": "user", "content": text}]
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
            messages, text = prompt, None
        else:
            raise DataError(
                f"{where}: field '{hp.prompt_field}' must be a non-empty string or chat messages, got {prompt!r:.80}"
            )
        if self.uses_chat_template(tokenizer) or text is None:
            if hp.system_prompt is not None:  # "" too: it replaces a template's default one
                messages = [{"role": "system", "content": hp.system_prompt}, *messages]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        truth_field = hp.tests_field or hp.answer_field
        truth = raw.get(truth_field) if truth_field else None
        if truth_field and (truth is None or truth == "" or truth == []):
            raise DataError(f"{where}: field '{truth_field}' is missing or empty")
        source = raw.get(hp.data_source_field, "default")
        if not isinstance(source, str):
            raise DataError(f"{where}: field '{hp.data_source_field}' must be a string, got {source!r:.40}")
        used = {hp.prompt_field, truth_field, hp.data_source_field}
        return {
            "prompt_text": text,
            "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"],
            "ground_truth": truth,
            "data_source": source,
            "extra_info": {k: v for k, v in raw.items() if k not in used},
        }

    def train_dataloader(self) -> DataLoader:
        sampler = ResumableSampler(
            len(self.train_rows),
            self.hparams.seed,
            self.trainer.world_size,
            self.trainer.global_rank,
        )
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        return ResumableDataLoader(
            self.train_rows,
            batch_size=self.prompts_per_step,
            sampler=sampler,
            collate_fn=list,
            drop_last=len(self.train_rows) >= self.prompts_per_step * self.trainer.world_size,
            batches_done=lambda: progress.current.processed,
            generator=torch.Generator(),  # its base-seed draw must not touch the global RNG
        )

    def val_dataloader(self) -> DataLoader | list:
        """Each rank scores its share of the validation rows (the score before training
        included, which runs outside Lightning's loop: an unsharded loader there gave every
        rank the whole set); the last rows are repeated to give every rank as many."""
        if not self.val_rows:  # no validation data: no loader (an empty one makes Lightning warn)
            return []
        world = self.trainer.world_size if self.trainer is not None else 1
        sampler = (
            None
            if world == 1
            else DistributedSampler(self.val_rows, num_replicas=world, rank=self.trainer.global_rank, shuffle=False)
        )
        return DataLoader(self.val_rows, batch_size=self.hparams.val_batch_size, collate_fn=list, sampler=sampler)

    def state_dict(self) -> dict[str, Any]:
        """The dynamic-sampling prompt stream (the epoch order is in the loader's state)."""
        return {
            "sampler_generator": self._sampler_generator.get_state(),
            "seeded": self._sampler_seeded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._sampler_generator.set_state(state["sampler_generator"])
            self._sampler_seeded = state["seeded"]

    def sample_prompts(self, k: int) -> list[dict]:
        """k random training prompts, for DAPO's dynamic-sampling rounds."""
        if not self._sampler_seeded:  # each rank draws its own extra prompts
            self._sampler_generator.manual_seed(self.hparams.seed + 7919 + self.trainer.global_rank)
            self._sampler_seeded = True
        idx = torch.randint(len(self.train_rows), (k,), generator=self._sampler_generator)
        return [self.train_rows[i] for i in idx.tolist()]


def check_prompt_template(template: str) -> None:
    """`template.format(prompt=...)` must work: a `{prompt}` field and no other, other braces
    doubled (`\\boxed{{}}`); a single `{}` would stop the run at the first row with an
    IndexError deep in a traceback."""
    try:
        others = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None} - {"prompt"}
        missing = "{prompt}" not in template
    except ValueError:  # a lone "{" or "}"
        others, missing = {"a lone brace"}, False
    if others or missing:
        what = (
            f"found {', '.join(sorted(repr('{' + f + '}') if f != 'a lone brace' else f for f in others))}"
            if others
            else "no {prompt} in it"
        )
        raise SetupError(
            f"data.prompt_template={template!r}: {what}; {{prompt}} is the only field filled in, "
            "so write other braces doubled, e.g. \\boxed{{}} for \\boxed{}"
        )
