"""The run: backends, then rounds over every target in turn, then the JSON.

Contract: see the package docstring.  Every child (backends, proxies) is
stopped by PID on success, error or Ctrl-C; the fast backends, the generator
and this process run on CPU 0, the proxy on CPU 1, when both exist.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .. import supervisor
from ..supervisor import Child, ChildError, say
from .measure import combine, combined, measure_target
from .procfs import on_cpu, pin_tree
from .targets import (
    BY_NAME,
    START_TIMEOUT_S,
    WORKERS,
    Ctx,
    availability,
    log_problems,
    start_target,
    version_of,
)
from .workloads import build_requests, path_of
from .wrk import wrk_script

GEN_CPUS, PROXY_CPUS = {0}, {1}
MAX_PROBLEMS = 20  # log lines kept per round


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _backend_url(line: str) -> str | None:
    """The URL in one of the fast backends' JSON lines."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(json.loads(line)["url"])
    return None


async def run(opt: argparse.Namespace, command: str) -> dict[str, Any]:
    names = ["direct"] + [n for n in opt.targets if n != "direct"]
    reasons = availability(opt, names)
    wrk = shutil.which("wrk") is not None
    if opt.generator == "wrk" and not wrk:
        raise ChildError(
            "--generator wrk: wrk is not installed (apt-get install wrk, or --install)"
        )
    use_wrk = wrk and opt.generator != "python"
    if opt.generator == "auto" and not wrk:
        say("wrk is not installed: our Python generator drives the throughput runs")
    cpus = os.sched_getaffinity(0)
    pinned = opt.pin and len(cpus) >= 2 and cpus >= GEN_CPUS | PROXY_CPUS
    if opt.pin and not pinned:
        say(f"not pinning: CPUs {sorted(cpus)} do not include both 0 and 1")
    gen_cpus, proxy_cpus = (GEN_CPUS, PROXY_CPUS) if pinned else (None, None)
    _raise_fd_limit()
    loads: list[float] = []  # 1-minute load average as each target starts
    tmp = Path(tempfile.mkdtemp(prefix="proxybench-"))
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    children: list[Child] = []  # the backends first: stopped last
    ctx: Ctx | None = None
    try:
        with on_cpu(gen_cpus):  # this script is part of the client side
            backend = await supervisor.start(
                children, "fastbackend",
                [sys.executable, "-m", "loadtests.fastbackend",
                 "--count", str(opt.backends), "--events", str(opt.events)],
                log=tmp / "fastbackend.log",
            )  # fmt: skip
            deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
            urls = [
                await backend.wait_line(_backend_url, "addresses", deadline)
                for _ in range(opt.backends)
            ]
            ctx = Ctx(opt, tmp, urls, backend.pid, gen_cpus, proxy_cpus, use_wrk, children)
            for workload in opt.workloads:
                marker = " [[sse:1000:5000]]" if workload == "d" else ""
                ctx.requests[workload] = build_requests(workload, opt.keys, marker)
                if workload != "d" and use_wrk:
                    script = tmp / f"workload-{workload}.lua"
                    script.write_text(wrk_script(path_of(workload), ctx.requests[workload]))
                    ctx.scripts[workload] = script
            # The (b) probe's streams start 2 ms after their head, as after a short prefill.
            ctx.requests["b-probe"] = build_requests("b", opt.keys, f" [[sse:{opt.events}:0:2]]")
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
            problems: dict[str, list[str]] = {}  # prefix-router target -> log lines
            versions: dict[str, str] = {}
            for name in names:
                if reasons.get(name):
                    skipped[name] = str(reasons[name])
                    say(f"{BY_NAME[name].label}: skipped: {skipped[name]}")
            for round_ in range(1, opt.rounds + 1):
                last = round_ == opt.rounds
                for name in names:
                    if name in skipped:
                        continue
                    target = BY_NAME[name]
                    loads.append(os.getloadavg()[0])
                    say(
                        f"{target.label}: starting (round {round_} of {opt.rounds}; "
                        f"load average {loads[-1]:.2f})"
                    )
                    try:
                        running = await start_target(ctx, target)
                    except (ChildError, OSError, RuntimeError, TimeoutError) as exc:
                        skipped[name] = f"could not start: {exc}"
                        say(f"{target.label}: skipped: {skipped[name]}")
                        continue
                    try:
                        if running.pid:
                            pin_tree(running.pid, proxy_cpus)
                        rows = await measure_target(ctx, target, running, last)
                    finally:
                        code = await running.stop()
                    versions[name] = running.version
                    if name in WORKERS:  # its log, this round's: what went wrong under load
                        found = problems.setdefault(name, [])
                        if code not in (0, None):
                            found.append(f"round {round_}: exit status {code} on SIGTERM")
                        lines = log_problems(tmp / f"{name}.log")
                        found += [f"round {round_}: {line[:300]}" for line in lines[:MAX_PROBLEMS]]
                        if len(lines) > MAX_PROBLEMS:
                            found.append(f"round {round_}: ... {len(lines)} lines in all")
                    for workload, row in rows.items():
                        runs.setdefault(name, {}).setdefault(workload, []).append(row)
                    if name == "direct" and "a" in runs["direct"]:
                        rps = combine(runs["direct"]["a"]).get("rps") or 0
                        ctx.probe_rate = round(rps * opt.probe_fraction) or None
            for name, by_workload in runs.items():
                if name in skipped:
                    continue
                target = BY_NAME[name]
                results[name] = {
                    "label": target.label, "kind": target.kind, "key": target.key,
                    "version": versions[name],
                    **({"log_problems": problems.get(name, [])} if name in WORKERS else {}),
                    "workloads": {w: combined(rows) for w, rows in by_workload.items()},
                }  # fmt: skip
    finally:
        for child in reversed(children):
            await child.stop()
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}",
        "pinning": "generator, backends and this script on CPU 0; proxy on CPU 1"
        if pinned
        else "none",
        "generator": f"wrk -t1 -c{opt.connections} ({await version_of(['wrk', '-v'])})"
        if use_wrk
        else f"Python closed loop, {opt.connections} connections",
        "seconds": f"{opt.seconds:g} s per run, {opt.warmup:g} s warm-up before each; "
        f"{opt.rounds} rounds over every target in turn, medians (the (d) run and the "
        "probes in the last round only)",
        "probes": f"(a) paced at {opt.probe_rate:g} req/s and at "
        f"{ctx.probe_rate if ctx else None} req/s ({opt.probe_fraction:.0%} of direct's (a)); "
        f"skipped where a target's closed-loop rate is under 1.25 x the probe's; (b) TTFB, "
        f"closed loop on {opt.ttfb_connections} connections; {opt.probe_seconds:g} s each",
        "backends": f"{opt.backends} x loadtests.fastbackend in one process, "
        f"{opt.events} SSE chunks per stream",
        "keys": opt.keys,
        "streams": opt.streams,
        "workloads": opt.workloads,
        "load_average": _loads(loads),
        "logs": str(tmp),
    }
    return {"meta": meta, "skipped": skipped, "results": results}


def _loads(loads: list[float]) -> str:
    if not loads:
        return "?"
    low, mid, high = min(loads), statistics.median(loads), max(loads)
    return (
        f"1-minute load average as each target started: median {mid:.2f}, "
        f"{low:.2f}-{high:.2f} ({os.cpu_count()} CPUs)"
    )


def write_json(directory: Path, doc: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"proxybench-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2))
    return path
