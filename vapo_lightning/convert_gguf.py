"""`vapo convert-gguf FILE OUT_DIR`: a GGUF model (llama.cpp's format) as a Hugging Face folder
that `from_pretrained` loads without the GGUF file.

transformers reads the GGUF (`from_pretrained(dir, gguf_file=name)`, which dequantises every
weight); this module saves that model and its tokenizer (chat template included) with a config
that no longer points at the GGUF, adds a generation config from the tokenizer's special tokens,
and keeps the result only if the saved folder gives the GGUF-loaded model's logits and tokens.
Needs the `gguf` extra (the `gguf` and `accelerate` packages).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Conversion", "GGUFError", "convert_gguf", "main"]

EXTRA = "the gguf extra, pip install -e '.[gguf]'"
FLOAT_TYPES = {"F64", "F32", "F16", "BF16"}  # GGML tensor types that are not quantised
STALE_KEYS = ("quantization_config", "_model_name_or_path")  # config keys that point at the GGUF
LOGITS_ATOL = 1e-4  # the same weights in the same dtype give the same logits: 0 is expected
TEXTS = (
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b",
    "What is 12 + 30? Think step by step. 12 + 30 = 42, so \\boxed{42}.",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class GGUFError(ValueError):
    """Why a file cannot be converted, or why its conversion was refused, in one line."""


@dataclass
class Conversion:
    """What `convert_gguf` wrote and checked."""

    out: Path
    architecture: str  # the GGUF's name for it, e.g. "llama"
    model_class: str  # e.g. "LlamaForCausalLM"
    parameters: int
    dtype: torch.dtype
    vocab: int
    tied: bool
    chat_template: bool
    tensor_types: dict[str, int]  # GGML type of each stored tensor -> how many
    positions: int  # token positions whose logits were compared
    max_diff: float  # largest |logit difference| there

    def summary(self) -> str:
        quantised = {t: n for t, n in self.tensor_types.items() if t not in FLOAT_TYPES}
        plain = sum(self.tensor_types.values()) - sum(quantised.values())
        types = ", ".join(f"{t} ({n} tensor{'s' * (n > 1)})" for t, n in quantised.items())
        weights = (
            f"dequantised from {types}; {plain} stored unquantised"
            if quantised
            else f"not quantised ({', '.join(self.tensor_types)})"
        )
        dtype = str(self.dtype).removeprefix("torch.")
        return "\n".join(
            [
                f"wrote {self.out}",
                f"  architecture  {self.architecture} ({self.model_class}), "
                + ("tied embeddings" if self.tied else "untied embeddings"),
                f"  parameters    {self.parameters / 1e6:.1f} M ({dtype})",
                f"  vocab         {self.vocab:,} tokens, "
                + ("chat template kept" if self.chat_template else "no chat template in the GGUF"),
                f"  weights       {weights}",
                f"  logits check  {self.positions} positions: max |diff| {self.max_diff:.2g} "
                f"(tolerance {LOGITS_ATOL:g})",
            ]
        )


def check_inputs(path: Path, out: Path) -> None:
    """The mistakes that need no model: no file, not a GGUF, an OUT_DIR with something in it,
    the `gguf` extra not installed."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise GGUFError(f"{out}: not empty; give a new or empty folder")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFError(f"reading GGUF files needs {' and '.join(missing)}: install {EXTRA}")


