"""Bring verl reward files unchanged: a file of verl's ``reward_score/``, a folder of them
(picked per sample by data source, as verl's ``default_compute_score`` does), or a
``custom_reward_function`` taking ``(data_source, solution_str, ground_truth, extra_info)``.

--trainer.callbacks+=vapo_lightning.rewards.verl.VerlReward
--trainer.callbacks.path=my_rewards.py --trainer.callbacks.function=compute_score

The function runs in worker processes (fresh interpreters, see `verl_calls`), one sample per
call, in the worker's main thread: ``signal.alarm`` timeouts, which math-verify and verl's
``math_verify.py`` use, work there (off the main thread they raise, and verl's file turns the
error into a score of 0). A call that passes `call_timeout_s` is stopped by killing its worker
(the pool is `workers`; this file says what its workers run and what a reply means).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vapo_lightning.rewards import verl_calls
from vapo_lightning.rewards.base import RewardCallback, Sample, SampleError
from vapo_lightning.rewards.math_answers import number_text
from vapo_lightning.rewards.verl_calls import frame, load_reward, split_frames
from vapo_lightning.rewards.workers import Lost, WorkerPool, start_process

__all__ = ["FunctionPool", "VerlReward", "load_reward"]


class FunctionPool(WorkerPool):
    """Worker processes calling one reward; each call has a hard wall-clock limit.

    Args:
        spec: ``(path, function, sources)``, as `verl_calls.load_reward` takes them.
        num_workers: processes (started on first use; each an interpreter's start plus the
            reward's imports).
        call_timeout_s: limit of one call; past it the worker is killed and replaced.
        startup_timeout_s: how long a worker may take to load the reward.
    """

    def __init__(
        self,
        spec: tuple[str, str, Mapping[str, str] | None],
        num_workers: int = 2,
        call_timeout_s: float = 10.0,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if num_workers < 1 or not call_timeout_s > 0:
            raise ValueError("FunctionPool needs num_workers >= 1 and call_timeout_s > 0")
        self.spec = (str(Path(spec[0]).resolve()), spec[1], dict(spec[2] or {}))
        label = f"reward worker for {self.spec[0]}"
        super().__init__(num_workers, call_timeout_s, startup_timeout_s, label=label)

    def map(self, calls: Sequence[tuple[str, str, Any, dict]]) -> list[tuple[float | None, tuple[str, str] | None]]:
        """``(score, None)`` or ``(None, (kind, message))`` per ``(data_source, solution_str,
        ground_truth, extra_info)``."""
        return [self._outcome(reply) for reply in self.run(calls)]

    def _outcome(self, reply: tuple | Lost) -> tuple[float | None, tuple[str, str] | None]:
        if not isinstance(reply, Lost):
            return reply
        if reply.timed_out:
            why = f"took longer than call_timeout_s={self.timeout_s} (worker killed)"
            return None, ("TimeoutError", why)
        return None, ("worker died", f"worker died (exit code {reply.exit_code})")

    def close(self, wait: bool = False) -> None:
        """Kills the workers at once (a hung call is not waited for); later calls start new ones."""
        super().close(wait)

    # -- the worker's side (`WorkerPool`): verl_calls.serve, spoken to in pickled frames

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        # -c, not the file as a script: its folder (math.py, code.py) would shadow modules
        run = f"import runpy; runpy.run_path({verl_calls.__file__!r}, run_name='__main__')"
        return start_process([sys.executable, "-c", run], env=env, greeting=frame(self.spec))

    def _encode(self, task: int, call: tuple) -> bytes:
        return frame((task, *call))

    def _decode(self, buffer: bytes) -> tuple[list[tuple[int | str, Any]], bytes]:
        replies, rest = split_frames(buffer)
        for task, _, error in replies:
            if task == "load-error":
                raise RuntimeError(f"reward worker could not load {self.spec[0]}: {error}")
        return [(task, (score, error)) for task, score, error in replies], rest


def verl_ground_truth(value: Any) -> Any:
    """The ground truth as verl's reward files take it. verl's data holds it as a string and
    its files compare strings (``gsm8k.py``: ``answer == ground_truth``), so a number read from
    JSON is passed as its text (72 -> "72", 1e-05 -> "0.00001"). verl's whole ``reward_model``
    entry, or a NaN, is refused: the function would score every response 0 without an error."""
    if isinstance(value, Mapping) and "ground_truth" in value:
        raise SampleError(
            "the ground truth is verl's reward_model entry, not its ground_truth: point "
            "data.answer_field at the answer (verl's parquet layout: convert it with "
            "`python -m vapo_lightning.datasets_math dapo`)",
            kind="ground truth",
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise SampleError(f"the ground truth is {value}", kind="ground truth")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return number_text(value)
    return value


class VerlReward(RewardCallback):
    """Calls a verl reward function once per sample, in worker processes.

    Args:
        path: a Python file holding the function, or a folder of verl reward files
            (``verl/utils/reward_score``): each sample's file is then picked by its
            ``data_source`` as verl's ``default_compute_score`` picks it.
        function: the function's name in a file (verl's default: ``compute_score``).
        sources: with a folder, more ``data_source -> file stem`` entries (or overrides),
            e.g. ``{"my_gsm8k": "gsm8k"}``.
        correct_threshold: a score above this counts as correct (accuracy metrics and the
            positive-example NLL); None: this reward is not a verifier.
        num_workers: worker processes.
        call_timeout_s: hard limit of one call (the worker is killed after it).
        **kwargs: `RewardCallback`'s weight, on_error, error_value, max_error_share, ...

    The function is called as ``fn(data_source=, solution_str=, ground_truth=, extra_info=)``
    when it takes ``data_source``, else as ``fn(solution_str, ground_truth)``; it may return a
    number or a dict with a ``"score"`` entry. A numeric ground truth is passed as its text,
    as verl's data holds it (`verl_ground_truth`).
    """

    def __init__(
        self,
        path: str,
        function: str = "compute_score",
        sources: dict[str, str] | None = None,
        correct_threshold: float | None = 0.0,
        num_workers: int = 2,
        call_timeout_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("timeout_s", None)  # each call has its own hard limit
        super().__init__(**kwargs)
        load_reward(path, function, sources)  # fail here, not in a worker, on a wrong path
        self.correct_threshold = correct_threshold
        self.pool = FunctionPool((path, function, sources), num_workers, call_timeout_s)
        where = Path(path).name + (f":{function}" if Path(path).is_file() else "/")
        self._name = f"VerlReward({where})"

    @property
    def name(self) -> str:
        return self._name

    def score(self, samples: Sequence[Sample]) -> list[float | SampleError]:
        truths: list[Any] = []
        for s in samples:
            try:
                truths.append(verl_ground_truth(s.ground_truth))
            except SampleError as refused:
                truths.append(refused)
        calls = [
            (s.data_source, s.response, t, dict(s.extra_info))
            for s, t in zip(samples, truths)
            if not isinstance(t, SampleError)
        ]
        results = iter(self.pool.map(calls))  # in the order of the samples called
        out: list[float | SampleError] = []
        for truth in truths:
            if isinstance(truth, SampleError):
                out.append(truth)
                continue
            score, error = next(results)
            out.append(SampleError(error[1], kind=error[0]) if error is not None else score)
        return out

    def close(self) -> None:
        self.pool.close()
