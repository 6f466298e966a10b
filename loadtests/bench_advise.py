"""``python -m loadtests.bench_advise``: is the PrefixLength advisor right?  Brute force against it.

    python -m loadtests.bench_advise offline [--workloads long,short,...] [--duration 1200]
    python -m loadtests.bench_advise live [--workloads short] [--duration 60] [--time-scale 0.1]

Contract:
- ``offline``: per workload (``loadtests.workloads``, its calibrated fleet,
  seed 1), every candidate PrefixLength is run through the offline simulator
  on the real requests (``offline.simulate``: the true hit rate, TTFT and
  shares of that length), and the advisor (``loadtests.advise``) is given
  the same requests as a sample, keyed as the access log would hold them
  (``advise.key_body``: digests at ``--lengths``, no text), under the
  default RoutingConfig at PrefixLength 4,096.  Printed per workload: the
  best length by brute force and its true hit rate, the advisor's
  recommendation and its true hit rate, the gap in points (the target:
  at most 1), and per candidate the predicted and true hit rates.
- ``live``: per workload, a simulated fleet (``simserver``) and a real
  ``prefix-router serve --key-digests --workers 2`` at PrefixLength 4,096
  (``bench.run_target``: open-loop load, the instances' own hit rate);
  then ``prefix-router advise`` is run as an operator would (a subprocess,
  on the router's access log, with ``--fleet W --time-scale S``); then the
  recommended length and the offline brute force's best run live the same
  way.  Printed: each live run's hit rate, TTFT and shares, and the gap
  between the recommended and the best live.
- Output: markdown on stdout; ``results.json`` in ``--out``.  Every process
  is stopped by PID (``loadtests.supervisor``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from router.config import parse_routing
from router.keydigests import DEFAULT_LENGTHS

from . import advise, report, workloads
from .offline import route_keys, simulate

__all__ = ["main", "offline", "sample_of"]

CURRENT = 4096  # the default PrefixLength: the sample's routing


def sample_of(
    requests: list[workloads.Request], lengths: tuple[int, ...], prefix_length: int = CURRENT
) -> list[advise.Sampled]:
    """The workload as the advisor's sample: each chat body keyed as the access log holds it."""
    routing = parse_routing({"PrefixAwareRoutingConfig": {"PrefixLength": prefix_length}})
    out = []
    for serial, request in enumerate(requests):
        body = workloads.encode(request.chat_body())
        source, digest, digests = advise.key_body(
            "/v1/chat/completions", {}, body, routing, lengths
        )
        out.append(
            advise.sample_request(
                serial,
                request.at,
                digests,
                request.max_tokens,
                key_source=source,
                prefix_hash=digest,
                bytes_in=len(body),
                group=request.group,
            )
        )
    return out


