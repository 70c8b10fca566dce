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

from vapo_lightning.sft.cli import SFTCLI, plot_training_curve, sft_main
from vapo_lightning.sft.data import IGNORE_INDEX, TASKS, SFTDataModule, SFTTask, chat_prompt
from vapo_lightning.sft.module import SFTModule

__all__ = [
    "IGNORE_INDEX",
    "SFTCLI",
    "TASKS",
    "SFTDataModule",
    "SFTModule",
    "SFTTask",
    "chat_prompt",
    "plot_training_curve",
    "sft_main",
]
