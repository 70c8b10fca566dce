"""Tools for tests, importable by class path from a config (`model.tools`)."""

from __future__ import annotations

from vapo_lightning.tools import Tool, ToolOutput


class Upper(Tool):
    """Returns the call's text upper-cased: a deterministic stand-in for a tool."""

    name = "upper"

    def __init__(self, call_start: str = "<code>", call_end: str = "</code>") -> None:
        super().__init__(call_start, call_end)
        self.seen: list[list[str]] = []

    def run(self, calls: list[str]) -> list[ToolOutput]:
        self.seen.append(list(calls))
        return [ToolOutput(c.upper()) for c in calls]


class Broken(Upper):
    name = "broken"

    def run(self, calls: list[str]) -> list[ToolOutput]:
        raise ValueError("boom")


class EverySpace(Tool):
    """A tool an untrained policy calls often: every space it writes (or `call_end`) closes
    a call (the call is its text since the last observation). Its output is the call's length; calls
    longer than `fail_over` characters fail (counted in tools/errors)."""

    name = "every_space"

    def __init__(self, fail_over: int = 1 << 30, call_end: str = " ") -> None:
        super().__init__(call_start="", call_end=call_end)
        self.fail_over = fail_over

    def run(self, calls: list[str]) -> list[ToolOutput]:
        return [
            ToolOutput("too long", error="too_long") if len(c) > self.fail_over else ToolOutput(str(len(c)))
            for c in calls
        ]
