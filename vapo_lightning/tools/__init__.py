"""Tools the policy calls while it writes a response (multi-turn rollouts).

`Tool` is the interface (subclass it as a dataclass), `PythonTool` the built-in code
interpreter that runs each call in the sandbox, `run_turns` the engine-agnostic loop that
pauses responses at calls and appends the tools' observations. Listed in a run's config:

    model:
      tools:
        - class_path: vapo_lightning.tools.PythonTool
          init_args: {timeout_s: 5.0}
"""

from vapo_lightning.tools.base import Tool, ToolOutput
from vapo_lightning.tools.python import PythonTool
from vapo_lightning.tools.turns import Segment, Turns, observation_ids, run_turns

__all__ = ["PythonTool", "Segment", "Tool", "ToolOutput", "Turns", "observation_ids", "run_turns"]
