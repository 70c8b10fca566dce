"""Supervised warm start for the quickstarts: a small Llama trained on a synthetic task.

`SFTDataModule` draws the SFT problems from the seeded generator of its `task` (`TASKS`:
``arithmetic``, ``digitwise``, ``functions``, the program-writing task, or ``bignum``, the
tool-use task), disjoint from the shipped RL prompts and the validation set, builds the
tokenizer offline with `train_bpe`, and serves chat-formatted (prompt, solution + EOS) pairs;
tool observations in a solution are tokenized on their own and carry no label
(`encode_response`). `SFTModule` builds a `LlamaForCausalLM` from a
config, trains it with the cross-entropy of the *response* tokens only (AdamW, warm-up then
cosine), logs the curve to TensorBoard, measures validation accuracy with the task's own
checker (greedy, and mean@k at temperature 1.0, by difficulty), and at the end of `fit` saves
the model and tokenizer in Hugging Face format (safetensors) to `export_dir`.

    python -m vapo_lightning.sft fit -c configs/quickstart_sft.yaml      # or: vapo sft -c ...
    vapo sft -c configs/quickstart_code_sft.yaml                         # the code task
    vapo sft -c configs/quickstart_tools_sft.yaml                        # the tool-use task
"""

from vapo_lightning.sft.cli import SFTCLI, plot_training_curve, sft_main
from vapo_lightning.sft.data import (
    IGNORE_INDEX,
    TASKS,
    Example,
    SFTDataModule,
    SFTTask,
    chat_prompt,
    encode_response,
    encode_responses,
    split_observations,
)
from vapo_lightning.sft.module import SFTModule

__all__ = [
    "IGNORE_INDEX",
    "SFTCLI",
    "TASKS",
    "Example",
    "SFTDataModule",
    "SFTModule",
    "SFTTask",
    "chat_prompt",
    "encode_response",
    "encode_responses",
    "plot_training_curve",
    "sft_main",
    "split_observations",
]
