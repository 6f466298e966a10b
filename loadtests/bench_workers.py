"""``python -m loadtests.bench_workers``: live routing figures at ``serve --workers N``.

    python -m loadtests.bench_workers --workers 1,2 --repeat 2 -- \\
        --workload long --instances 7 --strategies prefix,prefix-traffic-prefill \\
        --duration 60 --time-scale 0.2

Contract:
- Everything after ``--`` is ``loadtests.bench``'s own command line; this
  driver runs bench's targets over one simulated fleet and one seeded request
  list, each prefix-router target once per worker count (``--workers``), the
  counts of one target back to back so that they share the machine's load;
  ``--repeat K`` goes over all of it K times (the worker order reversed on
  every other pass, so neither count always runs first).
- The only change to bench's target is ``--workers N`` on the ``serve``
  command line (bench's ``start_router`` is wrapped for the call; nothing of
  bench is edited).  Each (pass, N) writes its access logs to a folder of its
  own, so the decisions joined from them are that run's.
- Output: bench's table of every run, then per target and pass the figures
  at N workers against 1 worker of the same pass (hit rate in points, P90
  TTFT as a ratio, the busiest instance's share in points), the 1-minute
  load average before and after each run, and any ``serve`` log line at
  warning level or above (or not JSON); ``results.json`` in ``--out``.
- Peers (``sglang``, ``vllm``) have no workers: refused.  Every process is
  bench's, stopped by PID as bench stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import bench
from .fleet import Child, FleetError, say, start_sims, stop_checked
from .report import Run, markdown, summarize, write_json
from .workloads import FLEET, build

__all__ = ["main"]

PROBLEM_LEVELS = ("warning", "error", "critical")


def problems(lines: list[str]) -> list[str]:
    """The log lines at warning level or above, or not JSON (a traceback, lines run together)."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        if not isinstance(event, dict) or event.get("level") in PROBLEM_LEVELS:
            out.append(line)
    return out


async def run_with_workers(
    key: str,
    workers: int,
    requests: list[Any],
    args: argparse.Namespace,
    sims: dict[str, str],
    children: list[Child],
    out: Path,
) -> tuple[Run | None, list[str]]:
    """bench's ``run_target`` with ``--workers N`` on serve's command line; its log problems."""
    started: list[Child] = []
    original = bench.start_router  # type: ignore[attr-defined]

    async def start_router(
        children: list[Child],
        sims: dict[str, str],
        *flags: str,
        label: str = "router",
        tree: Path | None = None,
    ) -> tuple[Child, str, str]:
        found = await original(
            children, sims, *flags, "--workers", str(workers), label=label, tree=tree
        )
        started.append(found[0])
        return found

    run_target: Any = bench.run_target  # its signature changes with bench --replicas
    bench.start_router = start_router  # type: ignore[attr-defined]
    try:
        if "replicas" in inspect.signature(run_target).parameters:
            run = await run_target(key, 1, requests, args, sims, children, out)
        else:
            run = await run_target(key, requests, args, sims, children, out)
    finally:
        bench.start_router = original  # type: ignore[attr-defined]
    lines = [line for child in started for line in child.tail]
    return run, problems(lines)


