"""The package's docstrings and comments say why the code is as it is; how fast it runs lives
in the benchmark results, which are rerun as the code changes. A timing or a pointer into the
results inside the package would go stale without any test noticing."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vapo_lightning"
FILES = sorted(PACKAGE.rglob("*.py"))

MEASUREMENT = re.compile(
    r"benchmarks/(?:results|probes)/"  # a pointer into the results or the probes
    r"|(?<![\w/])results/\w+\.md"  # the same, written from inside benchmarks/
    r"|\d+(?:\.\d+)? ?(?:ms|µs)\b"  # a timing in milliseconds or microseconds
)


def measurements(text: str) -> list[str]:
    return [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in MEASUREMENT.finditer(text)]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_measurements_in_the_package(path):
    hits = measurements(path.read_text())
    assert not hits, f"{path.relative_to(ROOT)} quotes measurements (they belong in benchmarks/results/): {hits}"


def test_the_check_finds_them():
    assert measurements("x = 1\n# took 0.12 ms (see benchmarks/results/sandbox.md)\n") == [
        "2: 0.12 ms",
        "2: benchmarks/results/",
    ]
    assert measurements("42.8ms, 3 µs, results/gpu.md, benchmarks/probes/probe.py") == [
        "1: 42.8ms",
        "1: 3 µs",
        "1: results/gpu.md",
        "1: benchmarks/probes/",
    ]
    assert measurements("timeout_ms = 5; f'{t:.1f} ms'; items; 8 MiB stack") == []
