"""The step protocol shared by the three benchmark children (standard library only, so it
imports in the main venv and in both TRL venvs).

A child trains for `total` steps. At the end of each step it reports one JSON line on the
protocol stream (its original stdout; stray library prints are sent to stderr) and then
waits for the parent's "go" on stdin before the next step, so the parent can run the three
systems' steps one at a time, alternately. The reported seconds run from the moment "go"
arrived (for step 0: the start of training) to the end of the step, so they exclude process
start-up and model loading and include everything the trainer's loop does between steps.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # a library's print() must not corrupt the protocol


def common_setup(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)


class StepDriver:
    def __init__(self, total: int, static: dict[str, Any] | None = None) -> None:
        self.total, self.static = total, static or {}
        self.step = 0
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def end(self, **info: Any) -> None:
        import torch

        if torch.cuda.is_initialized():  # the step's kernels have finished, not just queued
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
        msg = {
            "step": self.step,
            "seconds": seconds,
            "peak_rss_mib": rss,
            "torch_threads": torch.get_num_threads(),
            **info,
        }
        if torch.cuda.is_initialized():
            msg["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        if self.step == 0:
            msg.update(self.static)
        _proto.write(json.dumps(msg) + "\n")
        self.step += 1
        if self.step >= self.total:  # skip the trainer's end-of-training work
            _proto.flush()
            sys.stderr.flush()
            os._exit(0)
        if sys.stdin.readline().strip() != "go":
            os._exit(1)
        self.t0 = time.perf_counter()


def versions(*names: str, device: str = "cpu") -> dict[str, dict[str, str]]:
    """The packages' versions, and the GPU's name and CUDA version where it runs on one."""
    from importlib.metadata import version

    out = {n: version(n) for n in names}
    if device == "cuda":
        import torch

        out.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return {"versions": out}
