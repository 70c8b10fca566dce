"""Tokenizers built offline: a small byte-level BPE trained with `tokenizers`.

No model hub is needed: `train_bpe` learns a vocabulary from the texts you give it and wraps
it as a `transformers.PreTrainedTokenizerFast` (pad / eos / bos, left padding for generation,
a minimal chat template) that round-trips through `save_pretrained` / `AutoTokenizer`.
Digits are split one per token, which small models need to learn arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "train_bpe"]

SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
}

# One user turn, then the assistant's answer; enough for instruction-style prompts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on `texts` (single digits kept as separate tokens)."""
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", **SPECIAL_TOKENS)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