def read_tensor_types(path: Path) -> tuple[str, dict[str, int]]:
    """The GGUF's architecture name and how many tensors it stores in each GGML type."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
    except (ValueError, KeyError, IndexError) as err:
        raise GGUFError(f"{path}: unreadable GGUF ({err})") from None
    architecture = bytes(field.parts[field.data[0]]).decode()
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return architecture, dict(types.most_common())


def readable_architectures() -> list[str]:
    """The GGUF architectures this transformers version reads (its loaders' own lists)."""
    names: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names |= set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # not models
    except ImportError:
        pass
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(names)


def read_config(path: Path, architecture: str) -> Any:
    """The model's config as transformers reads it from the GGUF; refuses what it cannot read
    and what is not a causal language model."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # transformers' reasons differ by version; one line for all
        readable = readable_architectures()
        if architecture not in readable:
            raise GGUFError(
                f"{path.name}: transformers {transformers.__version__} cannot read GGUF "
                f"architecture {architecture!r}; it reads {', '.join(readable)}"
            ) from None
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GGUFError(f"{path.name}: transformers cannot read it: {reason}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GGUFError(f"{path.name}: a {config.model_type} model, not a causal language model")
    return config


def load(path: Path, config: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """Model and tokenizer from the GGUF, every weight dequantised to `dtype`."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Newer transformers can keep GGUF blocks packed (`kernels` installed): ask for dense weights.
    dense = {}
    if hasattr(transformers, "GgufConfig"):
        dense["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype, **dense)
    if any(not p.is_floating_point() for p in model.parameters()):
        raise GGUFError(f"{path.name}: transformers kept some weights quantised; cannot save them")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def clean(model: Any, tokenizer: Any) -> None:
    """A config with nothing that points at the GGUF, and a generation config whose special
    tokens are the tokenizer's."""
    from transformers import GenerationConfig

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # dequantised: the model is a plain one now
        quantizer.remove_quantization_config(model)
    for key in STALE_KEYS:
        if key in vars(model.config):
            delattr(model.config, key)
    model.config.name_or_path = ""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad
    )


def probe_sequences(tokenizer: Any, vocab: int) -> list[list[int]]:
    """Fixed token sequences: a few texts (one through the chat template when there is one)
    and ids spread over the whole vocabulary, so every embedding row region is read."""
    sequences = [tokenizer(text)["input_ids"] for text in TEXTS]
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": TEXTS[2]}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        sequences.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    sequences.append(torch.linspace(0, vocab - 1, 32).long().tolist())
    return sequences


@torch.no_grad()
def verify(model: Any, tokenizer: Any, folder: Path) -> tuple[int, float]:
    """Reloads `folder` with plain `from_pretrained` and compares it with the GGUF-loaded
    model and tokenizer; returns (positions compared, largest |logit difference|)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    stale = [key for key in STALE_KEYS if key in config]
    if stale:
        raise GGUFError(f"the saved config still holds {', '.join(stale)}")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype).eval()
    reloaded_tok = AutoTokenizer.from_pretrained(folder)
    if model.config.tie_word_embeddings and (
        reloaded.get_output_embeddings().weight is not reloaded.get_input_embeddings().weight
    ):
        raise GGUFError("the GGUF's embeddings are tied, the saved model's are not")
    if reloaded_tok.chat_template != tokenizer.chat_template:
        raise GGUFError("the saved tokenizer's chat template differs from the GGUF's")
    for text in TEXTS:
        if reloaded_tok(text)["input_ids"] != tokenizer(text)["input_ids"]:
            raise GGUFError(f"the saved tokenizer splits {text!r} differently from the GGUF's")
    positions, diffs = 0, []
    for ids in probe_sequences(tokenizer, model.config.vocab_size):
        x = torch.tensor([ids])  # (1, T)
        want, got = model(x).logits, reloaded(x).logits  # (1, T, V)
        positions += x.shape[1]
        diffs.append((want.float() - got.float()).abs().max())
    max_diff = torch.stack(diffs).max().item()  # NaN stays NaN
    if not max_diff <= LOGITS_ATOL:  # also refuses NaN
        raise GGUFError(
            f"the saved model's logits differ from the GGUF-loaded model's by {max_diff:.3g} "
            f"(tolerance {LOGITS_ATOL:g})"
        )
    return positions, max_diff


def convert_gguf(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Conversion:
    """Writes the GGUF at `path` as a Hugging Face folder `out` (new or empty) and checks it.
    The folder is written beside `out` and moved there only once the check has passed."""
    path, out = Path(path), Path(out)
    check_inputs(path, out)
    architecture, tensor_types = read_tensor_types(path)
    config = read_config(path, architecture)
    model, tokenizer = load(path, config, dtype)
    clean(model, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.converting-{os.getpid()}"
    staging.mkdir()
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        positions, max_diff = verify(model, tokenizer, staging)
        if out.is_dir():
            out.rmdir()  # empty, as checked
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Conversion(
        out=out,
        architecture=architecture,
        model_class=type(model).__name__,
        parameters=model.num_parameters(),
        dtype=model.dtype,
        vocab=len(tokenizer),
        tied=model.config.tie_word_embeddings,
        chat_template=bool(tokenizer.chat_template),
        tensor_types=tensor_types,
        positions=positions,
        max_diff=max_diff,
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="vapo convert-gguf",
        description="Convert a GGUF model into a Hugging Face folder (weights dequantised, "
        "tokenizer and chat template, generation config), checked against the GGUF by logits. "
        f"Needs {EXTRA}.",
    )
    ap.add_argument("file", metavar="FILE", help="the .gguf file")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty folder for the model")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        conversion = convert_gguf(args.file, args.out_dir, DTYPES[args.dtype])
    except GGUFError as err:
        sys.exit(f"vapo convert-gguf: error: {err}")
    print(conversion.summary())
    print(f"  took          {time.perf_counter() - start:.0f} s")