def offline(
    workload: str, duration: float, lengths: tuple[int, ...], seed: int, tolerance: float
) -> dict[str, Any]:
    params = workloads.FLEET[workload]
    requests = workloads.build(workload, seed=seed, duration=duration, rate=params.default_rate)
    routing = parse_routing({})
    candidates = [g for g in lengths if g >= advise.MIN_PREFIX_LENGTH]
    clock = time.perf_counter()
    true: dict[int, dict[str, Any]] = {}
    for length in sorted({*candidates, CURRENT}):
        config = parse_routing({"PrefixAwareRoutingConfig": {"PrefixLength": length}})
        outcome = simulate(
            requests,
            config,
            instances=params.instances,
            params=params,
            seed=seed,
            hashes=route_keys(requests, length),
        )
        summary = report.summarize(outcome.run)
        true[length] = {
            "hit_rate": outcome.run.hit_rate,
            "ttft_p90": summary["ttft_p90"],
            "min_share": summary["min_share"],
            "max_share": summary["max_share"],
        }
    brute_s = time.perf_counter() - clock
    clock = time.perf_counter()
    sample = sample_of(requests, lengths)
    advice = advise.advise(
        sample,
        routing,
        candidates,
        CURRENT,
        instances=[f"sim-{i}" for i in range(params.instances)],
        params=params,
        tolerance=tolerance,
        seed=seed,
        progress=False,
    )
    advise_s = time.perf_counter() - clock
    bound = advise.advise(  # what the digests alone show (advise --lower-bound)
        sample,
        routing,
        candidates,
        CURRENT,
        instances=[f"sim-{i}" for i in range(params.instances)],
        params=params,
        tolerance=tolerance,
        seed=seed,
        progress=False,
        lower_bound=True,
    )
    lower = {r.length: r.hit_rate for r in bound.rows}
    best = max(true, key=lambda g: true[g]["hit_rate"])
    gap = (true[best]["hit_rate"] - true[advice.recommended]["hit_rate"]) * 100
    return {
        "workload": workload,
        "requests": len(requests),
        "best": best,
        "best_hit_rate": true[best]["hit_rate"],
        "recommended": advice.recommended,
        "recommended_hit_rate": true[advice.recommended]["hit_rate"],
        "gap_points": gap,
        "lower_bound_recommended": bound.recommended,
        "lower_bound_gap_points": (true[best]["hit_rate"] - true[bound.recommended]["hit_rate"])
        * 100,
        "reason": advice.reason,
        "rows": [
            {
                "length": r.length,
                "predicted": r.hit_rate,
                "lower_bound": lower[r.length],
                "true": true[r.length]["hit_rate"],
                "predicted_p90": r.ttft_p90,
                "true_p90": true[r.length]["ttft_p90"],
                "predicted_shares": [r.min_share, r.max_share],
                "true_shares": [true[r.length]["min_share"], true[r.length]["max_share"]],
                "keys": r.keys,
                "keys_per_group": r.keys_per_group,
            }
            for r in advice.rows
        ],
        "brute_force_s": brute_s,
        "advise_s": advise_s,
    }


def _offline_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | requests | best by brute force | its hit rate | recommended | its hit rate"
        " | gap | lower bound's pick, gap | hit rate per PrefixLength: estimate / lower bound"
        " / true |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        per = ", ".join(
            f"{row['length']}: {row['predicted'] * 100:.1f} / {row['lower_bound'] * 100:.1f}"
            f" / {row['true'] * 100:.1f}"
            for row in r["rows"]
        )
        lines.append(
            f"| {r['workload']} | {r['requests']:,} | {r['best']}"
            f" | {r['best_hit_rate'] * 100:.1f} % | {r['recommended']}"
            f" | {r['recommended_hit_rate'] * 100:.1f} %"
            f" | {r['gap_points']:.2f} | {r['lower_bound_recommended']},"
            f" {r['lower_bound_gap_points']:.2f} | {per} |"
        )
    return "\n".join(lines)


