"""benchmarks/stamp.py: every results file is headed by the line its script writes with the
date, the commit and the machine; no benchmark is run here."""

from __future__ import annotations

import ast
import os
import platform
import subprocess
import time
from pathlib import Path

from benchmarks.stamp import stamp

ROOT = Path(__file__).resolve().parents[2]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_the_stamp_names_the_date_the_commit_and_the_machine():
    line = stamp()
    assert "\n" not in line
    head = git("rev-parse", "--short", "HEAD")
    assert line.startswith(f"Date {time.strftime('%Y-%m-%d')}, commit {head}")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert ("+ uncommitted changes" in line) == dirty
    cpuinfo = Path("/proc/cpuinfo")
    models = (
        [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        if cpuinfo.exists()
        else []
    )
    if models:
        assert f"machine: {models[0]}, " in line
    assert f"{os.cpu_count()} logical CPUs" in line
    assert line.endswith(f"Python {platform.python_version()}")


def calls_stamp(source: str) -> bool:
    return any(
        isinstance(node, ast.Call) and "stamp" in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
        for node in ast.walk(ast.parse(source))
    )


def test_every_script_that_writes_results_calls_the_stamp():
    """A script that names a file under results/ writes it (or the numbers in it), so it
    heads its output with stamp()."""
    scripts = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/probes/*.py")])
    writers = [p for p in scripts if "results/" in p.read_text()]
    assert len(writers) > 10
    unstamped = [str(p.relative_to(ROOT)) for p in writers if not calls_stamp(p.read_text())]
    assert not unstamped, f"write results without calling benchmarks.stamp.stamp(): {unstamped}"
    assert "from benchmarks.stamp import stamp" in (ROOT / "benchmarks/gpu_check.sh").read_text()
