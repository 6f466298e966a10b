"""Slow start in a live scale event: the minute after an add, with and without.

Contract:
- One ``loadtests.bench`` run (a subprocess: the same routers, fleet, client
  and requests for both rows, caches reset between them) with two targets of
  the same routing setting, the second one with ``--slow-start`` (given in
  model seconds: the router's clock is the wall's, so it gets the window
  times ``--time-scale``), and
  ``--scale-event add@AT``: the fleet's last instance joins at model second
  AT.  ``--mode default`` compares two TRAFFIC + PREFILL targets (``prefix``
  and ``prefix-traffic-prefill``: both the default setting), ``--mode
  sagemaker`` two with SageMaker's semantics (IN_FLIGHT, where the ring alone
  decides, so an add moves ~1/(n+1) of the keys at once).
- Printed, per row, over the ``--after`` model seconds after the add: TTFT
  P50 and P99 (nearest rank) of all requests, the newcomer's request count
  and TTFT P99, the fleet's hit rate (the mean of the bench's windowed
  series from the instances' counters), and the ratios slow start / without;
  the load average before and after.  ``--report-only`` reports a saved run.
  The hit-rate curve of both rows around the add (the bench's windowed
  series) is drawn to ``--figure``
  (``loadtests/figures/long-slowstart.png`` by default).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from router.metrics import percentile

from .report import Run, read_json

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {
    # (without, with slow start), both the same routing setting.
    "default": ("prefix", "prefix-traffic-prefill", []),
    "sagemaker": (
        "prefix",
        "prefix-sagemaker",
        ["--serve-arg=--balance-mode=IN_FLIGHT", "--serve-arg=--concurrency-scope=IN_FLIGHT"],
    ),
}


def window(run: Run, start: float, length: float, instance: str | None = None) -> dict[str, float]:
    samples = [
        s
        for s in run.samples
        if start <= s.at < start + length and s.ok and (instance is None or s.instance == instance)
    ]
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    # The fleet's hit rate: the bench's windowed series of the instances' counters.
    rates = [r for t, r in run.hit_rate_series if start <= t < start + length]
    return {
        "requests": len(samples),
        "p50": percentile(ttfts, 0.5) or float("nan"),
        "p99": percentile(ttfts, 0.99) or float("nan"),
        "hit": sum(rates) / len(rates) if rates and instance is None else float("nan"),
    }


def draw(runs: list[Run], labels: list[str], at: float, after: float, path: Path) -> Path:
    from matplotlib.figure import Figure

    from .figstyle import save

    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.add_subplot()
    colours = ("#999999", "#0072B2")
    for run, label, colour in zip(runs, labels, colours, strict=True):
        points = [(t, r) for t, r in run.hit_rate_series if at - 60 <= t <= at + after + 30]
        xs, ys = [t - at for t, _ in points], [100 * r for _, r in points]
        ax.plot(xs, ys, label=label, color=colour)
    ax.axvline(0, color="#444444", linewidth=0.8, linestyle=":")
    ax.set_xlabel("model seconds since the add")
    ax.set_ylabel("prefix-cache hit rate, %")
    ax.grid(True, color="#dddddd")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_slowstart", description=__doc__)
    p.add_argument("--workload", default="long")
    p.add_argument("--instances", type=int, default=7)
    p.add_argument("--mode", choices=sorted(PAIRS), default="default")
    p.add_argument(
        "--slow-start",
        type=float,
        default=60.0,
        help="window, model s (the router gets it times --time-scale: its clock is wall)",
    )
    p.add_argument("--at", type=float, default=240.0, help="model second of the add")
    p.add_argument("--after", type=float, default=60.0, help="model seconds measured after it")
    p.add_argument("--time-scale", type=float, default=0.2)
    p.add_argument("--duration", type=float, help="wall s per row (default: to at + after + 20)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "slowstart")
    p.add_argument("--report-only", action="store_true", help="no run: report --out's")
    p.add_argument("--figure", type=Path, default=ROOT / "loadtests/figures/long-slowstart.png")
    args = p.parse_args(argv)
    without, with_slow, extra = PAIRS[args.mode]
    duration = args.duration or (args.at + args.after + 20) * args.time_scale
    command = [
        sys.executable, "-m", "loadtests.bench", "--workload", args.workload,
        "--instances", str(args.instances), "--strategies", f"{without},{with_slow}",
        "--duration", str(duration), "--time-scale", str(args.time_scale),
        "--scale-event", f"add@{args.at:g}", "--out", str(args.out), *extra,
        f"--serve-arg={with_slow}:--slow-start={args.slow_start * args.time_scale:g}s",
    ]  # fmt: skip
    load_before = os.getloadavg()
    if args.report_only:  # the tables and figure again from --out's results.json
        load_before = load_after = (float("nan"),) * 3
    else:
        print("$ " + " ".join(command[1:]), flush=True)
        subprocess.run(command, cwd=ROOT, check=True)
        load_after = os.getloadavg()
    runs, _ = read_json(args.out / "results.json")
    if len(runs) != 2:
        print(f"expected 2 runs, got {len(runs)}", file=sys.stderr)
        return 1
    newcomer = f"sim-{args.instances - 1}"
    labels = ["without", f"slow start {args.slow_start:g} model s"]
    print(
        f"\n{args.mode}: the {args.after:g} model s after the add at {args.at:g} "
        f"(newcomer {newcomer}); TTFT in model ms\n"
    )
    print("| row | requests | TTFT P50 | TTFT P99 | fleet hit rate | newcomer: requests | P99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    figures = []
    for run, label in zip(runs, labels, strict=True):
        every = window(run, args.at, args.after)
        new = window(run, args.at, args.after, newcomer)
        figures.append((every, new))
        print(
            f"| {label} | {every['requests']:.0f} | {1000 * every['p50']:.1f} | "
            f"{1000 * every['p99']:.1f} | {100 * every['hit']:.1f} % | {new['requests']:.0f} | "
            f"{1000 * new['p99']:.1f} |"
        )
    (every0, new0), (every1, new1) = figures
    print(
        f"\nratio slow start / without: TTFT P99 {every1['p99'] / every0['p99']:.2f}, "
        f"P50 {every1['p50'] / every0['p50']:.2f}, newcomer's requests "
        f"{new1['requests'] / max(1, new0['requests']):.2f}, hit rate "
        f"{100 * (every1['hit'] - every0['hit']):+.1f} points"
    )
    print(
        "load average before / after: "
        + " / ".join(", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    )
    print(f"figure: {draw(runs, labels, args.at, args.after, args.figure)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