async def _live_run(
    workload: str,
    length: int,
    requests: list[workloads.Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    children: list[Any],
    out: Path,
) -> tuple[report.Run, Path]:
    """One live run of ``prefix-router serve`` at ``length`` (bench's target ``prefix``,
    its access log with key digests); the run and the log."""
    from . import bench

    folder = out / f"{workload}-{length}"
    folder.mkdir(parents=True, exist_ok=True)
    bench_args = bench.parse_args(
        [
            *("--workload", workload, "--instances", str(len(sims))),
            *("--duration", str(args.duration), "--time-scale", str(args.time_scale)),
            *("--prefix-length", str(length), "--strategies", "prefix", "--out", str(folder)),
            "--serve-arg=--key-digests",
            f"--serve-arg=--key-digest-lengths={','.join(map(str, args.logged))}",
            f"--serve-arg=--workers={args.workers}",
        ]
    )
    run = await bench.run_target("prefix", 1, requests, bench_args, sims, children, folder)
    assert run is not None
    run.target = f"PrefixLength {length}"
    return run, folder / "access-prefix-0.log"


async def _advise_cli(workload: str, log: Path, time_scale: float) -> dict[str, Any]:
    """``prefix-router advise`` as an operator runs it, on the router's access log."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "advise", str(log), "--fleet", workload,
        "--time-scale", str(time_scale), "--json",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"prefix-router advise exited {proc.returncode}")
    answer: dict[str, Any] = json.loads(stdout)
    return answer


async def live(
    args: argparse.Namespace, names: list[str], lengths: tuple[int, ...], out: Path
) -> int:
    """The live validation (see the module contract)."""
    from .fleet import start_sims, stop_checked
    from .supervisor import Child

    args.logged = lengths
    results = []
    for workload in names:
        params = workloads.FLEET[workload]
        model_s = args.duration / args.time_scale
        requests = workloads.build(
            workload, seed=args.seed, duration=model_s, rate=params.default_rate
        )
        found = offline(workload, model_s, lengths, args.seed, args.tolerance)
        print(
            f"{workload}: {len(requests)} requests over {model_s:.0f} model s; offline best"
            f" {found['best']}, offline advice {found['recommended']}",
            file=sys.stderr,
            flush=True,
        )
        children: list[Child] = []
        runs: dict[int, report.Run] = {}
        try:
            flags = [*params.sim_args(), "--time-scale", str(args.time_scale)]
            fleet, sims = await start_sims(children, params.instances, *flags)
            loads = [os.getloadavg()[0]]
            runs[CURRENT], log = await _live_run(
                workload, CURRENT, requests, args, sims, children, out
            )
            advice = await _advise_cli(workload, log, args.time_scale)
            for length in (advice["recommended"], found["best"]):
                if length not in runs:
                    runs[length], _ = await _live_run(
                        workload, length, requests, args, sims, children, out
                    )
            loads.append(os.getloadavg()[0])
            await stop_checked(fleet)
        finally:
            for child in reversed(children):
                if child.proc.returncode is None:
                    await child.stop()
        live_hit = {length: run.hit_rate or 0.0 for length, run in runs.items()}
        result = {
            "workload": workload,
            "requests": len(requests),
            "offline_best": found["best"],
            "offline_recommended": found["recommended"],
            "live_recommended": advice["recommended"],
            "live_reason": advice["reason"],
            "advice_rows": advice["rows"],
            "live_hit_rates": live_hit,
            # against the best length run live: the offline best, the advice, the current
            "gap_points": (max(live_hit.values()) - live_hit[advice["recommended"]]) * 100,
            "summaries": {str(k): report.summarize(r) for k, r in runs.items()},
            "load_average": loads,
        }
        results.append(result)
        print(report.markdown(list(runs.values())))
        print(
            f"{workload}: advised {advice['recommended']} ({advice['reason']}); live hit rates "
            + ", ".join(f"{k}: {v * 100:.1f} %" for k, v in sorted(live_hit.items()))
            + f"; gap {result['gap_points']:.2f} points",
            flush=True,
        )
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m loadtests.bench_advise", *sys.argv[1:]]),
        "duration_wall_s": args.duration,
        "time_scale": args.time_scale,
        "workers": args.workers,
        "lengths": lengths,
    }
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1, default=str)
    )
    print(f"results: {out}", file=sys.stderr)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_advise", description=__doc__)
    p.add_argument("mode", choices=("offline", "live"))
    p.add_argument("--workloads", default=",".join(workloads.NAMES))
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="model seconds offline (1200); wall seconds a live run (120)",
    )
    p.add_argument("--time-scale", type=float, default=0.2, help="live: real s per model s")
    p.add_argument("--workers", type=int, default=2, help="live: serve --workers N")
    p.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        help="the logged lengths ([advisor] lengths)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if args.duration is None:
        args.duration = 120.0 if args.mode == "live" else 1200.0
    lengths = tuple(sorted({int(x) for x in args.lengths.split(",")} | {CURRENT}))
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("results") / f"{stamp}-advise-{args.mode}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.mode == "live":
        return asyncio.run(live(args, names, lengths, out))
    results = []
    for name in names:
        result = offline(name, args.duration, lengths, args.seed, args.tolerance)
        results.append(result)
        print(
            f"{name}: best {result['best']}, recommended {result['recommended']}"
            f" (gap {result['gap_points']:.2f} points); brute force"
            f" {result['brute_force_s']:.0f} s, advisor {result['advise_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    print(_offline_table(results))
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m loadtests.bench_advise", *sys.argv[1:]]),
        "duration": args.duration,
        "lengths": lengths,
        "seed": args.seed,
        "tolerance": args.tolerance,
        "wall_s": time.perf_counter() - started,
        "load_average": os.getloadavg(),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
