"""A handover at the bound: does the new process count the old one's long streams?

    python -m loadtests.bench_handover_loads [--before PATH] [--tree PATH] [--rounds 3]

Contract:
- One simulated fleet (3 instances, each running ``--engine-slots`` requests
  at once, FIFO past that) and, per round and tree, a router of that tree
  (``--tree``, default this one; ``--before``, optional, the one to compare
  with) at ``--concurrency-threshold`` T, ``--balance-mode IN_FLIGHT
  --concurrency-scope IN_FLIGHT`` and a ``--handover-socket``.  ``--clients``
  closed-loop clients (default 3 T: every instance at its bound when the
  router keeps it there) each send a streamed chat completion about one of
  ``--documents`` documents (``bench_restart.DOCUMENTS``) on a fresh
  connection, then (after ``--think-ms``) the next; each stream lasts ``--stream-s`` seconds
  (max_tokens drawn, seeded, so the ends spread).  After ``--warmup-s`` a new
  router of the same tree starts with the same socket and takes over; the
  load goes on until the old one has drained and exited.
- Measured per request, from the instances' own headers: which instance
  served it and how many requests that instance had as it arrived, itself
  included (``x-sim-in-flight``, counted by the engine: running or waiting);
  client side, the time to the first body byte.  The drain is from the new
  router's first ``listening`` line to the old one's exit; a request belongs
  to it if sent then.  Per round: the peak in flight on any instance during
  the drain (and per instance), how many drain requests arrived at an
  instance already at T or more, their TTFT P50/P90 (nearest rank), the same
  peak in the second half of the warm-up (the bound held before the
  handover?), the drain's length and the failed requests.
- At the end, medians over the rounds per tree, and with ``--before`` a
  Markdown table: before, after, after/before.  ``--json PATH`` writes every
  round's figures.  Rounds alternate the trees.  Bounded: every wait under a
  deadline; only processes it started are stopped, by PID; all on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from router.metrics import percentile

from .bench_restart import DOCUMENTS, MODEL
from .fleet import ROOT, Child, start_router, start_sims, stop_checked
from .supervisor import free_port

__all__ = ["main", "summarise"]

EXIT_WAIT_S = 60.0
SECONDS_PER_TOKEN = 0.025  # the simulator's decode time per token, model seconds (Timing)


@dataclass
class Sample:
    sent: float
    instance: str = ""
    arrived_with: int = 0  # x-sim-in-flight
    ttft: float | None = None
    ok: bool = False


@dataclass
class Load:
    samples: list[Sample] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def client(url: str, i: int, load: Load, args: argparse.Namespace) -> None:
    rng = random.Random(i)
    tokens = args.stream_s / (SECONDS_PER_TOKEN * args.time_scale)
    timeout = aiohttp.ClientTimeout(total=args.stream_s * 10 + 30)
    connector = aiohttp.TCPConnector(force_close=True)  # a fresh connection each: no old process
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        n = 0
        while not load.stop.is_set():
            n += 1
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": DOCUMENTS[(i + n) % args.documents]},
                    {"role": "user", "content": f"client {i}, question {n}"},
                ],
                "max_tokens": max(1, round(tokens * rng.uniform(0.5, 1.5))),
                "stream": True,
            }
            sample = Sample(time.monotonic())
            load.samples.append(sample)
            try:
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    sample.instance = resp.headers.get("x-sim-instance", "")
                    sample.arrived_with = int(resp.headers.get("x-sim-in-flight", "0"))
                    async for _ in resp.content.iter_any():
                        if sample.ttft is None:
                            sample.ttft = time.monotonic() - sample.sent
                sample.ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            # A client's retry backoff, or its think time: not synchronisation.
            await asyncio.sleep(args.think_ms / 1000 if sample.ok else 0.05)


def summarise(
    samples: list[Sample], threshold: int, warm: tuple[float, float], drain: tuple[float, float]
) -> dict[str, object]:
    """One round's figures from its samples (sent in ``warm`` or ``drain``, monotonic)."""
    during = [s for s in samples if drain[0] <= s.sent < drain[1]]
    before = [s for s in samples if warm[0] <= s.sent < warm[1] and s.ok]
    served = [s for s in during if s.ok]
    peaks: dict[str, int] = {}
    for s in served:
        peaks[s.instance] = max(peaks.get(s.instance, 0), s.arrived_with)
    ttfts = [s.ttft for s in served if s.ttft is not None]
    p50, p90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
    return {
        "drain_s": drain[1] - drain[0],
        "drain_requests": len(during),
        "failed": sum(not s.ok for s in during),
        "peak": max(peaks.values(), default=0),
        "peaks": dict(sorted(peaks.items())),
        "warm_peak": max((s.arrived_with for s in before), default=0),
        "past_bound": sum(s.arrived_with > threshold for s in served),
        "ttft_p50_ms": None if p50 is None else p50 * 1000,
        "ttft_p90_ms": None if p90 is None else p90 * 1000,
    }


