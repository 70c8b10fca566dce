"""`CodeReward`: run the response's program on the row's tests in the sandbox and score it.

The tests come from `Sample.ground_truth` (a list of ``{"input", "output"}`` dicts, the
TACO/APPS/LiveCodeBench ``{"inputs", "outputs", "fn_name"}`` dict, HumanEval problems or
MBPP assert lines; see `vapo_lightning.sandbox.importers`); ``fn_name`` may also come from
`Sample.extra_info`. The warm fork servers start in ``__init__``, i.e. when the CLI builds the
callbacks, before the trainer initialises CUDA or threads; the run refuses to start when the
machine offers less isolation than `min_isolation`.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from vapo_lightning.rewards.base import RewardCallback, Sample, SampleError
from vapo_lightning.sandbox import Limits, Pool
from vapo_lightning.sandbox.importers import from_ground_truth
from vapo_lightning.sandbox.levels import ISOLATION_LEVELS, missing_isolation, require_isolation

__all__ = ["ISOLATION_LEVELS", "STAT_KEYS", "CodeReward", "extract_code", "missing_isolation"]

STAT_KEYS = ("samples", "passed", "failed", "timeout", "error", "no_tests", "tests_skipped")
"""Keys of `CodeReward.last_stats`."""

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last ```python (or bare ```) fenced block of the response, else the whole text."""
    blocks = _FENCE.findall(response)
    return blocks[-1][1] if blocks else response


class CodeReward(RewardCallback):
    """Reward = tests passed by the response's program, run sandboxed and judged on the host.

    Args:
        all_or_nothing: 1.0 only when every test passes; otherwise the fraction passed.
        program_timeout_s: wall-clock limit for one program on all of its tests.
        min_isolation: ``"none" | "basic" | "strong" | "full"`` (`ISOLATION_LEVELS`); the run
            refuses to start with less, naming what is missing and how to get it.
        num_workers: warm fork servers run in parallel (default: CPU count).
        memory_mb: address-space limit per sandboxed process, and (with the `memory_cgroup`
            layer) the memory of all of one program's processes together.
        no_tests_value: reward for a row whose tests cannot be imported (None: an error,
            handled by `on_error`).
        **kwargs: `RewardCallback` arguments (weight, on_error, error_value, timeout_s).

    After each `score` call, `last_stats` holds per-batch counts of outcomes (see `STAT_KEYS`),
    which the trainer logs as ``code/<key>`` (`metrics`).
    """

    correct_threshold = 1.0 - 1e-9
    """A verifier: "correct" (accuracy, the positive-example NLL) means every test passed, the
    only score of 1.0, with or without `all_or_nothing`; a partial pass is not correct."""

    def __init__(
        self,
        all_or_nothing: bool = False,
        program_timeout_s: float = 10.0,
        min_isolation: Literal["none", "basic", "strong", "full"] = "strong",
        num_workers: int | None = None,
        memory_mb: int = 2048,
        no_tests_value: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if program_timeout_s <= 0:
            raise ValueError(f"CodeReward.program_timeout_s must be > 0, got {program_timeout_s}")
        self.all_or_nothing = all_or_nothing
        self.program_timeout_s = float(program_timeout_s)
        self.min_isolation = min_isolation
        self.no_tests_value = no_tests_value
        self.num_workers = num_workers or max(1, os.cpu_count() or 1)
        self.limits = Limits(memory_mb=memory_mb)
        self._stats_lock = threading.Lock()
        self._warned_skipped = False
        self.pool: Pool | None = Pool(self.num_workers, limits=self.limits)
        self.layers = list(self.pool.layers)
        self.last_statuses: Counter[str] = Counter()
        self.last_stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0.0)
        """Counts over the samples of the last `score` call (reset by each call), for logging:
        ``passed`` (every test passed), ``failed`` (ran, some test failed), ``timeout``,
        ``error`` (crash, output limit, sandbox error), ``no_tests`` (tests could not be
        imported) and ``samples``; ``tests_skipped`` counts tests (not samples) of the rows
        that the importer could not convert exactly and that are not run (each such row is
        scored on its other tests; shown once). Floats, so that they can go to `log_dict`."""
        self._check_isolation()

    def _check_isolation(self) -> None:
        try:
            require_isolation("CodeReward", self.layers, self.min_isolation, os.geteuid() == 0)
        except RuntimeError:
            self.close()
            raise

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.pool is None:  # closed by an earlier fit/validate: start again
            self.pool = Pool(self.num_workers, limits=self.limits)
            self.layers = list(self.pool.layers)
        self._check_isolation()

    def _score_one(self, sample: Sample) -> float | SampleError | None:
        fn_name = (sample.extra_info or {}).get("fn_name") or None
        why = "no tests in the ground truth"
        try:
            imported = from_ground_truth(sample.ground_truth, fn_name)
        except (ValueError, TypeError, KeyError, SyntaxError) as err:
            imported, why = None, f"its tests cannot be imported ({type(err).__name__}: {err})"
        if imported is not None and not imported.tests and imported.skipped:
            why = f"none of its {imported.skipped} tests has an exact input/output form"
        if imported is None or not imported.tests:
            with self._stats_lock:
                self.last_stats["no_tests"] += 1
                self.last_stats["tests_skipped"] += imported.skipped if imported else 0
            if self.no_tests_value is None:
                return SampleError(f"{why}: {str(sample.ground_truth)[:120]!r}", "no tests")
            return self.no_tests_value
        if imported.skipped:
            with self._stats_lock:
                self.last_stats["tests_skipped"] += imported.skipped
                first, self._warned_skipped = not self._warned_skipped, True
            if first:
                warnings.warn(  # on every rank, as the reward failures
                    f"CodeReward: {imported.skipped} of a row's {imported.skipped + len(imported.tests)} "
                    "tests have no exact input/output form and are not run; the row is scored on "
                    f"the other {len(imported.tests)} (counted in code/tests_skipped; shown once). "
                    f"Its ground truth: {str(sample.ground_truth)[:200]!r}",
                    stacklevel=2,
                )
        result = self.pool.evaluate(
            extract_code(sample.response),
            imported.tests,
            imported.fn_name,
            timeout_s=self.program_timeout_s,
        )
        if result.status == "ok":
            kind = "passed" if result.passed == result.total else "failed"
        elif result.status == "timeout":
            kind = "timeout"
        else:
            kind = "error"
        with self._stats_lock:
            self.last_statuses[result.status] += 1
            self.last_stats[kind] += 1
        if result.status in ("setup_error", "server_error"):  # the sandbox failed, not the program
            detail = next((e for e in [*result.setup_errors, *result.errors] if e), "")
            return SampleError(f"the sandbox failed ({result.status}) {detail}".strip(), result.status)
        if self.all_or_nothing:
            return float(result.passed == result.total)
        return result.passed / result.total

    def score(self, samples: Sequence[Sample]) -> list[float | SampleError | None]:
        if self.pool is None:
            raise RuntimeError("CodeReward was closed")
        self.last_statuses = Counter()
        self.last_stats = dict.fromkeys(STAT_KEYS, 0.0)
        self.last_stats["samples"] = float(len(samples))
        with ThreadPoolExecutor(self.num_workers, thread_name_prefix="vapo-code") as ex:
            return list(ex.map(self._score_one, samples))

    def metrics(self) -> dict[str, float]:
        return {f"code/{k}": v for k, v in self.last_stats.items()}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
