"""The tool interface: what the rollout needs of a tool the policy calls mid-response.

A call is model text between `Tool.call_start` and `Tool.call_end`; generation of a response
pauses when it has written `call_end`, the tool runs the call, and its output is appended as
an observation, ``output_start + text + output_end``, that the policy reads as context and is
never trained on (`tools.turns`). A tool keeps each argument of its ``__init__`` as an
attribute of the same name (scikit-learn's convention), so a run's checkpoint records it as
plain values (`spec` / `from_spec`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Tool", "ToolOutput", "from_spec", "show_errors", "spec"]


@dataclass
class ToolOutput:
    """What one call returned: the text the policy reads, and whether the tool failed."""

    text: str
    error: str | None = None
    """None, or the kind of failure (``timeout``, ``sandbox: setup_error``, an exception's
    type): counted in ``tools/errors``. A program that raises is not a tool failure: its
    traceback is the observation, the policy's own mistake to learn from."""


class Tool:
    """A tool the policy calls while it writes. Subclass it, implement `run`, and list it in
    the config under ``model.tools`` (``class_path`` / ``init_args``).

    Args:
        call_start: text that opens a call.
        call_end: text that closes a call: generation pauses once a response has written it.
        output_start, output_end: the observation's delimiters, around `run`'s text.
    """

    name: ClassVar[str] = "tool"

    def __init__(
        self,
        call_start: str = "<call>",
        call_end: str = "</call>",
        output_start: str = "<output>",
        output_end: str = "</output>",
    ) -> None:
        if not call_end:
            raise ValueError(f"{type(self).__name__}: call_end must not be empty")
        self.call_start, self.call_end = call_start, call_end
        self.output_start, self.output_end = output_start, output_end

    def setup(self) -> None:
        """Called once per process before the first rollout (start workers here)."""

    def close(self) -> None:
        """Called at the end of fit / validate."""

    def parse(self, text: str) -> str | None:
        """The call at the end of `text`, the model's text since its last observation, which
        ends with `call_end` (possibly followed by the rest of that token): what lies
        between the last `call_start` before it and it (all of `text` before it when
        `call_start` is empty). None: `call_end` without an opening one: ordinary text."""
        end = text.rfind(self.call_end)
        if end < 0:
            return None
        if not self.call_start:  # no opening text: the call is all the text since then
            return text[:end]
        start = text.rfind(self.call_start, 0, end)
        return None if start < 0 else text[start + len(self.call_start) : end]

    def run(self, calls: list[str]) -> list[ToolOutput]:
        """One output per call, in order. The calls of one round (every response paused at
        this tool) come together, so a tool can run them concurrently."""
        raise NotImplementedError

    def observation(self, text: str) -> str:
        return f"{self.output_start}{text}{self.output_end}"


def spec(tool: Tool) -> dict[str, Any]:
    """`tool` as plain values: ``{"class_path", "init_args"}`` (jsonargparse's form)."""
    cls = type(tool)
    names = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    args = {name: getattr(tool, name) for name in names if hasattr(tool, name)}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": args}


def from_spec(value: Tool | dict[str, Any]) -> Tool:
    """A tool from `spec`'s form (a checkpoint's hyper-parameters), or `value` itself."""
    if isinstance(value, Tool):
        return value
    module, _, name = value["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise TypeError(f"model.tools: {value['class_path']} is not a vapo_lightning Tool")
    return cls(**value.get("init_args", {}))


def show_errors(errors: list[tuple[str, str, str]], shown: set[tuple[str, str]]) -> None:
    """Warns once per (tool, kind of failure) with its message; each failed call is counted
    in `tools/errors` by the trainer."""
    from lightning.pytorch.utilities import rank_zero_warn

    for tool, kind, message in errors:
        if (tool, kind) not in shown:
            shown.add((tool, kind))
            rank_zero_warn(f"tool {tool!r} failed ({kind}): {message} (counted in tools/errors)")
