"""Runs the quickstart's first steps, or compares two such runs bit for bit.

A refactor of the training step must not change what a run computes. Run the same command
in two checkouts (each with its own package on PYTHONPATH), then compare:

    PYTHONPATH=<checkout A> python scripts/same_steps.py run /tmp/a
    PYTHONPATH=<checkout B> python scripts/same_steps.py run /tmp/b
    python scripts/same_steps.py compare /tmp/a /tmp/b

`run` trains `configs/quickstart.yaml` (seed 0) for `--steps` rollout steps, without
validation, and keeps the weights; `compare` checks that every logged scalar of every step
(timings and throughput aside) and every weight of the policy and the critic are equal,
not close. It exits 1 on the first difference it reports.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

TIMED = ("timing_s/", "perf/")  # wall-clock numbers: never equal from one run to the next


def run(out: Path, steps: int, config: str) -> None:
    from vapo_lightning.cli import main

    main(
        [
            "fit",
            "-c",
            config,
            f"--trainer.max_steps={steps}",
            f"--trainer.default_root_dir={out}",
            "--trainer.limit_val_batches=0",
            "--model.val_before_train=false",
            f"--model.hf_export_dir={out / 'hf'}",
        ]
    )


def scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run's TensorBoard events, as (step, value) pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(root.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def weights(root: Path) -> dict[str, object]:
    """The exported policy's and critic's tensors, by `<model>/<name>`."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted((root / "hf").rglob("*.safetensors")):
        model = path.parent.name
        out.update({f"{model}/{k}": v for k, v in load_file(path).items()})
    return out


def same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def compare(a: Path, b: Path) -> int:
    import torch

    sa, sb = scalars(a), scalars(b)
    problems = [f"only in one run: {tag}" for tag in sorted(set(sa) ^ set(sb))]
    checked = 0
    for tag in sorted(set(sa) & set(sb)):
        if tag.startswith(TIMED):
            continue
        if [s for s, _ in sa[tag]] != [s for s, _ in sb[tag]]:
            problems.append(f"{tag}: logged at steps {[s for s, _ in sa[tag]]} vs {[s for s, _ in sb[tag]]}")
            continue
        for (step, x), (_, y) in zip(sa[tag], sb[tag]):
            checked += 1
            if not same(x, y):
                problems.append(f"{tag} at step {step}: {x!r} vs {y!r}")
    wa, wb = weights(a), weights(b)
    problems += [f"weight only in one run: {k}" for k in sorted(set(wa) ^ set(wb))]
    problems += [f"weight differs: {k}" for k in sorted(set(wa) & set(wb)) if not torch.equal(wa[k], wb[k])]
    if not wa:
        problems.append("no exported weights found")
    steps = max((s for v in sa.values() for s, _ in v), default=-1) + 1
    print(f"{len(sa)} tags, {checked} scalar values over {steps} logged steps, {len(wa)} weight tensors compared")
    for p in problems:
        print("DIFFERENT:", p)
    print("identical" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("out", type=Path)
    p_run.add_argument("--steps", type=int, default=8)
    p_run.add_argument("--config", default="configs/quickstart.yaml")
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.steps, args.config)
    else:
        sys.exit(compare(args.a, args.b))
