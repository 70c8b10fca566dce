"""What the console shows: other libraries' messages that do not apply to a VAPO run are
dropped, each for a stated reason (`tests/trainer/test_console.py` checks a run's output)."""

from __future__ import annotations

import logging
import warnings

__all__ = ["DropMessages", "quiet_lightning", "quiet_vllm"]


class DropMessages(logging.Filter):
    """Drops a logger's records whose message contains one of `needles`."""

    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


def quiet_lightning() -> None:
    """Silences Lightning's messages that do not apply to VAPO: the ModelCheckpoint example
    for manual optimisation (checkpoints are taken after a rollout step's updates, by design),
    "modules in eval mode" (the sampler switches modes itself), an internal deprecation, the
    model summary's "precision not supported" (its size column is fp32 weights, which
    bf16-mixed keeps), the sync_dist hint for validation metrics (reduced over ranks already)
    and the litlogger advertisement."""
    for message in (
        "Using ModelCheckpoint with manual optimization",
        r"Found \d+ module\(s\) in eval mode",
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"Precision \S+ is not supported by the model summary",  # its size column: fp32 weights
        # Validation metrics are reduced over ranks before they are logged (`ValidationMetrics`);
        # Lightning asks for sync_dist whenever a process group exists (vLLM makes one).
        r"It is recommended to use `self.log\('val/",
    ):
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(DropMessages("litlogger"))


def quiet_vllm() -> None:
    """Silences vLLM's warnings about what the trainer's engine does by design: it passes
    token ids in and out (no tokenizer: its chat-template warm-up fails, with a traceback,
    and it has no EOS id of its own, the trainer passes the stop ids), and a weight sync does
    not send the rotary embedding's cos/sin cache, which is computed from the config and kept
    (greedy tokens after a sync equal the trainer's: tests/engines/test_vllm.py)."""
    for name, drop in VLLM_BY_DESIGN.items():  # the same filter objects: added once per logger
        logging.getLogger(name).addFilter(drop)


VLLM_BY_DESIGN = {  # logger -> its warnings about what the engine does by design (`quiet_vllm`)
    "vllm.renderers.base": DropMessages("Chat template warmup failed", "because tokenizer is not initialized"),
    "vllm.model_executor.model_loader.reload.layerwise": DropMessages("RotaryEmbedding: Failed to load weights"),
}
