"""`vapo sft` / ``python -m vapo_lightning.sft``: the SFT LightningCLI, and its curve plot."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from vapo_lightning.sft.data import SFTDataModule
from vapo_lightning.sft.module import SFTModule

__all__ = ["SFTCLI", "plot_training_curve", "sft_main"]


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