def compare(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """N workers against 1: hit rate and busiest share in points, P90 TTFT as a ratio."""

    def points(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(100 * (b - a), 1)

    p90 = (
        round(many["ttft_p90"] / one["ttft_p90"], 2)
        if one.get("ttft_p90") and many.get("ttft_p90") is not None
        else None
    )
    return {
        "hit_points": points(one["hit_rate"], many["hit_rate"]),
        "p90_ratio": p90,
        "busiest_points": points(one["max_share"], many["max_share"]),
    }


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _signed(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:+.1f}{unit}"


def comparison_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| target | pass | workers | hit rate | Δ hit (points) | TTFT P90 s | P90 x 1 worker "
        "| busiest share | Δ busiest (points) | errors | load avg before → after |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s, vs = r["summary"], r.get("vs_one", {})
        ratio = vs.get("p90_ratio")
        lines.append(
            f"| {r['label']} | {r['pass']} | {r['workers']} | {_pct(s['hit_rate'])} "
            f"| {_signed(vs.get('hit_points'))} | {_s(s['ttft_p90'])} "
            f"| {'—' if ratio is None else f'{ratio:.2f}x'} | {_pct(s['max_share'])} "
            f"| {_signed(vs.get('busiest_points'))} | {s['requests'] - s['ok']} "
            f"| {r['load'][0]:.2f} → {r['load'][1]:.2f} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace, workers: list[int], repeat: int) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    children: list[Child] = []
    out: Path = args.out  # made by main, with a folder per (pass, workers)
    params = FLEET[args.workload]
    rate = args.rate or params.rate_for(args.instances)
    model_seconds = args.duration / args.time_scale
    requests = build(args.workload, seed=args.seed, duration=model_seconds, rate=rate)
    say(
        f"workload {args.workload}: {len(requests)} requests over {model_seconds:.0f} model s "
        f"({args.duration:.0f} s wall per run), {rate} requests/s, seed {args.seed}; "
        f"workers {','.join(map(str, workers))}, {repeat} pass(es)"
    )
    runs: list[Run] = []
    rows: list[dict[str, Any]] = []
    try:
        flags = [*params.sim_args(), "--time-scale", str(args.time_scale)]
        fleet, sims = await start_sims(children, args.instances, *flags)
        say(f"fleet: {args.instances} instances, pid {fleet.pid}")
        for pass_ in range(1, repeat + 1):
            order = workers if pass_ % 2 else list(reversed(workers))
            for key in args.strategies:
                for n in order:
                    before = os.getloadavg()[0]
                    where = out / f"pass{pass_}-w{n}"
                    run, found = await run_with_workers(
                        key, n, requests, args, sims, children, where
                    )
                    if run is None or not run.samples:
                        continue
                    run.target = f"{run.target}, {n} worker{'s' if n > 1 else ''} (pass {pass_})"
                    runs.append(run)
                    summary = summarize(run)
                    rows.append({
                        "label": bench.OURS[key][0], "key": key, "pass": pass_, "workers": n,
                        "summary": summary, "load": [before, os.getloadavg()[0]],
                        "log_problems": found,
                    })  # fmt: skip
                    say(
                        f"  {run.target}: hit {_pct(summary['hit_rate'])}, P90 TTFT "
                        f"{_s(summary['ttft_p90'])} s, busiest {_pct(summary['max_share'])}"
                    )
        await stop_checked(fleet)
    except asyncio.CancelledError:
        say("interrupted")
        return 130
    finally:
        for child in reversed(children):
            if child.proc.returncode is None:
                await child.stop()
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["key"] == row["key"] and r["pass"] == row["pass"] and r["workers"] == 1
            ),
            None,
        )
        if base is not None and row is not base:
            row["vs_one"] = compare(base["summary"], row["summary"])
    table = markdown(runs, baseline="")
    say("\n" + table)
    say("N workers against 1 worker of the same pass:\n")
    say(comparison_table(rows))
    say("\nserve log lines at warning level or above, or not JSON:")
    for row in rows:
        found = row["log_problems"]
        say(f"- {row['label']}, {row['workers']} worker(s), pass {row['pass']}: "
            + ("none" if not found else f"{len(found)}"))  # fmt: skip
        for line in found[:10]:
            say(f"  - `{line[:300]}`")
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m loadtests.bench_workers", *sys.argv[1:]]),
        "workload": args.workload,
        "instances": args.instances,
        "seed": args.seed,
        "rate": rate,
        "time_scale": args.time_scale,
        "model_seconds": model_seconds,
        "workers": workers,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "comparison": [{k: v for k, v in r.items() if k != "summary"} for r in rows],
    }
    write_json(runs, out / "results.json", meta=meta)
    (out / "results.md").write_text(table + "\n" + comparison_table(rows) + "\n")
    say(f"results: {out}")
    return 0


def parse_args(argv: list[str]) -> tuple[list[int], int, argparse.Namespace]:
    ours, theirs = _split(argv)
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench_workers",
        description="loadtests.bench's prefix-router targets at several --workers counts,"
        " over one fleet; bench's own options after --.",
    )
    p.add_argument("--workers", default="1,2", help="worker counts, 1 first (1,2)")
    p.add_argument("--repeat", type=int, default=1, help="passes over every run (1)")
    opt = p.parse_args(ours)
    try:
        workers = [int(n) for n in opt.workers.split(",")]
    except ValueError:
        workers = []
    if not workers or min(workers) < 1 or len(set(workers)) < len(workers) or 1 not in workers:
        p.error("--workers must be distinct counts >= 1 including 1, e.g. 1,2")
    if not 1 <= opt.repeat <= 10:
        p.error("--repeat must be 1 to 10")
    args = bench.parse_args(theirs)
    peers = [key for key in args.strategies if key not in bench.OURS]
    if peers:
        p.error(f"peers have no workers: {', '.join(peers)}")
    return workers, opt.repeat, args


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(ours, bench's): bench's options come after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    workers, repeat, args = parse_args(sys.argv[1:] if argv is None else argv)
    for pass_ in range(1, repeat + 1):
        for n in workers:
            (args.out / f"pass{pass_}-w{n}").mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(main_async(args, workers, repeat))
    except FleetError as exc:
        print(f"bench_workers: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
