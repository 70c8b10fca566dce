"""A client for a SandboxFusion-compatible HTTP code sandbox (`POST /run_code`).

Use it when code runs on a sandbox service rather than on the training machine:

    --trainer.callbacks+=vapo_lightning.rewards.sandbox_fusion.SandboxFusionReward
    --trainer.callbacks.url=http://sandbox.internal:8080

Each test {"input": stdin, "output": expected stdout} is one request; the expected output
never leaves this process, and the verdict is decided here by comparing whole outputs
(trailing whitespace per line ignored). Reward: the fraction of tests passed, or 1/0 with
`all_or_nothing`.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vapo_lightning.rewards.base import RewardCallback, Sample, SampleError
from vapo_lightning.rewards.code import extract_code


def normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


class SandboxFusionReward(RewardCallback):
    """Scores code responses on a SandboxFusion-compatible server.

    Args:
        url: the server's base URL.
        language: SandboxFusion's language name.
        run_timeout_s: per-test limit sent to the server.
        max_concurrency: requests in flight.
        all_or_nothing: 1 only when every test passes (else the pass fraction).
    """

    correct_threshold = 0.999

    def __init__(
        self,
        url: str,
        language: str = "python",
        run_timeout_s: float = 10.0,
        max_concurrency: int = 8,
        all_or_nothing: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.url = url.rstrip("/") + "/run_code"
        self.language, self.run_timeout_s, self.all_or_nothing = (
            language,
            run_timeout_s,
            all_or_nothing,
        )
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sandbox-fusion")

    def run(self, code: str, stdin: str) -> str | None:
        """stdout of one run, or None when the run did not finish normally."""
        body = json.dumps(
            {
                "code": code,
                "language": self.language,
                "stdin": stdin,
                "run_timeout": self.run_timeout_s,
            }
        )
        request = urllib.request.Request(self.url, body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.run_timeout_s + 30) as response:
            result = json.loads(response.read())
        if result.get("status") not in ("Success", "Failed"):  # "SandboxError": not the program
            raise RuntimeError(f"the sandbox answered {result.get('status')!r}: {result.get('message', '')}")
        run = result.get("run_result") or {}
        if result.get("status") != "Success" or run.get("status") != "Finished" or run.get("return_code") != 0:
            return None
        return run.get("stdout", "")

    def score_one(self, sample: Sample) -> float | SampleError | None:
        tests = sample.ground_truth
        if not isinstance(tests, list) or not tests:
            return None  # counted as a reward error by the trainer
        code = extract_code(sample.response)
        try:
            outputs = list(self.pool.map(lambda t: self.run(code, t["input"]), tests))
        except (RuntimeError, OSError, ValueError) as err:  # the sandbox's answer, HTTP, socket,
            # JSON: this sample's error, counted and shown, never a failed test or the batch's
            return SampleError(f"{type(err).__name__}: {err}", "sandbox error")
        passed = sum(out is not None and normalise(out) == normalise(t["output"]) for out, t in zip(outputs, tests))
        return float(passed == len(tests)) if self.all_or_nothing else passed / len(tests)

    def score(self, samples: Sequence[Sample]) -> list[float | SampleError | None]:
        return [self.score_one(s) for s in samples]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
