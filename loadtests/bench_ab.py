"""A/B on live traffic, measured: the arms' difference against separate runs of both configs.

    python -m loadtests.bench_ab --workload long --instances 7 \\
        --control random --treatment prefix --weights 50,50 \\
        --duration 150 --time-scale 0.5 --rounds 2
    python -m loadtests.bench_ab --workload long --instances 8 \\
        --ab 50,50:backends --ab 90,10:backends --seeds 1,2,3 --duration 150 --since 100

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
- ``--ab WEIGHTS[:keys|backends]`` (repeated) runs several experiments a
  round instead of ``--weights``' one, each with its Split (router.split):
  ``backends`` gives each arm instances of its own.  A 50/50 split of 8
  instances gives each arm 4 at half the rate: the per-instance load of a
  separate run on all 8 at the full rate, so the separate runs are the
  fair comparison; the weights quantise to whole instances (90/10 of 8:
  7 and 1, printed with each arm's requests per instance).  The run fails
  if an arm's requests reached an instance it does not own.
- ``--seeds`` gives each round a request stream of its own (the simulator
  is deterministic in model time: rounds of one stream differ only by the
  machine, which understates the noise).  For every experiment and round,
  a 95 % bootstrap interval of (the arms' change - the separate runs'
  change) per figure, resampling whole routing keys (a document's requests
  share its cache) in each of the four runs' requests independently: the
  arms match the separate runs within noise where it holds 0.
- Every process started is stopped by PID (``loadtests.fleet``), on errors and
  Ctrl-C.  Results: ``--out``/results.json (``loadtests.report``'s format,
  one run per (round, config or arm)) and the ab-report texts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from router.split import quotas

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


def experiment(
    control: str, treatment: str, weights: tuple[float, float], split: str = "KEYS"
) -> dict[str, Any]:
    inner: dict[str, Any] = {
        "Experiment": EXPERIMENT,
        "Arms": [
            {"Name": "control", "Weight": weights[0], "RoutingConfig": CONFIGS[control]},
            {"Name": "treatment", "Weight": weights[1], "RoutingConfig": CONFIGS[treatment]},
        ],
    }
    if split != "KEYS":
        inner["Split"] = split
    return {"RoutingConfig": inner}


@dataclass(frozen=True)
class Variant:
    """One experiment a round runs: its weights and what its arms divide."""

    weights: tuple[float, float]
    split: str  # KEYS or BACKENDS

    @property
    def name(self) -> str:
        shown = "split" if self.split == "BACKENDS" else "shared"
        return f"A/B {self.weights[0]:g}/{self.weights[1]:g} {shown}"


FIGURES = (("p50", "ttft_p50", True), ("p90", "ttft_p90", True), ("hit", "hit_rate", False))


def differences(runs: list[list[Sample]], since: float) -> dict[str, float | None]:
    """(the arms' change - the separate runs' change) per figure: ``runs`` is control
    alone, treatment alone, the control arm, the treatment arm."""
    c, t, ac, at = (figures(samples, since) for samples in runs)
    out: dict[str, float | None] = {}
    for key, field, ratio in FIGURES:
        alone = change(getattr(t, field), getattr(c, field), ratio)
        arms = change(getattr(at, field), getattr(ac, field), ratio)
        scale = 1.0 if ratio else 100.0  # hit rate in points
        out[key] = None if alone is None or arms is None else (arms - alone) * scale
    return out


def bootstrap(
    runs: list[list[Sample]], keys: list[list[int]], since: float, resamples: int, seed: int
) -> dict[str, tuple[float, float] | None]:
    """95 % intervals of ``differences``, resampling whole keys of each run."""
    grouped = []
    for samples, run_keys in zip(runs, keys, strict=True):
        by_key: dict[int, list[Sample]] = {}
        for sample, key_ in zip(samples, run_keys, strict=True):
            if sample.at >= since:
                by_key.setdefault(key_, []).append(sample)
        grouped.append(list(by_key.values()))
    rng = random.Random(seed)
    drawn: dict[str, list[float]] = {key: [] for key, _, _ in FIGURES}
    for _ in range(resamples):
        picked = [
            [s for cluster in rng.choices(clusters, k=len(clusters)) for s in cluster]
            for clusters in grouped
        ]
        for key, value in differences(picked, since).items():
            if value is not None:
                drawn[key].append(value)
    out: dict[str, tuple[float, float] | None] = {}
    for key, values in drawn.items():
        values.sort()
        if len(values) < resamples // 2:
            out[key] = None
        else:
            out[key] = (values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1])
    return out


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


def spread(values: list[float], digits: int = 3) -> str:
    if len(values) < 2:
        return "- (one round)"
    return f"{min(values):.{digits}f} - {max(values):.{digits}f}"


async def main_async(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    params = FLEET[args.workload]
    rate = args.rate or params.rate_for(args.instances)
    model_seconds = args.duration / args.time_scale
    variants: list[Variant] = args.ab or [Variant(args.weights, "KEYS")]
    seeds: list[int] = args.seeds or [args.seed] * args.rounds
    streams: dict[int, tuple[list[Request], list[int]]] = {}
    for seed in seeds:
        requests = build(args.workload, seed=seed, duration=model_seconds, rate=rate)
        streams[seed] = requests, [key_hash(r, args.prefix_length) for r in requests]
    arm_names = ("control", "treatment")
    arm_seeds = [arm_seed(EXPERIMENT, name) for name in arm_names]
    say(
        f"workload {args.workload}: {len(streams[seeds[0]][0])} requests over"
        f" {model_seconds:.0f} model s ({args.duration:.0f} s wall a run, time scale"
        f" {args.time_scale}), {rate:g} requests/s on {args.instances} instances;"
        f" {args.control} against {args.treatment}; experiments"
        f" {', '.join(v.name for v in variants)}; {len(seeds)} rounds, seeds {seeds}"
    )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    runs: list[Run] = []
    table: list[dict[str, Any]] = []
    routers: dict[str, tuple[dict[str, Any], Variant | None]] = {
        "control alone": ({"RoutingConfig": CONFIGS[args.control]}, None),
        "treatment alone": ({"RoutingConfig": CONFIGS[args.treatment]}, None),
    }
    for each in variants:
        routers[each.name] = (
            experiment(args.control, args.treatment, each.weights, each.split),
            each,
        )
    order = list(routers)
    try:
        flags = [*params.sim_args(), "--time-scale", str(args.time_scale)]
        fleet, sims = await start_sims(children, args.instances, *flags)
        for round_, seed in enumerate(seeds, start=1):
            requests, keys = streams[seed]
            kept: dict[str, list[Sample]] = {}
            shift = (round_ - 1) % len(order)
            for name in order[shift:] + order[:shift]:
                routing, variant = routers[name]
                label = f"{name}, round {round_}"
                before = os.getloadavg()[0]
                args.seed = seed
                samples, view, text = await one_run(routing, requests, args, sims, children, label)
                load = (before, os.getloadavg()[0])
                duration = model_seconds
                row: dict[str, Any] = {"round": round_, "seed": seed, "run": name, "load": load}
                if view is None or variant is None:
                    runs.append(Run(label, samples, duration, list(sims), None))
                    row[name.split()[0]] = figures(samples, args.since).__dict__
                    kept[name] = samples
                    table.append(row)
                    continue
                arms = [rendezvous(key, arm_seeds, variant.weights) for key in keys]
                parts = [
                    [s for s, arm in zip(samples, arms, strict=True) if arm == i] for i in (0, 1)
                ]
                counted = [arm["requests"] for arm in view["arms"]]
                if counted != [len(part) for part in parts]:
                    raise FleetError(
                        f"{label}: the router counted {counted} requests per arm, the client"
                        f" assigned {[len(part) for part in parts]}: not the router's rule"
                    )
                if variant.split == "BACKENDS":
                    own_instances(view, parts, label)
                    row["owns"] = [arm["owns"] for arm in view["arms"]]
                (out / f"ab-report-{variant.name[4:].replace('/', '-').replace(' ', '-')}"
                 f"-round{round_}.txt").write_text(text)  # fmt: skip
                say(f"\n{label}: prefix-router ab-report\n{text}")
                row["view"] = view
                for arm, part in zip(arm_names, parts, strict=True):
                    runs.append(Run(f"{label}, {arm} arm", part, duration, list(sims), None))
                    shown: dict[str, Any] = dict(figures(part, args.since).__dict__)
                    shown["whole_run_hit_rate"] = figures(part, 0.0).hit_rate
                    row[arm] = shown
                row["attributed"] = [arm["prefix_cache_hit_rate"] for arm in view["arms"]]
                row["attributed_error"] = [
                    arm["prefix_cache_hit_rate_error"] for arm in view["arms"]
                ]
                row["per_instance"] = per_instance(variant, parts, args.instances, model_seconds)
                row["parts"] = parts
                row["arm_keys"] = [
                    [k for k, arm in zip(keys, arms, strict=True) if arm == i] for i in (0, 1)
                ]
                table.append(row)
            # Each experiment against this round's separate runs (same stream).
            for row in table:
                if row["round"] != round_ or "parts" not in row:
                    continue
                four = [kept["control alone"], kept["treatment alone"], *row.pop("parts")]
                four_keys = [keys, keys, *row.pop("arm_keys")]
                row["difference"] = differences(four, args.since)
                row["interval"] = bootstrap(
                    four, four_keys, args.since, args.resamples, seed=round_
                )
            # Each round's figures as they come: a long session keeps what it ran.
            (out / "rows.json").write_text(json.dumps(table, indent=1, default=str))
            say(render(table, args, variants, rate))
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
    print(render(table, args, variants, rate))
    return 0


def own_instances(view: dict[str, Any], parts: list[list[Sample]], label: str) -> None:
    """Split BACKENDS: every request of an arm answered by an instance it owns."""
    for arm, part in zip(view["arms"], parts, strict=True):
        owns = set(arm["owns"] or ())
        strays = {s.instance for s in part if s.instance is not None} - owns
        if not owns or strays or set(arm["backends"]) - owns:
            raise FleetError(
                f"{label}: arm {arm['name']} owns {sorted(owns)} but was answered by"
                f" {sorted(strays | (set(arm['backends']) - owns))}"
            )


def per_instance(
    variant: Variant, parts: list[list[Sample]], instances: int, seconds: float
) -> list[float] | None:
    """Split BACKENDS: each arm's requests per model second and instance it owns."""
    if variant.split != "BACKENDS":
        return None
    sizes = quotas(list(zip(("control", "treatment"), variant.weights, strict=True)), instances)
    assert sizes is not None
    return [len(parts[i]) / seconds / sizes[arm] for i, arm in enumerate(("control", "treatment"))]


