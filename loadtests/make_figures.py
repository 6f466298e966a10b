"""The figures in the README and RESULTS.md, drawn again from scratch: ``make figures``.

``python -m loadtests.make_figures [--out loadtests/figures] [--ladder PROXYBENCH_JSON]
[--duration 3600] [--instances 7] [--seed 1] [--only routing|replicas|ladder]``

Contract
--------
- Routing figures come from the offline simulator (``loadtests/offline.py``),
  which is deterministic: the same arguments give the same runs, so the
  committed PNGs can be checked by running this again. With the defaults they
  are the runs of RESULTS.md's "Offline, one model hour, 7 instances" table
  (``python -m loadtests.offline --workload W --instances 7 --duration 3600``,
  seed 1), and the tables printed on stdout are that table's rows.
- ``long``: RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE with the defaults
  and PREFIX_AWARE TRAFFIC PREFILL (the recommended setting) give
  ``long-hit_rate.png``, ``long-ttft_cdf.png`` and ``long-shares.png`` (the
  AWS share range shaded). ``sysprompt``: RANDOM, PREFIX_AWARE, PREFIX_AWARE
  PREFILL (ConcurrencyScope PREFILL alone: the hot spot) and PREFIX_AWARE
  TRAFFIC PREFILL (its hot-key replicas) give ``sysprompt-shares.png``.
- ``long-replicas.png`` (issue 12): ``long`` under the recommended setting
  with R = 1, 2, 4, 8 routers in front of the same instances, each router
  its own state or sharing it every 0.1 s (``offline --replicas R
  [--share-loads 0.1]``): hit rate and TTFT P90 against R, the rows of
  RESULTS.md's "Several routers, one routing state" table. R = 1 shares
  nothing whatever the flag, so it is run once.
- ``proxy_ladder.png`` is drawn from a saved ``loadtests/proxybench.py`` JSON
  (``--ladder``; by default the 2026-11-29 19:04 UTC run of RESULTS.md,
  transcribed next to the figures): the proxy's CPU per request on (a), (b),
  (c) and its memory per idle stream on (d), one panel each, for whatever
  targets and workloads the file holds.
- Plots are ``loadtests.report.plots``; colours and the PNG writer are ``loadtests.figstyle``'s,
  one per target in every figure. Nothing here measures anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.config import parse_routing

from . import report, workloads
from .figstyle import color, save
from .offline import markdown_with_notes, route_keys, simulate
from .workloads import FLEET

__all__ = [
    "DEFAULT_LADDER",
    "FIGURES",
    "Figures",
    "Setting",
    "ladder",
    "main",
    "replicas_figure",
    "routing_figures",
]

HERE = Path(__file__).resolve().parent / "figures"
DEFAULT_LADDER = HERE / "proxybench-20261129-1904.json"
# AWS's per-instance share range for PREFIX_AWARE on `long` (RESULTS.md, issue 5).
AWS_SHARE_RANGE = (13.3, 15.4)


@dataclass(frozen=True)
class Setting:
    """One routing target: its label and its RoutingConfig document."""

    label: str
    strategy: str
    prefix: dict[str, Any]  # PrefixAwareRoutingConfig fields


RANDOM = Setting("RANDOM", "RANDOM", {})
LEAST = Setting("LEAST_OUTSTANDING_REQUESTS", "LEAST_OUTSTANDING_REQUESTS", {})
# Explicit, not the defaults: the defaults became TRAFFIC + PREFILL after these
# figures were drawn, and the figures keep showing SageMaker's semantics.
SAGEMAKER = {"BalanceMode": "IN_FLIGHT", "ConcurrencyScope": "IN_FLIGHT"}
PREFIX = Setting("PREFIX_AWARE", "PREFIX_AWARE", SAGEMAKER)
PREFILL = Setting(
    "PREFIX_AWARE PREFILL",
    "PREFIX_AWARE",
    {"BalanceMode": "IN_FLIGHT", "ConcurrencyScope": "PREFILL"},
)
RECOMMENDED = Setting(
    "PREFIX_AWARE TRAFFIC PREFILL",
    "PREFIX_AWARE",
    {"BalanceMode": "TRAFFIC", "ConcurrencyScope": "PREFILL"},
)


@dataclass(frozen=True)
class Figures:
    """One workload's runs and which of ``report.plots``'s figures they make."""

    workload: str
    settings: tuple[Setting, ...]
    kinds: tuple[str, ...]
    share_band: tuple[float, float] | None = None


FIGURES = (
    Figures("long", (RANDOM, LEAST, PREFIX, RECOMMENDED), report.PLOT_KINDS, AWS_SHARE_RANGE),
    Figures("sysprompt", (RANDOM, PREFIX, PREFILL, RECOMMENDED), ("shares",)),
)


def routing_figures(
    out: Path, *, duration: float, instances: int, seed: int
) -> tuple[list[Path], str]:
    """Run ``FIGURES`` offline and plot them into ``out``; the paths and the tables."""
    written: list[Path] = []
    tables = []
    for figures in FIGURES:
        workload = figures.workload
        params = FLEET[workload]
        rate = params.rate_for(instances)
        requests = workloads.build(workload, seed=seed, duration=duration, rate=rate)
        runs = []
        hashes: dict[int, list[int]] = {}
        for setting in figures.settings:
            config = parse_routing(
                {
                    "RoutingStrategy": setting.strategy,
                    "PrefixAwareRoutingConfig": setting.prefix,
                }
            )
            length = config.prefix_aware.prefix_length
            if length not in hashes:
                hashes[length] = route_keys(requests, length)
            outcome = simulate(
                requests,
                config,
                instances=instances,
                params=params,
                seed=seed,
                hashes=hashes[length],
                target=setting.label,
            )
            runs.append(outcome.run)
            print(f"  {workload} {setting.label}: {outcome.wall_s:.1f} s", file=sys.stderr)
        title = (
            f"{workload} workload, {instances} instances, offline, "
            f"{duration:g} model s, seed {seed}"
        )
        written += report.plots(
            runs,
            out,
            prefix=f"{workload}-",
            title=title,
            kinds=figures.kinds,
            share_band=figures.share_band,
        )
        tables.append(f"### {workload}\n\n{markdown_with_notes(runs)}")
    return written, "\n".join(tables)


# ---------------------------------------------------------------- routers in front of one fleet

REPLICAS = (1, 2, 4, 8)
# The live in-flight publish period (README, "Several workers and replicas").
SHARE_PERIOD = 0.1
NOT_SHARED = "each router its own state"
SHARED = f"routers share state every {SHARE_PERIOD:g} s"


def _minor_label(value: float, _pos: object = None) -> str:
    """0.02, 0.03, 0.05, 0.2, ... on a log axis; the other minor ticks unlabelled."""
    digit = f"{value:.0e}"[0]
    return f"{value:g}" if digit in "235" else ""


def replicas_figure(
    out: Path, *, duration: float, instances: int, seed: int, replicas: Sequence[int] = REPLICAS
) -> tuple[Path, str]:
    """``long-replicas.png`` in ``out`` (see the module contract); its path and table."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    params = FLEET["long"]
    requests = workloads.build(
        "long", seed=seed, duration=duration, rate=params.rate_for(instances)
    )
    config = parse_routing(
        {"RoutingStrategy": RECOMMENDED.strategy, "PrefixAwareRoutingConfig": RECOMMENDED.prefix}
    )
    hashes = route_keys(requests, config.prefix_aware.prefix_length)
    figures: dict[str, list[tuple[int, dict[str, Any]]]] = {NOT_SHARED: [], SHARED: []}
    for count in replicas:
        for label, period in ((NOT_SHARED, None), (SHARED, SHARE_PERIOD)):
            if count == 1 and figures[NOT_SHARED]:  # one router: nothing to share
                figures[label].append(figures[NOT_SHARED][-1])
                continue
            outcome = simulate(
                requests,
                config,
                instances=instances,
                params=params,
                seed=seed,
                hashes=hashes,
                target=label,
                replicas=count,
                share_period=period,
            )
            figures[label].append((count, report.summarize(outcome.run)))
            print(f"  long {count} routers, {label}: {outcome.wall_s:.1f} s", file=sys.stderr)

    fig = Figure(figsize=(9, 3.9), layout="constrained")
    hit_ax, p90_ax = fig.subplots(1, 2)
    for label, points in figures.items():
        xs = [count for count, _ in points]
        style = {"color": color(label), "marker": "o", "lw": 1.6, "label": label}
        hit_ax.plot(xs, [100 * s["hit_rate"] for _, s in points], **style)
        p90_ax.plot(xs, [s["ttft_p90"] for _, s in points], **style)
    hit_ax.set_title("hit rate (share of prompt tokens)", fontsize=10)
    hit_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.4g} %"))
    p90_ax.set_title("TTFT P90 (s, log scale)", fontsize=10)
    p90_ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 0.05, 1 rather than 10^0
    p90_ax.yaxis.set_major_formatter(plain)
    p90_ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
    for ax in (hit_ax, p90_ax):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(list(replicas)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(plain)
        ax.set_xlabel("routers in front of the same instances")
        ax.grid(True, alpha=0.3)
        ax.set_axisbelow(True)
    fig.legend(*hit_ax.get_legend_handles_labels(), loc="outside lower center", ncols=2,
               frameon=False)  # fmt: skip
    fig.suptitle(
        f"Several routers, {RECOMMENDED.label} (the default)\n"
        f"long workload, {instances} instances, offline, {duration:g} model s, seed {seed}",
        fontsize=11,
    )
    path = save(fig, out / "long-replicas.png")
    lines = [
        "### long, R routers",
        "",
        f"| routers | {NOT_SHARED}: hit / P90 s | {SHARED}: hit / P90 s |",
        "|---|---|---|",
    ]
    for (count, alone), (_, shared) in zip(figures[NOT_SHARED], figures[SHARED], strict=True):
        cells = [f"{100 * s['hit_rate']:.1f} % / {s['ttft_p90']:.3f}" for s in (alone, shared)]
        lines.append(f"| {count} | {cells[0]} | {cells[1]} |")
    return path, "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the proxy ladder

# Panels: (workload, field, what it is); lower is better in every one.
_PANELS = (
    ("a", "cpu_us", "(a) chat, 4 KiB prompt", "proxy CPU per request (µs)"),
    ("b", "cpu_us", "(b) chat, streamed as 64 SSE events", "proxy CPU per request (µs)"),
    ("c", "cpu_us", "(c) native, 64 KiB body", "proxy CPU per request (µs)"),
    ("d", "kib_per_stream", "(d) idle SSE streams held open", "proxy memory per stream (KiB)"),
)
# Top to bottom: the C proxies, the Python ones (ours first), the Rust routers.
_ORDER = ("haproxy", "nginx", "prefix-router", "aiohttp", "vllm-ch", "sglang", "vllm-ca")


def ladder(source: Path, out: Path) -> Path:
    """``proxy_ladder.png`` in ``out`` from the proxybench JSON ``source``; its path."""
    from matplotlib.figure import Figure

    document = json.loads(Path(source).read_text())
    results: dict[str, Any] = document["results"]
    meta: dict[str, Any] = document.get("meta", {})
    names = [n for n in _ORDER if n in results]
    names += sorted(n for n in results if n not in names and results[n].get("kind") != "ceiling")
    panels = [
        panel
        for panel in _PANELS
        if any(results[n]["workloads"].get(panel[0], {}).get(panel[1]) is not None for n in names)
    ]
    if not panels:
        raise ValueError(f"{source}: no proxy CPU or memory figures to draw")
    rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(10, 1.0 + 2.6 * rows), layout="constrained")
    axes = fig.subplots(rows, 2 if len(panels) > 1 else 1, squeeze=False, sharey=True)
    labels = [results[n]["label"] for n in names]
    ys = list(range(len(names)))
    for ax, (workload, field, title, unit) in zip(axes.flat, panels, strict=False):
        values = [results[n]["workloads"].get(workload, {}) for n in names]
        top = max((row.get(field) or 0 for row in values), default=0) or 1
        for y, name, row in zip(ys, names, values, strict=True):
            label = results[name]["label"]
            value = row.get(field)
            if "invalid" in row:
                ax.text(
                    0, y, " not measured: answers 4xx", va="center", fontsize=8, color="#777777"
                )
            elif value is not None:
                ax.barh(y, value, color=color(label), height=0.7)
                ax.text(value + top * 0.01, y, f"{value:g}", va="center", fontsize=8,
                        weight="bold" if name == "prefix-router" else "normal")  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(unit)
        ax.set_xlim(0, top * 1.18)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    axes[0, 0].invert_yaxis()  # shared: the first target on top in every panel
    for ax in axes[:, 0]:
        ax.set_yticks(ys, labels)
        for tick, name in zip(ax.get_yticklabels(), names, strict=True):
            if name == "prefix-router":
                tick.set_fontweight("bold")
    when = meta.get("date", "")
    fig.suptitle(
        "Proxy ladder: the proxy's own cost, lower is better\n"
        f"{meta.get('command', 'proxybench')}, {when}; medians of the rounds, "
        "the proxy pinned to its own core",
        fontsize=11,
    )
    return save(fig, out / "proxy_ladder.png")


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.make_figures",
        description="Draw the committed figures again: offline routing runs and the proxy ladder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=HERE, help="where the PNGs go")
    p.add_argument("--ladder", type=Path, default=DEFAULT_LADDER, help="a proxybench JSON")
    p.add_argument("--duration", type=float, default=3600.0, help="model seconds of arrivals")
    p.add_argument("--instances", type=int, default=7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--only",
        choices=("routing", "replicas", "ladder"),
        default=None,
        help="draw one kind only (routing: the one-router figures; replicas: long-replicas.png)",
    )
    args = p.parse_args(argv)
    if args.instances < 1 or args.duration <= 0:
        p.error("--instances must be >= 1 and --duration > 0")
    started = time.perf_counter()
    written: list[Path] = []
    if args.only in (None, "routing"):
        paths, tables = routing_figures(
            args.out, duration=args.duration, instances=args.instances, seed=args.seed
        )
        written += paths
        print(tables)
    if args.only in (None, "replicas"):
        path, table = replicas_figure(
            args.out, duration=args.duration, instances=args.instances, seed=args.seed
        )
        written.append(path)
        print(table)
    if args.only in (None, "ladder"):
        written.append(ladder(args.ladder, args.out))
    for path in written:
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)", file=sys.stderr)
    print(f"done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
