"""Sandboxed execution of model-written Python, judged on the host.

`evaluate(code, tests, fn_name=None, timeout_s=10.0)` runs all tests of one program in one
sandboxed process forked from a warm server and returns a `Result` with `passed`, `total`,
`status`, the isolation `layers` that took effect and timings. See `server.py` for the process
tree, `isolation.py` for how each sandbox sets its layers up, `compare.py` for the verdict,
`importers.py` for dataset formats.
"""

from vapo_lightning.sandbox.client import ALL_LAYERS, Limits, Pool, Result, WarmServer, evaluate

__all__ = ["ALL_LAYERS", "Limits", "Pool", "Result", "WarmServer", "evaluate"]