async def one_round(
    tree: Path, sims: dict[str, str], args: argparse.Namespace, workdir: Path
) -> dict[str, object]:
    port = free_port()
    flags = [
        "--listen", f"127.0.0.1:{port}", "--access-log", "off", "--strategy", "prefix",
        "--concurrency-threshold", str(args.threshold), "--balance-mode", "IN_FLIGHT",
        "--concurrency-scope", "IN_FLIGHT", "--handover-socket", str(workdir / f"{port}.sock"),
    ]  # fmt: skip
    children: list[Child] = []
    load = Load()
    try:
        old, _, _ = await start_router(children, sims, *flags, tree=tree, label="old router")
        url = f"http://127.0.0.1:{port}"
        clients = [asyncio.create_task(client(url, i, load, args)) for i in range(args.clients)]
        began = time.monotonic()
        await asyncio.sleep(args.warmup_s)  # load before the handover (a bounded run)
        warm = (began + args.warmup_s / 2, time.monotonic())
        new, _, _ = await start_router(children, sims, *flags, tree=tree, label="new router")
        taken = time.monotonic()
        async with asyncio.timeout(EXIT_WAIT_S):
            await old.proc.wait()
        drained = time.monotonic()
        load.stop.set()
        async with asyncio.timeout(EXIT_WAIT_S):
            await asyncio.gather(*clients)
        await stop_checked(new)
    finally:
        load.stop.set()
        for child in children:
            await child.stop()
    result = summarise(load.samples, args.threshold, warm, (taken, drained))
    return {"tree": str(tree), "old_exit": old.returncode, **result}


def show(label: str, r: dict[str, object]) -> None:
    def ms(v: object) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    print(
        f"{label:6} drain {r['drain_s']:.1f} s, {r['drain_requests']} requests"
        f" ({r['failed']} failed); peak in flight {r['peak']} {r['peaks']}"
        f" (warm-up {r['warm_peak']}); {r['past_bound']} past the bound;"
        f" TTFT P50 {ms(r['ttft_p50_ms'])}, P90 {ms(r['ttft_p90_ms'])}; old exit {r['old_exit']}",
        flush=True,
    )


ROWS = [
    ("peak in flight on an instance, drain", "peak"),
    ("peak in flight on an instance, warm-up", "warm_peak"),
    ("drain requests that arrived at an instance already at T", "past_bound"),
    ("drain requests", "drain_requests"),
    ("TTFT P50 of drain requests (ms)", "ttft_p50_ms"),
    ("TTFT P90 of drain requests (ms)", "ttft_p90_ms"),
    ("drain (s)", "drain_s"),
    ("failed requests in the drain", "failed"),
]


def medians(results: list[dict[str, object]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for _, key in ROWS:
        values = [float(v) for r in results if isinstance(v := r[key], int | float)]
        out[key] = statistics.median(values) if values else None
    return out


def table(before: dict[str, float | None], after: dict[str, float | None]) -> str:
    lines = ["| median over rounds | before | after | after/before |", "|---|---:|---:|---:|"]
    for label, key in ROWS:
        b, a = before[key], after[key]
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        cells = ["-" if v is None else f"{v:.1f}".removesuffix(".0") for v in (b, a)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace, argv: list[str]) -> int:
    trees = {"after": args.tree.resolve()}
    if args.before is not None:
        trees = {"before": args.before.resolve(), **trees}
    children: list[Child] = []
    results: dict[str, list[dict[str, object]]] = {label: [] for label in trees}
    try:
        _, sims = await start_sims(
            children, 3, "--time-scale", str(args.time_scale),
            "--max-num-seqs", str(args.engine_slots), "--max-tokens-cap", "100000",
        )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="bench-handover-loads-") as workdir:
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    result = await one_round(tree, sims, args, Path(workdir))
                    show(label, result)
                    results[label].append(result)
    finally:
        for child in children:
            await child.stop()
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": argv, "rounds": results}, indent=1))
    got = {label: medians(rs) for label, rs in results.items()}
    print(
        f"\npython -m loadtests.bench_handover_loads {' '.join(argv)}\n"
        f"T = {args.threshold}, {args.clients} clients, {args.documents} documents,"
        f" streams ~{args.stream_s} s, think {args.think_ms:g} ms,"
        f" {args.engine_slots} engine slots per instance,"
        f" {args.rounds} rounds; {', '.join(f'{k} = {v}' for k, v in trees.items())}\n"
    )
    if "before" in got:
        print(table(got["before"], got["after"]))
    else:
        print("\n".join(f"  {label}: {got['after'][key]}" for label, key in ROWS))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_handover_loads",
        description="a handover with every instance at its bound: before and after d02cc67",
    )
    parser.add_argument("--tree", type=Path, default=ROOT, help="checkout whose router runs")
    parser.add_argument("--before", type=Path, help="checkout to compare with (the baseline)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=4, help="ConcurrencyThreshold T")
    parser.add_argument("--clients", type=int, help="closed-loop clients (default 3 T)")
    parser.add_argument("--documents", type=int, default=4, help="keys, at most 8")
    parser.add_argument("--stream-s", type=float, default=3.0, help="mean stream length")
    parser.add_argument("--warmup-s", type=float, default=4.0, help="load before the handover")
    parser.add_argument("--think-ms", type=float, default=0.0, help="a client's pause")
    parser.add_argument("--engine-slots", type=int, help="per instance (default T)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulator's")
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    args = parser.parse_args(argv)
    args.clients = args.clients or 3 * args.threshold
    args.engine_slots = args.engine_slots or args.threshold
    if not 1 <= args.documents <= len(DOCUMENTS):
        parser.error(f"--documents must be 1..{len(DOCUMENTS)}")
    if args.rounds < 1 or args.threshold < 1:
        parser.error("--rounds and --threshold must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    import uvloop

    argv = sys.argv[1:] if argv is None else argv
    return uvloop.run(main_async(parse_args(argv), argv))


if __name__ == "__main__":
    sys.exit(main())
