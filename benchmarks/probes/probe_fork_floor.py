"""The floor under a sandboxed run: fork + exit of a process the size of the warm server.

Imports what the server imports (its PRELOAD list, which brings in `layers`, `runner`,
`isolation`, `zygote`, `protocol` and `seccomp_filter`), freezes the GC as the server does,
then forks `--n` children back to back, each exiting at once (`os._exit`), or after one small
`json.loads` (the first Python work any sandbox does). Prints per fork: wall,
the parent's and the children's CPU, and minor (copy-on-write) faults on each side. Nothing
here sets up a namespace, a mount or Landlock: whatever a real run costs above this is theirs
and the Python around them (`benchmarks/results/sandbox_cpu.md`).

    .venv/bin/python -I -S -B benchmarks/probes/probe_fork_floor.py [--n 2000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time

SANDBOX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "vapo_lightning", "sandbox")
sys.path.insert(0, SANDBOX)  # imported as the server imports them (a script, `-I -S`)

import layers  # noqa: E402, F401
import runner  # noqa: E402, F401
import server  # noqa: E402


def usage() -> tuple[float, float, int, int]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, me.ru_minflt, kids.ru_minflt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    n = ap.parse_args().n
    for name in server.PRELOAD:
        __import__(name)
    gc.freeze()
    print("| child does | wall ms | parent CPU ms | child CPU ms | parent faults | child faults |")
    print("|---|---|---|---|---|---|")
    for label, work in (("nothing", False), ("one small json.loads", True)):
        before, start = usage(), time.perf_counter()
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                if work:
                    json.loads('{"code": "def f():\\n    return 1\\n", "inputs": ["[]"]}')
                os._exit(0)
            os.waitpid(pid, 0)
        wall, after = time.perf_counter() - start, usage()
        d = [(a - b) / n for a, b in zip(after, before)]
        print(f"| {label} | {wall / n * 1e3:.3f} | {d[0] * 1e3:.3f} | {d[1] * 1e3:.3f} | {d[2]:.0f} | {d[3]:.0f} |")
    # imported after the forks, so that they are timed at the server's size
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from benchmarks.stamp import stamp

    print(f"\n{stamp()}")


if __name__ == "__main__":
    main()
