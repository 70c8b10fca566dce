"""A per-token view of the critic: what a value-based method's advantages are made of.

For each response token t: the critic's value V(s_t), the TD error
delta_t = r_t + gamma V(s_{t+1}) - V(s_t) (GAE with lambda 0) and the advantage A_t (GAE with
the actor's lambda, length-adaptive or fixed, VAPO §4.2), all from `core.gae` over the same
sparse rewards and response mask as `advantages.compute_advantages`: tool observations are
context, not actions, and get no numbers. The view leaves out one thing the update does:
whitening, a shift and scale of the whole batch's advantages (`whiten_advantages`).

For a wrong answer the token where V falls the most marks where the critic saw it go wrong.

`CriticView` draws it at each validation for a few responses of the first batch (TensorBoard
image `critic_view/image` and text `critic_view/text`, and `critic_view.md` plus one PNG per
response in its folder); `vapo inspect` runs a validation with it on any checkpoint and any
prompt file.
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from vapo_lightning import core
from vapo_lightning.advantages import actor_lambda
from vapo_lightning.config import Algorithm
from vapo_lightning.rollout import Rollout
from vapo_lightning.updates import Forwards, compute_values

__all__ = ["CriticView", "TokenView", "pick_rows", "token_views"]


@dataclass
class TokenView:
    """One response, token by token. `value`, `td_error` and `advantage` are NaN on context
    tokens (a tool's observation); `drop` is the action token where V fell the most (None for
    a right answer)."""

    prompt: str
    response: str
    reward: float
    correct: bool
    tokens: list[str]
    action: list[bool]
    value: list[float]
    td_error: list[float]
    advantage: list[float]
    drop: int | None

    def markdown(self) -> str:
        verdict = "right" if self.correct else "wrong"
        head = f"**reward {self.reward:+.2f} ({verdict})**, prompt: {self.prompt[-200:]!r}\n\n"
        rows = ["| t | token | V | TD error | advantage |", "|---|---|---|---|---|"]
        for t, tok in enumerate(self.tokens):
            mark = " ← largest drop of V" if t == self.drop else ""
            cells = [f"{x:+.3f}" for x in (self.value[t], self.td_error[t], self.advantage[t])]
            if not self.action[t]:
                cells = ["(context)", "", ""]
            rows.append(f"| {t} | {tok!r} | " + " | ".join(cells) + f" |{mark}")
        return head + "\n".join(rows) + "\n"


@torch.no_grad()
def token_views(r: Rollout, values: Tensor, algo: Algorithm, tokenizer: Any) -> list[TokenView]:
    """The view of each response of the scored rollout `r`, with its V_old `values` (B, T)."""
    mask = r.response_mask
    rewards = core.sparse_rewards(r.scores.float(), mask)
    values = values.float()
    td_error = core.gae(rewards, values, mask, algo.gamma, 0.0)[0]  # (B, T)
    advantage = core.gae(rewards, values, mask, algo.gamma, actor_lambda(r, algo))[0]  # (B, T)
    shown = [torch.where(mask, x, float("nan")) for x in (values, td_error, advantage)]  # (B, T) each
    views = []
    for b in range(len(r)):
        length = int((r.attention_mask[b, r.prompt_length :] > 0).sum())  # its tokens, observations too
        value, delta, adv = (x[b, :length].tolist() for x in shown)
        steps = [t for t in range(length) if mask[b, t]]
        falls = [(value[s] - value[t], t) for s, t in itertools.pairwise(steps)]
        drop = max(falls)[1] if falls and not bool(r.correct[b]) else None
        sample = r.samples[b] if r.samples else None
        views.append(
            TokenView(
                prompt=sample.prompt if sample else "",
                response=sample.response if sample else "",
                reward=float(r.scores[b]),
                correct=bool(r.correct[b]),
                tokens=[tokenizer.decode([i]) for i in r.responses[b, :length].tolist()],
                action=mask[b, :length].tolist(),
                value=value,
                td_error=delta,
                advantage=adv,
                drop=drop,
            )
        )
    return views


def pick_rows(correct: Tensor, k: int) -> list[int]:
    """The first k rows, with the first wrong answer among them when there is one."""
    rows = list(range(min(k, len(correct))))
    wrong = (~correct.bool()).nonzero().flatten().tolist()
    if wrong and not any(w in rows for w in wrong) and rows:
        rows[-1] = wrong[0]
    return rows


def figure(view: TokenView, max_labels: int = 96) -> Any:
    """V, TD error and advantage over every token of the response.

    A sparse-reward critic's signal sits at the end of the answer (the reward enters the TD
    error at the last action token), so the whole answer is drawn; past `max_labels` tokens
    only every k-th token is labelled, with the largest drop of V and the last action token
    always among the labels. The reward is marked where it enters.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(view.tokens)
    last = max((t for t in range(n) if view.action[t]), default=None)  # where the reward enters
    fig, axes = plt.subplots(3, 1, figsize=(0.16 * min(n, max_labels) + 2.5, 6), sharex=True)
    series = [
        ("V(s_t)", view.value, "tab:blue"),
        ("TD error", view.td_error, "tab:orange"),
        ("advantage", view.advantage, "tab:green"),
    ]
    for ax, (name, ys, color) in zip(axes, series):
        ax.plot(range(n), ys, marker="." if n <= max_labels else None, color=color, lw=1)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_ylabel(name)
        if view.drop is not None:
            ax.axvline(view.drop, color="red", lw=0.8, ls="--")
    if last is not None:
        axes[1].plot([last], [view.td_error[last]], marker="*", ms=10, color="black", ls="none")
        axes[1].annotate(
            f"reward {view.reward:+.2f}",
            (last, view.td_error[last]),
            fontsize=7,
            xytext=(-4, 6),
            textcoords="offset points",
            ha="right",
        )
    every = math.ceil(n / max_labels) if n else 1
    ticks = sorted(set(range(0, n, every)) | {t for t in (view.drop, last) if t is not None})
    axes[-1].set_xlim(-0.5, n - 0.5)
    axes[-1].set_xticks(ticks)
    axes[-1].set_xticklabels([view.tokens[t].replace("\n", "\\n") for t in ticks], rotation=90, fontsize=6)
    shown = "" if every == 1 else f", a label every {every} tokens"
    drop = "" if view.drop is None else f" (dashed: largest drop of V, token {view.drop})"
    verdict = "right" if view.correct else f"wrong{drop}"
    axes[0].set_title(f"reward {view.reward:+.2f}, {verdict}; {n} tokens{shown}", fontsize=9)
    fig.tight_layout()
    return fig