def render(
    table: list[dict[str, Any]], args: argparse.Namespace, variants: list[Variant], rate: float
) -> str:
    """Each run's figures, then each experiment's arms' change against the separate runs'."""
    lines = [
        f"\nFrom model second {args.since:g} on; TTFT in model ms, client side; hit rate: the"
        " simulator's cached / prompt tokens of those requests.",
        "",
        "| round (seed) | run | load before / after | control P50 / P90 | treatment P50 / P90 |"
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
            f"| {row['round']} ({row['seed']}) | {row['run']} | {load} | {c_ttft} | {t_ttft} |"
            f" {c_hit} | {t_hit} |"
        )
    separate: dict[str, list[float]] = {"p50": [], "p90": [], "hit": []}
    for round_ in sorted({row["round"] for row in table}):
        by_run = {row["run"]: row for row in table if row["round"] == round_}
        alone_c = by_run["control alone"]["control"]
        alone_t = by_run["treatment alone"]["treatment"]
        for key, field, ratio in FIGURES:
            found = change(alone_t[field], alone_c[field], ratio)
            if found is not None:
                separate[key].append(found if ratio else found * 100)
    names = {"p50": "TTFT P50 ratio", "p90": "TTFT P90 ratio", "hit": "hit rate (points)"}
    for variant in variants:
        rows = [row for row in table if row["run"] == variant.name]
        between: dict[str, list[float]] = {"p50": [], "p90": [], "hit": []}
        for row in rows:
            for key, field, ratio in FIGURES:
                found = change(row["treatment"][field], row["control"][field], ratio)
                if found is not None:
                    between[key].append(found if ratio else found * 100)
        lines += [
            "",
            f"{variant.name}: treatment ({args.treatment}) against control ({args.control});"
            " medians over rounds, each round's (arms - separate) with its 95 % key-bootstrap"
            f" interval ({args.resamples} resamples).",
        ]
        if variant.split == "BACKENDS":
            sizes = quotas(
                list(zip(("control", "treatment"), variant.weights, strict=True)), args.instances
            )
            assert sizes is not None
            loads = [row["per_instance"] for row in rows]
            lines.append(
                f"Instances owned: control {sizes['control']}, treatment {sizes['treatment']}"
                f" of {args.instances}; requests per model s and instance: separate runs"
                f" {rate / args.instances:.3f}, arms "
                + "; ".join(f"{c:.3f} / {t:.3f}" for c, t in loads)
                + "."
            )
        lines += [
            "",
            "| figure | separate runs | arms | separate runs' spread | arms - separate, each"
            " round [95 % interval] | rounds within |",
            "|---|---:|---:|---:|---|---:|",
        ]
        for key, _, ratio in FIGURES:
            alone = statistics.median(separate[key]) if separate[key] else None
            arms = statistics.median(between[key]) if between[key] else None
            cells, within = [], 0
            for row in rows:
                diff, interval = row["difference"][key], row["interval"][key]
                if diff is None or interval is None:
                    cells.append("-")
                    continue
                digits = 3 if ratio else 1
                cells.append(
                    f"{diff:+.{digits}f} [{interval[0]:+.{digits}f}, {interval[1]:+.{digits}f}]"
                )
                within += interval[0] <= 0 <= interval[1]

            def shown(value: float | None, ratio: bool = ratio) -> str:
                if value is None:
                    return "-"
                return f"{value:.3f}" if ratio else f"{value:+.1f}"

            noise = spread(separate[key], 3 if ratio else 1)
            lines.append(
                f"| {names[key]} | {shown(alone)} | {shown(arms)} | {noise} |"
                f" {'; '.join(cells)} | {within} of {len(rows)} |"
            )
        lines += [
            "",
            "The router's hit rates (attributed from the engines' counters, whole run) against"
            " the simulator's own counts (whole run):",
            "",
            "| round | control: attributed / true | treatment: attributed / true |",
            "|---|---|---|",
        ]
        for row in rows:
            cells = []
            for index, arm in enumerate(("control", "treatment")):
                rate_, error = row["attributed"][index], row["attributed_error"][index]
                true = row[arm]["whole_run_hit_rate"]
                shown_ = "-" if rate_ is None else f"{rate_ * 100:.1f} ± {error * 100:.1f} %"
                cells.append(f"{shown_} / {'-' if true is None else f'{true * 100:.1f} %'}")
            lines.append(f"| {row['round']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _variant(text: str) -> Variant:
    weights, _, split = text.partition(":")
    split = split.upper() or "KEYS"
    if split not in ("KEYS", "BACKENDS"):
        raise argparse.ArgumentTypeError("--ab is CONTROL,TREATMENT[:keys|backends]")
    return Variant(_weights(weights), split)


def _seeds(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("--seeds is a comma-separated list of ints") from None


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
    p.add_argument(
        "--ab",
        type=_variant,
        action="append",
        help="CONTROL,TREATMENT[:keys|backends], repeated: the experiments a round runs"
        " (default: --weights, keys)",
    )
    p.add_argument("--seeds", type=_seeds, help="a request stream per round (overrides --rounds)")
    p.add_argument("--resamples", type=int, default=400, help="bootstrap resamples")
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
