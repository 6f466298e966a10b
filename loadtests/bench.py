"""``python -m loadtests.bench`` (or ``prefix-router bench``): live routing quality.

    python -m loadtests.bench --workload long --instances 7 \\
        --strategies random,least,prefix,sglang,vllm --duration 120

Contract:
- One simulated fleet (``--instances`` instances in one process, the
  workload's calibrated parameters from ``loadtests.workloads.FLEET``) serves
  every target in turn; before each target its caches and counters are reset
  and it is idle, so every target sees the same fleet and the same seeded
  requests at the same times.
- Targets: ``random``, ``least``, ``prefix`` (prefix-router with that
  strategy, a real ``prefix-router serve`` process; ``prefix`` with the
  default routing config, whatever it is: BalanceMode TRAFFIC and
  ConcurrencyScope PREFILL since 2026-12-01), the PREFIX_AWARE targets that
  pin both modes (``MODES``: ``prefix-sagemaker`` is SageMaker's IN_FLIGHT
  and IN_FLIGHT, ``prefix-traffic`` and ``prefix-prefill`` what RESULTS.md
  measured under those names, ``prefix-traffic-prefill`` the default spelled
  out) and the peers ``sglang`` and ``vllm`` (from ``loadtests.peers``; a
  peer that cannot run here is skipped with the reason printed and recorded).
- Load is open loop: each request is sent at its arrival time, whatever the
  ones before it are doing, streaming, with client-side TTFT (request sent ->
  first SSE data line) and end-to-end latency.  ``--duration`` is wall time
  per target; the fleet runs ``--time-scale`` real seconds per model second,
  so the workload covers ``duration / time_scale`` model seconds and every
  figure is reported in model time, comparable with ``loadtests.offline``.
- Hit rate is the instances' own: vLLM's prefix-cache hits / queries in
  tokens, from /metrics, over the whole run and per ``--sample-every`` window.
- Routing decisions come from prefix-router's access log (joined on
  x-request-id), so overflow and fallback are per request.
- ``--replicas R[,R...]`` runs each target as R independent router
  processes (``prefix-router serve`` with the same flags and backends; a peer
  R times) and the client spreads the requests over them uniformly at
  random, with no coordination: request i goes to replica ``plan[i]`` of
  ``replica_plan(seed, R, n)``, the draw ``loadtests.offline`` makes with
  ``--replicas R`` (same seed derivation, same stream), so a live row and an
  offline row send the same requests to the same replica index.  Replica 0
  gets ``--seed``, the others seeds of their own.  Everything measured stays
  the instances' (hit rate from their counters, shares from who answered), so
  the figures cover all replicas; decisions are joined per replica.  With a
  list, each target runs once per R, R > 1 labelled ", R routers".
  ``--replica-threshold split`` gives each router ceil(T / R), as offline.
- ``--share none,etcd``: with ``etcd`` the routers of a target share their
  routing state (membership, config, in-flight counts, TRAFFIC placements)
  through one etcd the bench starts on 127.0.0.1 in a temporary folder
  (``loadtests.etcd``; stopped by PID and the folder removed at the end),
  each (target, count) under a fresh ``--etcd-prefix`` that its first router
  seeds with its ``--backend`` flags; an admin change goes through the first
  router only, and the run fails unless all R routers still hold their row
  in etcd once the load is over.  Each prefix-router target runs once per
  count and per value (peers: ``none`` only), labelled "sharing etcd".
- ``--serve-arg ARG`` (repeatable; ``--serve-arg=--flag=value`` for a flag)
  appends ARG to every ``prefix-router serve`` command line, ``KEY:ARG``
  only to target KEY's; such targets are labelled with their extra flags.
- ``--scale-event add@T`` / ``remove@T`` (model seconds) adds the last
  instance at T (it starts outside the ring) or drains it, through the admin
  API (every replica's); the report gives the share of groups that moved and
  the time the windowed hit rate takes to come back to its level before the
  event.
- The client's own lag: each run's notes give how late it sent requests
  (P99, max, model time), "the client fell behind" when the P99 exceeds the
  engine's fixed cost per request (most of a cached TTFT): then the client,
  not the fleet, is part of what the figures measure.
- Output: a progress line while running, the markdown tables of
  ``loadtests.report`` on stdout, and ``results.json`` plus PNG plots in
  ``--out`` (no plots with ``--no-plots``: the tests that read only the JSON
  and the logs skip matplotlib's seconds of CPU).  Every process started is
  stopped by PID, on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid
from collections import Counter
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .bench_load import (
    MAX_IN_FLIGHT,
    REQUEST_TIMEOUT_S,
    Event,
    Live,
    drive,
    lag_note,
    progress,
    replica_plan,
    sample_hit_rate,
    scale_event,
    send,
)
from .bench_targets import (
    ETCD_FLAGS,
    MODES,
    OURS,
    PEERS,
    PREFILL_FACTOR,
    SHARE,
    decisions_from,
    etcd_flags,
    joined,
    runs_of,
    serve_args,
    serve_flags,
    shared_etcd,
    target_label,
    udp_lags,
)
from .fleet import (
    ROOT,
    Child,
    FleetError,
    reset_caches,
    say,
    start_router,
    start_sims,
    stop_checked,
)
from .report import Run, markdown, plots, write_json
from .workloads import FLEET, NAMES, Request, build

# Those in bench_load and bench_targets are re-exported: their old import paths keep
# working (bench_ab imports drive, bench_workers reads OURS).
__all__ = [
    "ETCD_FLAGS",
    "MAX_IN_FLIGHT",
    "MODES",
    "OURS",
    "PEERS",
    "PREFILL_FACTOR",
    "REQUEST_TIMEOUT_S",
    "SHARE",
    "Event",
    "Live",
    "decisions_from",
    "drive",
    "etcd_flags",
    "joined",
    "lag_note",
    "main",
    "progress",
    "replica_plan",
    "runs_of",
    "sample_hit_rate",
    "scale_event",
    "scale_report",
    "send",
    "serve_args",
    "serve_flags",
    "shared_etcd",
    "target_label",
    "udp_lags",
]


# ---------------------------------------------------------------- one target


async def run_target(
    key: str,
    replicas: int,
    requests: list[Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    children: list[Child],
    out: Path,
    etcd: str | None = None,
) -> Run | None:
    """One target at one count; with ``etcd`` (a URL; prefix-router targets only) its routers
    share routing state there, and an admin change goes through the first one only."""
    await reset_caches(sims)
    adding = args.scale_event is not None and args.scale_event.kind == "add"
    in_ring = dict(list(sims.items())[:-1]) if adding else sims  # the last one joins later
    seeds, plan = replica_plan(args.seed, replicas, len(requests))
    notes = ""
    if key in OURS:
        label = target_label(OURS[key][0], key, replicas, args, shared=etcd is not None)
        flags = serve_flags(key, args, replicas)
        name = (key if replicas == 1 else f"{key}-r{replicas}") + ("-etcd" if etcd else "")
        logs = [out / f"access-{name}-{i}.log" for i in range(replicas)]
        prefix = f"/bench/{name}-{uuid.uuid4().hex[:8]}/"  # a fresh fleet in etcd
        joins = etcd_flags(etcd, prefix, replicas) if etcd else [[] for _ in range(replicas)]
        routers: list[Child] = []
        urls, admins = [], []
        try:
            for i, (seed, log, join) in enumerate(zip(seeds, logs, joins, strict=True)):
                router, url, admin = await start_router(
                    children, in_ring, *flags, *join, "--seed", str(seed),
                    "--access-log", str(log), label=f"router {name} #{i}",
                )  # fmt: skip
                routers.append(router)
                urls.append(url)
                admins.append(admin)
            samples, ids, series, rate = await drive(
                urls, plan, requests, args, sims, label, admins[:1] if etcd else admins
            )
            if etcd:  # still there once the load is over: they shared all along
                rows = await joined(etcd, prefix)
                if rows != replicas:
                    raise FleetError(f"{label}: {rows} of {replicas} routers in etcd at {prefix}")
                notes = f"{rows} routers in etcd at {prefix}; " + await udp_lags(admins)
        finally:
            for router in routers:
                await router.stop()
        for router in routers:
            await stop_checked(router)  # stopped already: says if one did not exit cleanly
        decided = [decisions_from(log) for log in logs]
        for sample, request_id, replica in zip(samples, ids, plan, strict=True):
            sample.decision = decided[replica].get(request_id)
    else:
        from .peers import RunningPeer, start_peer

        peers: list[RunningPeer] = []
        try:
            try:
                for _ in range(replicas):
                    peer = await start_peer(key, list(in_ring.values()), venv=args.peers_venv)
                    peers.append(peer)  # started: stopped below, whatever follows
            except Exception as exc:
                say(f"{key}: skipped: {exc}")
                label = target_label(key, key, replicas, args)
                return Run(label, [], 0.0, list(sims), None, notes=f"skipped: {exc}")
            label = target_label(peers[0].name, key, replicas, args)
            urls = [peer.url for peer in peers]
            samples, _, series, rate = await drive(urls, plan, requests, args, sims, label, [])
        finally:
            for peer in peers:
                await peer.stop()
        if args.scale_event:
            notes = "scale event not applied (prefix-router's admin API only); "
    notes += lag_note(samples, requests, FLEET[args.workload].request_overhead_s)
    return Run(label, samples, args.duration / args.time_scale, list(sims), rate, series, notes)


def scale_report(run: Run, event: Event) -> dict[str, Any]:
    """Share of groups whose instance changed across the event, and hit-rate recovery."""
    before: dict[str, Counter[str]] = {}
    after: dict[str, Counter[str]] = {}
    for s in run.samples:
        if s.ok and s.instance:
            (before if s.at < event.at else after).setdefault(s.group, Counter())[s.instance] += 1
    common = [g for g in before if g in after]
    moved = sum(before[g].most_common(1)[0][0] != after[g].most_common(1)[0][0] for g in common)
    level = [r for t, r in run.hit_rate_series if event.at - 60 <= t < event.at]
    target = 0.95 * sum(level) / len(level) if level else None
    recovered = None
    if target is not None:
        for t, r in run.hit_rate_series:
            if t >= event.at and r >= target:
                recovered = t - event.at
                break
    return {
        "event": asdict(event),
        "groups_compared": len(common),
        "groups_moved": moved,
        "share_moved": moved / len(common) if common else None,
        "hit_rate_before": target / 0.95 if target is not None else None,
        "recovery_s": recovered,
    }


# ---------------------------------------------------------------- main


async def main_async(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    children: list[Child] = []
    loads: dict[str, list[float]] = {}  # target -> 1-minute load average before, after
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    params = FLEET[args.workload]
    rate = args.rate or params.rate_for(args.instances)
    model_seconds = args.duration / args.time_scale
    requests = build(args.workload, seed=args.seed, duration=model_seconds, rate=rate)
    say(
        f"workload {args.workload}: {len(requests)} requests over {model_seconds:.0f} model s "
        f"({args.duration:.0f} s wall per target, time scale {args.time_scale}), "
        f"{rate} requests/s, seed {args.seed}, {args.form} form, "
        f"router replicas {','.join(map(str, args.replicas))}"
    )
    try:
        if any(key in PEERS for key in args.strategies):
            from .peers import ensure_installed

            for key, reason in ensure_installed(args.peers_venv).items():
                if reason is not None and key in args.strategies:
                    say(f"{key}: cannot run here: {reason}")
        flags = [*params.sim_args(), "--time-scale", str(args.time_scale)]
        fleet, sims = await start_sims(children, args.instances, *flags)
        say(f"fleet: {args.instances} instances, pid {fleet.pid}")
        runs = []
        scale: dict[str, Any] = {}
        async with shared_etcd("etcd" in args.share) as etcd:
            for key, replicas, share in runs_of(args):
                before = os.getloadavg()[0]
                run = await run_target(
                    key, replicas, requests, args, sims, children, out,
                    etcd=etcd if share == "etcd" else None,
                )  # fmt: skip
                if run is not None:
                    runs.append(run)
                    # The machine's state, for the reader: a shared 2-core VM is rarely idle.
                    loads[run.target] = [round(before, 2), round(os.getloadavg()[0], 2)]
                    if args.scale_event and run.samples and key in OURS:
                        scale[run.target] = scale_report(run, args.scale_event)
        await stop_checked(fleet)
    except asyncio.CancelledError:
        say("interrupted")
        return 130
    finally:
        for child in reversed(children):
            if child.proc.returncode is None:
                await child.stop()
    table = markdown([r for r in runs if r.samples], baseline="RANDOM")
    say("\n" + table)
    for run in runs:
        if run.notes:
            say(f"- {run.target}: {run.notes}")
    for target, figures in scale.items():
        say(f"- scale event {target}: {json.dumps(figures)}")
    for target, (before, after) in loads.items():
        say(f"- load average (1 min) {target}: {before:.2f} before, {after:.2f} after")
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m loadtests.bench", *sys.argv[1:]]),
        "workload": args.workload,
        "instances": args.instances,
        "seed": args.seed,
        "rate": rate,
        "time_scale": args.time_scale,
        "model_seconds": model_seconds,
        "fleet": asdict(params),
        "routing": {
            "PrefixLength": args.prefix_length,
            "ConcurrencyThreshold": args.concurrency_threshold,
            "BalanceFactor": args.balance_factor,
        },
        "replicas": args.replicas,
        "replica_threshold": args.replica_threshold,
        "share": args.share,
        "serve_args": {key or "*": flags for key, flags in args.serve_args.items()},
        "load_average": loads,
        "cpus": os.cpu_count(),
        "scale_events": scale,
    }
    write_json(runs, out / "results.json", meta=meta)
    (out / "results.md").write_text(table + "\n")
    for path in plots([r for r in runs if r.samples], out) if args.plots else ():
        say(f"plot: {path}")
    say(f"results: {out}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench",
        description="Routing quality, live: prefix-router's strategies and peer routers "
        "in front of the same simulated vLLM fleet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workload", choices=NAMES, default="long")
    p.add_argument("--instances", type=int, default=7)
    p.add_argument(
        "--strategies",
        default="random,least,prefix",
        help="comma list of random, least, prefix (PREFIX_AWARE with the default routing"
        " config: BalanceMode TRAFFIC, ConcurrencyScope PREFILL), prefix-sagemaker"
        " (IN_FLIGHT, IN_FLIGHT: SageMaker's semantics), prefix-traffic (TRAFFIC, IN_FLIGHT),"
        " prefix-prefill (IN_FLIGHT, PREFILL, BalanceFactor 1.5), prefix-traffic-prefill"
        " (TRAFFIC, PREFILL: the default, spelled out), sglang, vllm",
    )
    p.add_argument("--duration", type=float, default=120.0, help="wall seconds per target")
    p.add_argument("--time-scale", type=float, default=0.2, help="real s per model s")
    p.add_argument("--rate", type=float, help="model requests/s (default: the workload's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--form", choices=("chat", "native"), default="chat")
    p.add_argument("--prefix-length", type=int, default=4096)
    p.add_argument("--concurrency-threshold", type=int, default=10)
    p.add_argument("--balance-factor", type=float)
    p.add_argument("--sample-every", type=float, default=2.0, help="hit-rate window, wall s")
    p.add_argument("--scale-event", type=Event.parse, help="add@T or remove@T, model seconds")
    p.add_argument(
        "--replicas",
        default="1",
        help="router processes per target, the requests spread over them at random;"
        " a comma list runs each target once per count",
    )
    p.add_argument(
        "--replica-threshold",
        choices=("each", "split"),
        default="each",
        help="each router gets ConcurrencyThreshold T (each) or ceil(T / replicas) (split)",
    )
    p.add_argument(
        "--share",
        default="none",
        help="comma list of none (the routers of a target know nothing of each other) and"
        " etcd (they share routing state through an etcd the bench starts on 127.0.0.1);"
        " each prefix-router target runs once per count and per value",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="[KEY:]ARG",
        help="one more argument for every prefix-router serve (KEY: only target KEY's);"
        " a flag needs the = form, e.g. --serve-arg=--workers=2",
    )
    p.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    p.add_argument("--out", type=Path, help="results folder (default: results/DATE-WORKLOAD)")
    p.add_argument(
        "--no-plots", dest="plots", action="store_false", help="results.json and .md only"
    )
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in OURS and s not in PEERS]
    if unknown:
        p.error(f"unknown strategies: {', '.join(unknown)}")
    if args.instances < 2 or args.duration <= 0 or not 0 < args.time_scale <= 10:
        p.error("need --instances >= 2, --duration > 0, 0 < --time-scale <= 10")
    try:
        args.replicas = [int(r) for r in args.replicas.split(",")]
    except ValueError:
        args.replicas = []
    if not args.replicas or min(args.replicas) < 1 or len(set(args.replicas)) < len(args.replicas):
        p.error("--replicas must be distinct counts >= 1, e.g. 2 or 1,2,4")
    args.share = [s.strip() for s in args.share.split(",") if s.strip()]
    if not args.share or len(set(args.share)) < len(args.share) or set(args.share) - set(SHARE):
        p.error(f"--share must be distinct values of {', '.join(SHARE)}, e.g. none,etcd")
    if "etcd" in args.share and args.replica_threshold == "split":
        p.error("--share etcd: every router counts them all, the threshold is not split")
    args.serve_args = serve_args(p, args.serve_arg, args.strategies)
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = ROOT / "results" / f"{stamp}-{args.workload}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except FleetError as exc:
        print(f"bench: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
