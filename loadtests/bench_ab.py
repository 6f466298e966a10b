"""A/B on live traffic, measured: the arms' difference against separate runs of both configs.

    python -m loadtests.bench_ab --workload long --instances 7 \\
        --control random --treatment prefix --weights 50,50 \\
        --duration 150 --time-scale 0.5 --rounds 2

Contract:
- One simulated fleet and one seeded request stream (``loadtests.workloads``)
  serve three runs a round, each on a fresh ``prefix-router serve`` with
  caches reset: the control's RoutingConfig alone, the treatment's alone,
  and one experiment whose two arms are those configs (``--weights``).
  Rounds rotate the three runs' order, so no config always runs on a
  machine warmed (or loaded) by the one before.  The load is
  ``loadtests.bench``'s open loop (its ``drive``: every request at its time,
  streaming, client-side TTFT in model seconds).
- Per request the client keeps its TTFT, and the simulator's own count of
  its prompt and cached tokens (``x-sim-*`` headers: the ground truth a real
  engine does not give per request).  In the A/B run it computes each
  request's arm by the router's rule (the key as ``router.extract`` makes
  it, ``router.arms.rendezvous``) and checks it against the router's
  ``/admin/ab`` counts: the run fails if they differ.
- Per run (and arm): TTFT P50 and P90 over the requests sent from
  ``--since`` model seconds on, the hit rate (cached / prompt tokens of those
  requests).  For the A/B run also what the router says (``/admin/ab``: its
  hit rate attributed from the engines' counters over the whole run, and the
  ground truth over the whole run beside it) and ``prefix-router
  ab-report``'s output, saved and printed.
- Printed: each round's runs, then per figure the treatment's change
  against the control (ratio for TTFT, points for hit rate) in the separate
  runs and between the arms, the median over rounds, and the separate runs'
  spread over rounds (the noise the arms' change is judged against).  With
  one round there is no spread: say so rather than guess.  The machine's
  load average before and after each run is printed too.
- Every process started is stopped by PID (``loadtests.fleet``), on errors and
  Ctrl-C.  Results: ``--out``/results.json (``loadtests.report``'s format,
  one run per (round, config or arm)) and the ab-report texts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from hashring import hash_key, tenant_seed
from router.arms import arm_seed, rendezvous
from router.extract import decode_openai, prompt_key
from router.metrics import percentile

from .bench import drive
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
from .report import Run, Sample, write_json
from .workloads import FLEET, NAMES, Request, build, encode

__all__ = ["CONFIGS", "main"]

# The RoutingConfigs the arms may be (the top level of an experiment is PREFIX_AWARE's
# defaults; an arm changes what it names).
CONFIGS: dict[str, dict[str, Any]] = {
    "random": {"RoutingStrategy": "RANDOM"},
    "least": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
    "prefix": {"RoutingStrategy": "PREFIX_AWARE"},  # the default: TRAFFIC + PREFILL
    "prefix-sagemaker": {
        "RoutingStrategy": "PREFIX_AWARE",
        "PrefixAwareRoutingConfig": {"BalanceMode": "IN_FLIGHT", "ConcurrencyScope": "IN_FLIGHT"},
    },
}
EXPERIMENT = "bench"


@dataclass
class Figures:
    requests: int
    ttft_p50: float | None  # model seconds
    ttft_p90: float | None
    hit_rate: float | None  # cached / prompt tokens, the simulator's own counts


def figures(samples: list[Sample], since: float) -> Figures:
    kept = [s for s in samples if s.at >= since]
    ttfts = [s.ttft for s in kept if s.ok and s.ttft is not None]
    prompt = sum(s.prompt_tokens for s in kept)
    return Figures(
        len(kept),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.9),
        sum(s.cached_tokens for s in kept) / prompt if prompt else None,
    )


def key_hash(request: Request, prefix_length: int) -> int:
    """The routing key of a chat request without session keys, as the router makes it."""
    body = request.chat_body()
    decoded = decode_openai(encode(body), prefix_length)
    return hash_key(prompt_key(decoded, prefix_length), tenant_seed(body.get("prompt_cache_key")))


def experiment(control: str, treatment: str, weights: tuple[float, float]) -> dict[str, Any]:
    return {
        "RoutingConfig": {
            "Experiment": EXPERIMENT,
            "Arms": [
                {"Name": "control", "Weight": weights[0], "RoutingConfig": CONFIGS[control]},
                {"Name": "treatment", "Weight": weights[1], "RoutingConfig": CONFIGS[treatment]},
            ],
        }
    }


async def one_run(
    routing: dict[str, Any],
    requests: list[Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    children: list[Child],
    label: str,
) -> tuple[list[Sample], dict[str, Any] | None, str]:
    """One router with ``routing`` under the whole load: the samples, and for an
    experiment its ``/admin/ab`` and ``prefix-router ab-report``'s text."""
    await reset_caches(sims)
    flags = [
        "--routing-config", json.dumps(routing), "--seed", str(args.seed), "--access-log", "off",
        "--scrape-metrics", "--scrape-interval", str(args.scrape_interval),
        "--workers", str(args.workers),
    ]  # fmt: skip
    router, url, admin = await start_router(children, sims, *flags, label=f"router {label}")
    view: dict[str, Any] | None = None
    text = ""
    try:
        plan = [0] * len(requests)
        samples, _, _, _ = await drive([url], plan, requests, args, sims, label, [])
        if "Arms" in routing["RoutingConfig"]:
            # One more scrape round: the last requests' hits reach the fit.
            await asyncio.sleep(2 * args.scrape_interval)  # the router's scrape period
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{admin}/admin/ab") as resp,
            ):
                if resp.status != 200:
                    raise FleetError(f"{label}: /admin/ab answered {resp.status}")
                view = await resp.json()
            report = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "admin", "ab-report", "--admin", admin,
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await report.communicate()
            if report.returncode != 0:
                raise FleetError(f"ab-report failed: {err.decode()}")
            text = out.decode()
    finally:
        await router.stop()
    await stop_checked(router)
    return samples, view, text


