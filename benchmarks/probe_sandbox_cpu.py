"""Where a sandboxed run's CPU goes: the host (client), the warm server, the sandbox processes
the server reaps, and kernel threads (deferred namespace teardown), per trivial run.

One pool of one server, `--runs` runs of `def f(): return 1` one after the other (after 20
warm-up runs). Machine CPU is /proc/stat's busy time (user + nice + system + irq + softirq);
the server's own and its reaped children's times and minor faults come from
/proc/<server>/stat; kernel threads are every kworker / ksoftirqd / rcu thread's CPU time.
Issue 5's HumanEval ratio is CPU-bound on a 2-core machine, so this is what bounds it.

    .venv/bin/python benchmarks/probe_sandbox_cpu.py [--runs 400]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vapo_lightning.sandbox import Pool

TICK = os.sysconf("SC_CLK_TCK")
KERNEL_THREADS = ("kworker", "ksoftirqd", "rcu")


def machine_busy_s() -> float:
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6)) / TICK


def proc_stat(pid: int | str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def own_and_children_s(pid: int) -> tuple[float, float]:
    f = proc_stat(pid)
    return (int(f[11]) + int(f[12])) / TICK, (int(f[13]) + int(f[14])) / TICK


def faults(pid: int) -> tuple[int, int]:
    f = proc_stat(pid)
    return int(f[7]), int(f[8])  # minflt, cminflt


def kernel_threads_s() -> float:
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith(KERNEL_THREADS):
                total += sum(own_and_children_s(int(pid)))
        except OSError:  # gone meanwhile
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    n = ap.parse_args().runs
    code, tests = "def f():\n    return 1\n", [{"input": [], "output": 1}]
    pool = Pool(1)
    try:
        server = pool.servers[0].proc.pid
        for _ in range(20):
            pool.evaluate(code, tests, "f")
        before = (machine_busy_s(), resource.getrusage(resource.RUSAGE_SELF),
                  own_and_children_s(server), kernel_threads_s(), faults(server))  # fmt: skip
        start = time.perf_counter()
        for _ in range(n):
            pool.evaluate(code, tests, "f")
        wall = time.perf_counter() - start
        after = (machine_busy_s(), resource.getrusage(resource.RUSAGE_SELF),
                 own_and_children_s(server), kernel_threads_s(), faults(server))  # fmt: skip
    finally:
        pool.close()

    def ms(x: float) -> str:
        return f"{1000 * x / n:.2f}"

    client = lambda r: r.ru_utime + r.ru_stime  # noqa: E731
    print("| per trivial run | wall | machine CPU | client | server | sandboxes (reaped) | kernel threads |")
    print("|---|---|---|---|---|---|---|")
    print(f"| ms | {ms(wall)} | {ms(after[0] - before[0])} | {ms(client(after[1]) - client(before[1]))} | "
          f"{ms(after[2][0] - before[2][0])} | {ms(after[2][1] - before[2][1])} | {ms(after[3] - before[3])} |")  # fmt: skip
    print(f"\nminor faults per run: server {(after[4][0] - before[4][0]) / n:.0f}, "
          f"sandboxes {(after[4][1] - before[4][1]) / n:.0f}")


if __name__ == "__main__":
    main()
