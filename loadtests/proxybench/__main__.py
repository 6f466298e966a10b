"""``python -m loadtests.proxybench [report FILE | floor ...] [options]``: see the package."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from ..supervisor import ROOT, ChildError, say
from .floor import floor, runner
from .report import report
from .run import run, write_json
from .targets import TARGETS
from .workloads import WORKLOADS


def _list(choices: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = choices if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (or all)")
        return items

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.proxybench",
        description="The proxy ladder: direct, HAProxy, nginx, sglang-router, vllm-router, "
        "an aiohttp floor and prefix-router in front of the same fast backends.",
    )
    p.add_argument(
        "--targets",
        type=_list([t.name for t in TARGETS]),
        default="all",
        help=f"comma-separated, from: {', '.join(t.name for t in TARGETS)} (all)",
    )
    p.add_argument(
        "--workloads",
        type=_list(list(WORKLOADS)),
        default="all",
        help="comma-separated from a,b,c,d (all)",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="measured run per workload (5)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all targets; figures are medians over rounds (3)",
    )
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured run before it (2)")
    p.add_argument("--probe-seconds", type=float, default=5.0, help="each latency probe (5)")
    p.add_argument(
        "--pause",
        type=float,
        default=0.5,
        help="idle after each workload, for the proxy to settle (0.5; the tests' smoke run: 0)",
    )
    p.add_argument(
        "--probe-rate",
        type=float,
        default=1000.0,
        help="(a) probe at this fixed rate, req/s (1000; 0: none)",
    )
    p.add_argument(
        "--probe-fraction",
        type=float,
        default=0.25,
        help="(a) and also at this share of direct's (a) req/s (0.25; 0: none)",
    )
    p.add_argument(
        "--ttfb-connections",
        type=int,
        default=2,
        help="(b) TTFB probe: closed loop on this many connections (2; 0: none)",
    )
    p.add_argument("--connections", type=int, default=32, help="throughput connections (32)")
    p.add_argument("--streams", type=int, default=2000, help="(d) idle streams (2000)")
    p.add_argument("--keys", type=int, default=64, help="distinct prompts cycled (64)")
    p.add_argument("--backends", type=int, default=2, help="fast backends (2)")
    p.add_argument("--events", type=int, default=64, help="SSE chunks per (b) stream (64)")
    p.add_argument(
        "--generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="throughput load generator: wrk if installed (auto), or ours",
    )
    p.add_argument(
        "--install",
        action="store_true",
        help="apt-get install wrk/haproxy/nginx and pip the peers if missing",
    )
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-peers", help="the peers' venv")
    p.add_argument("--results", type=Path, default=ROOT / "results", help="JSON goes here")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin CPUs")
    opt = p.parse_args(argv)  # fmt: skip
    if min(opt.warmup, opt.probe_seconds, opt.pause) < 0:
        p.error("--warmup, --probe-seconds and --pause must be >= 0")
    if opt.seconds <= 0 or opt.connections < 1:
        p.error("--seconds must be > 0, --connections >= 1")
    if min(opt.keys, opt.backends, opt.streams, opt.events, opt.rounds) < 1:
        p.error("--keys, --backends, --streams, --events and --rounds must be >= 1")
    return opt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        p = argparse.ArgumentParser(prog="proxybench report", description="Print a saved run.")
        p.add_argument("json", type=Path, help="a results/proxybench-*.json file")
        say(report(json.loads(p.parse_args(argv[1:]).json.read_text())))
        return 0
    if argv[:1] == ["floor"]:
        p = argparse.ArgumentParser(prog="proxybench floor", description=floor.__doc__)
        p.add_argument("--listen", required=True, help="HOST:PORT")
        p.add_argument("--backend", action="append", required=True, help="http://HOST:PORT")
        args = p.parse_args(argv[1:])
        floor(args.listen, [u.rstrip("/") for u in args.backend])
        return 0
    opt = parse_args(argv)
    command = " ".join(["python", "-m", "loadtests.proxybench", *argv])
    try:
        doc = runner()(run(opt, command))
    except ChildError as exc:
        print(f"proxybench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("proxybench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    path = write_json(opt.results, doc)
    say("")
    say(report(doc))
    say("")
    say(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