def change(treatment: float | None, control: float | None, ratio: bool) -> float | None:
    if treatment is None or control is None:
        return None
    if ratio:
        return treatment / control if control else None
    return treatment - control


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return "- (one round)"
    return f"{min(values):.3f} - {max(values):.3f}"


async def main_async(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    params = FLEET[args.workload]
    rate = args.rate or params.rate_for(args.instances)
    model_seconds = args.duration / args.time_scale
    requests = build(args.workload, seed=args.seed, duration=model_seconds, rate=rate)
    weights = args.weights
    seeds = [arm_seed(EXPERIMENT, name) for name in ("control", "treatment")]
    arms = [rendezvous(key_hash(r, args.prefix_length), seeds, weights) for r in requests]
    say(
        f"workload {args.workload}: {len(requests)} requests over {model_seconds:.0f} model s"
        f" ({args.duration:.0f} s wall a run, time scale {args.time_scale}), {rate:g} requests/s;"
        f" {args.control} against {args.treatment}, arms {weights[0]:g}/{weights[1]:g}"
        f" ({arms.count(1)} requests in the treatment arm); {args.rounds} rounds"
    )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    runs: list[Run] = []
    table: list[dict[str, Any]] = []
    routers = {
        "control alone": {"RoutingConfig": CONFIGS[args.control]},
        "treatment alone": {"RoutingConfig": CONFIGS[args.treatment]},
        "A/B": experiment(args.control, args.treatment, weights),
    }
    order = list(routers)
    try:
        flags = [*params.sim_args(), "--time-scale", str(args.time_scale)]
        fleet, sims = await start_sims(children, args.instances, *flags)
        for round_ in range(1, args.rounds + 1):
            for name in order[round_ - 1 :] + order[: round_ - 1]:
                label = f"{name}, round {round_}"
                before = os.getloadavg()[0]
                samples, view, text = await one_run(
                    routers[name], requests, args, sims, children, label
                )
                load = (before, os.getloadavg()[0])
                duration = model_seconds
                if view is None:
                    runs.append(Run(label, samples, duration, list(sims), None))
                    row: dict[str, Any] = {"round": round_, "run": name, "load": load}
                    row[name.split()[0]] = figures(samples, args.since).__dict__
                    table.append(row)
                    continue
                parts = [
                    [s for s, arm in zip(samples, arms, strict=True) if arm == i] for i in (0, 1)
                ]
                counted = [arm["requests"] for arm in view["arms"]]
                if counted != [len(part) for part in parts]:
                    raise FleetError(
                        f"{label}: the router counted {counted} requests per arm, the client"
                        f" assigned {[len(part) for part in parts]}: not the router's rule"
                    )
                (out / f"ab-report-round{round_}.txt").write_text(text)
                say(f"\n{label}: prefix-router ab-report\n{text}")
                attributed = [arm["prefix_cache_hit_rate"] for arm in view["arms"]]
                errors = [arm["prefix_cache_hit_rate_error"] for arm in view["arms"]]
                row = {"round": round_, "run": name, "load": load, "view": view}
                for arm, part in zip(("control", "treatment"), parts, strict=True):
                    runs.append(Run(f"{label}, {arm} arm", part, duration, list(sims), None))
                    shown: dict[str, Any] = dict(figures(part, args.since).__dict__)
                    shown["whole_run_hit_rate"] = figures(part, 0.0).hit_rate
                    row[arm] = shown
                row["attributed"] = attributed
                row["attributed_error"] = errors
                table.append(row)
        await stop_checked(fleet)
    except asyncio.CancelledError:
        say("interrupted")
        return 130
    finally:
        for child in reversed(children):
            if child.proc.returncode is None:
                await child.stop()
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": table}
    write_json(runs, out / "results.json", meta=meta)
    print(render(table, args))
    return 0


def render(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Each run's figures, then the arms' change against the separate runs'."""
    lines = [
        f"\nFrom model second {args.since:g} on; TTFT in model ms, client side; hit rate: the"
        " simulator's cached / prompt tokens of those requests.",
        "",
        "| round | run | load before / after | control P50 / P90 | treatment P50 / P90 |"
        " control hit rate | treatment hit rate |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(row: dict[str, Any], arm: str) -> tuple[str, str]:
        figures_ = row.get(arm)
        if figures_ is None:
            return "", ""
        p50, p90, rate = figures_["ttft_p50"], figures_["ttft_p90"], figures_["hit_rate"]
        ttft = "-" if p50 is None else f"{p50 * 1000:,.0f} / {p90 * 1000:,.0f}"
        return ttft, "-" if rate is None else f"{rate * 100:.1f} %"

    for row in table:
        (c_ttft, c_hit), (t_ttft, t_hit) = cell(row, "control"), cell(row, "treatment")
        load = f"{row['load'][0]:.1f} / {row['load'][1]:.1f}"
        lines.append(
            f"| {row['round']} | {row['run']} | {load} | {c_ttft} | {t_ttft} | {c_hit} | {t_hit} |"
        )
    # The treatment's change against the control: separate runs (each round's pair) and arms.
    separate: dict[str, list[float]] = {"p50": [], "p90": [], "hit": []}
    between: dict[str, list[float]] = {"p50": [], "p90": [], "hit": []}
    for round_ in sorted({row["round"] for row in table}):
        rows = {row["run"]: row for row in table if row["round"] == round_}
        alone_c = rows["control alone"]["control"]
        alone_t = rows["treatment alone"]["treatment"]
        ab = rows["A/B"]
        for into, control, treatment in (
            (separate, alone_c, alone_t),
            (between, ab["control"], ab["treatment"]),
        ):
            for key, field, ratio in (("p50", "ttft_p50", True), ("p90", "ttft_p90", True)):
                found = change(treatment[field], control[field], ratio)
                if found is not None:
                    into[key].append(found)
            found = change(treatment["hit_rate"], control["hit_rate"], False)
            if found is not None:
                into["hit"].append(found * 100)
    lines += [
        "",
        f"Treatment ({args.treatment}) against control ({args.control}): TTFT as a ratio,"
        " hit rate in points; medians over rounds, the separate runs' spread over rounds.",
        "",
        "| figure | separate runs | arms of one experiment | separate runs' spread |",
        "|---|---:|---:|---:|",
    ]
    for key, name in (("p50", "TTFT P50 ratio"), ("p90", "TTFT P90 ratio"), ("hit", "hit rate")):
        alone = statistics.median(separate[key]) if separate[key] else None
        arms = statistics.median(between[key]) if between[key] else None
        lines.append(
            f"| {name} | {'-' if alone is None else f'{alone:.3f}'} |"
            f" {'-' if arms is None else f'{arms:.3f}'} | {spread(separate[key])} |"
        )
    lines += [
        "",
        "The router's hit rates in the A/B runs (attributed from the engines' counters,"
        " whole run) against the simulator's own counts (whole run):",
        "",
        "| round | control: attributed / true | treatment: attributed / true |",
        "|---|---|---|",
    ]
    for row in table:
        if "attributed" not in row:
            continue
        cells = []
        for index, arm in enumerate(("control", "treatment")):
            rate, error = row["attributed"][index], row["attributed_error"][index]
            true = row[arm]["whole_run_hit_rate"]
            shown = "-" if rate is None else f"{rate * 100:.1f} ± {error * 100:.1f} %"
            cells.append(f"{shown} / {'-' if true is None else f'{true * 100:.1f} %'}")
        lines.append(f"| {row['round']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _weights(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        control, treatment = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError("--weights is CONTROL,TREATMENT, e.g. 90,10") from None
    if control < 0 or treatment < 0 or not control + treatment:
        raise argparse.ArgumentTypeError("--weights must be >= 0, one above 0")
    return control, treatment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_ab", description=__doc__)
    p.add_argument("--workload", choices=NAMES, default="long")
    p.add_argument("--instances", type=int, default=7)
    p.add_argument("--control", choices=sorted(CONFIGS), default="random")
    p.add_argument("--treatment", choices=sorted(CONFIGS), default="prefix")
    p.add_argument("--weights", type=_weights, default=(50.0, 50.0), help="CONTROL,TREATMENT")
    p.add_argument("--duration", type=float, default=150.0, help="wall seconds a run")
    p.add_argument("--time-scale", type=float, default=0.5, help="real s per model s")
    p.add_argument("--rate", type=float, help="model requests/s (default: the workload's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--since", type=float, default=0.0, help="model s: figures from here on")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix-length", type=int, default=4096)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--scrape-interval", type=float, default=1.0, help="the router's, wall s")
    p.add_argument("--out", type=Path, help="results folder (default: results/DATE-ab)")
    args = p.parse_args(argv)
    # drive()'s knobs, as loadtests.bench sets them.
    args.form, args.sample_every, args.scale_event = "chat", 5.0, None
    if args.out is None:
        args.out = ROOT / "results" / f"{datetime.now(UTC):%Y%m%d-%H%M%S}-ab"
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
