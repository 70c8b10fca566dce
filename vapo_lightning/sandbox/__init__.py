"""Sandboxed execution of model-written Python, judged on the host.

`evaluate(code, tests, fn_name=None, timeout_s=10.0)` runs all tests of one program in one
sandboxed process forked from a warm server and returns a `Result` with `passed`, `total`,
`status`, the isolation `layers` that took effect and timings. See `server.py` for the process
tree, `isolation.py` for how each sandbox sets its layers up, `compare.py` for the verdict,
`importers.py` for dataset formats. `execute(code, timeout_s=5.0)` runs one program (a
code-interpreter tool call) in the same sandbox and returns its exit status, stdout and stderr.
"""

from vapo_lightning.sandbox.client import (
    ALL_LAYERS,
    Execution,
    Limits,
    Pool,
    Result,
    WarmServer,
    evaluate,
    execute,
)

__all__ = [
    "ALL_LAYERS",
    "Execution",
    "Limits",
    "Pool",
    "Result",
    "WarmServer",
    "evaluate",
    "execute",
]