def png(view: TokenView) -> bytes:
    import matplotlib.pyplot as plt

    fig = figure(view)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


class CriticView(L.Callback):
    """At each validation: the critic's per-token view of `k` responses of the first batch
    (one of them wrong when the batch has a wrong one), in TensorBoard (`critic_view/image`,
    `critic_view/text`) and in `folder` (default `<default_root_dir>/critic_view/`):
    `critic_view.md` (appended) and `step<N>_<i>.png`. Rank 0's responses only (every rank
    runs the critic on its own, as a sharded critic needs).

    Args:
        k: responses shown per validation.
        folder: where the files go.
    """

    def __init__(self, k: int = 4, folder: str | None = None) -> None:
        self.k, self.folder = k, folder
        self.last_views: list[TokenView] = []  # the last drawn, and their responses
        self.last_rollout: Rollout | None = None

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        r = getattr(pl_module, "last_val_rollout", None)
        if batch_idx != 0 or r is None or pl_module.critic is None:
            return
        r = self.last_rollout = r.select(pick_rows(r.correct, self.k))
        # V(s_t) on every rank, in one forward each (a sharded critic's forward is collective:
        # every rank takes part); rank 0 draws and writes.
        values = compute_values(pl_module.critic, r, Forwards(max(1, len(r))))
        if not trainer.is_global_zero:
            return
        self.last_views = token_views(r, values, pl_module.algo, pl_module.tokenizer)
        # (`vapo validate` / `inspect` of a checkpoint leave the trainer's step at 0)
        self.write(trainer, self.last_views, max(trainer.global_step, pl_module.checkpoint_step))

    def write(self, trainer: L.Trainer, views: list[TokenView], step: int) -> None:
        """The views of rollout step `step` to files and TensorBoard."""
        folder = Path(self.folder or Path(trainer.default_root_dir) / "critic_view")
        folder.mkdir(parents=True, exist_ok=True)
        text = "".join(f"### step {step}, response {i}\n\n{v.markdown()}\n" for i, v in enumerate(views))
        with (folder / "critic_view.md").open("a", encoding="utf-8") as f:
            f.write(text)
        images = [png(v) for v in views]
        for i, image in enumerate(images):
            (folder / f"step{step}_{i}.png").write_bytes(image)
        writer = getattr(getattr(trainer, "logger", None), "experiment", None)
        if writer is not None and hasattr(writer, "add_image"):
            import numpy as np
            from PIL import Image

            for i, image in enumerate(images):
                array = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
                writer.add_image(f"critic_view/image/{i}", array, step, dataformats="HWC")
            writer.add_text("critic_view/text", text, step)
