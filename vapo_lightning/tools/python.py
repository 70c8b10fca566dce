"""`PythonTool`: a code interpreter in the rollout, running each call in the sandbox.

The policy writes ``<code>print(4821*397)</code>``; the call runs as a fresh program in the
fork server's sandbox (`vapo_lightning.sandbox`: the same isolation layers, limits and
wall-clock timeout as the code reward's runs), and the observation is what it printed:
``<output>1913937</output>``. Calls of one response do **not** share interpreter state: each
call is a program of its own (as in ReTool's and SimpleTIR's sandboxes), so a response that
needs a value again computes it again. That keeps every call independent (the calls of a
round run concurrently, on any server of the pool) and a resumed or retried call
reproducible.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from vapo_lightning.sandbox.levels import ISOLATION_LEVELS, require_isolation
from vapo_lightning.tools.base import Tool, ToolOutput

__all__ = ["PythonTool"]

_FAILURES = {"timeout", "memory_limit", "setup_error", "server_error"}
"""Statuses counted in ``tools/errors``: the call did not finish, or the sandbox failed."""


class PythonTool(Tool):
    """Runs the Python code between `call_start` and `call_end` in the sandbox.

    Args:
        timeout_s: wall-clock limit of one call.
        max_output_bytes: bytes of stdout (and of stderr) kept from a call; the observation
            is then cut to `model.generation.max_observation_tokens` tokens.
        workers: sandbox servers (calls that run at once); None: one per CPU core.
        namespaces, landlock: isolation layers to use where the machine has them
            (`sandbox.client.Pool`; the observation never says which were active).
        min_isolation: ``"none" | "basic" | "strong" | "full"``
            (`sandbox.levels.ISOLATION_LEVELS`), as for `CodeReward`: the run refuses to
            start when the sandbox gives less, naming what is missing and how to get it.
    """

    name = "python"

    def __init__(
        self,
        call_start: str = "<code>",
        call_end: str = "</code>",
        output_start: str = "<output>",
        output_end: str = "</output>",
        timeout_s: float = 5.0,
        max_output_bytes: int = 16384,
        workers: int | None = None,
        namespaces: bool = True,
        landlock: bool = True,
        min_isolation: Literal["none", "basic", "strong", "full"] = "strong",
    ) -> None:
        super().__init__(call_start, call_end, output_start, output_end)
        if timeout_s <= 0 or max_output_bytes < 1:
            raise ValueError("PythonTool: timeout_s must be > 0 and max_output_bytes >= 1")
        if min_isolation not in ISOLATION_LEVELS:
            raise ValueError(
                f"PythonTool.min_isolation must be one of {sorted(ISOLATION_LEVELS)}, got {min_isolation!r}"
            )
        self.timeout_s, self.max_output_bytes, self.workers = timeout_s, max_output_bytes, workers
        self.namespaces, self.landlock = namespaces, landlock
        self.min_isolation = min_isolation
        self._pool = None

    def setup(self) -> None:
        if self._pool is None:
            from vapo_lightning.sandbox.client import Pool

            pool = Pool(self.workers, namespaces=self.namespaces, landlock=self.landlock)
            try:
                require_isolation("PythonTool", pool.layers, self.min_isolation, os.geteuid() == 0)
            except RuntimeError:
                pool.close()
                raise
            self._pool = pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def run(self, calls: list[str]) -> list[ToolOutput]:
        self.setup()
        with ThreadPoolExecutor(max_workers=len(self._pool.servers)) as pool:
            return list(pool.map(self._run_one, calls))

    def _run_one(self, code: str) -> ToolOutput:
        ex = self._pool.execute(code, timeout_s=self.timeout_s, max_output_bytes=self.max_output_bytes)
        text = ex.stdout.rstrip("\n")
        if ex.truncated:
            text += "\n... (output truncated)"
        if ex.status == "error":  # the program's own error: its last traceback line
            lines = [line for line in ex.stderr.strip().splitlines() if line.strip()]
            text = "\n".join(filter(None, [text, lines[-1] if lines else f"exit code {ex.exit_code}"]))
        elif ex.status == "timeout":
            text = "\n".join(filter(None, [text, f"Timed out after {self.timeout_s:g} s"]))
        elif ex.status == "memory_limit":
            text = "\n".join(filter(None, [text, "Memory limit exceeded"]))
        elif ex.status == "output_limit":
            text = "\n".join(filter(None, [text, "Output limit exceeded"]))
        elif ex.status in _FAILURES:
            text = f"Sandbox error ({ex.status})"
        error = ex.status if ex.status in _FAILURES else None
        return ToolOutput(text, error)
