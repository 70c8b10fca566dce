"""The line that heads every results file: the date, the commit and the machine it ran on.

from benchmarks.stamp import stamp
print(stamp() + "  ")
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def commit() -> str:
    """The short hash of HEAD, marked when tracked files differ from it."""
    sha = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return f"{sha} + uncommitted changes" if dirty else sha


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's, else lscpu's (ARM), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        lscpu = []
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu if ln.startswith("Model name")), "")
    return name or platform.processor() or platform.machine()


def gpu() -> str | None:
    """The GPU's name, when the script has imported torch and it sees one (torch is not
    imported here: a script that does not use it is not made to load it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def stamp() -> str:
    """One line: date, commit, machine (CPU, logical CPUs, GPU if any), torch and Python."""
    try:
        torch = f"torch {importlib.metadata.version('torch')}, "
    except importlib.metadata.PackageNotFoundError:
        torch = ""
    card = gpu()
    return (
        f"Date {time.strftime('%Y-%m-%d')}, commit {commit()}, machine: {cpu_model()}, "
        f"{os.cpu_count()} logical CPUs{f', GPU {card}' if card else ''}, "
        f"{torch}Python {platform.python_version()}"
    )
