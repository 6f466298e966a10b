"""Results of a benchmark run, summarised, tabulated, saved and plotted.

Contract
--------
- Shared by the offline simulator (``loadtests/offline.py``, times in model
  seconds) and the live benchmark (``loadtests/bench.py``, real seconds): both
  build one ``Run`` per routing target out of ``Sample``s and hand them here.
  Nothing here measures anything or reads a clock.
- ``summarize(run)`` is the one place numbers are derived, so the table, the
  JSON and the plots always agree. Percentiles are the project's one
  definition, nearest rank (``router.metrics.percentile``: the ceil(q * n)-th
  smallest), over the successful samples that have the value. Shares are per
  instance, in ``run.instances`` order, over the samples that reached an
  instance, so an idle instance shows 0 %.
- ``markdown(runs)`` prints one table of every run, then the deltas against
  the baseline run in the form of AWS's comparison: P50/P90 TTFT change,
  cache hit rate "a → b", throughput change.
- ``write_json`` / ``read_json`` round-trip runs exactly (samples included,
  as rows under a field list), with the summaries and a ``meta`` dict beside.
- ``plots`` needs matplotlib (imported on call, Agg backend, no pyplot state);
  everything else is standard library.
- ``since(run, start)`` is the same run from ``start`` on (samples sent at or
  after it, the mean of the hit-rate windows wholly after it, the duration
  left): the
  steady state of a run that began with cold caches. ``python -m
  loadtests.report RESULTS_JSON --since 300`` prints its table.
- Decisions are the router's labels: ``primary``, ``overflow`` (``overflow 2``
  in access logs counts too), ``fallback``, ``random``, ``least_outstanding``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from router.metrics import percentile

__all__ = [
    "Run",
    "Sample",
    "hit_rate_series",
    "markdown",
    "percentile",
    "plots",
    "read_json",
    "since",
    "summarize",
    "write_json",
]


@dataclass(slots=True)
class Sample:
    """One request as the client saw it (times in seconds from the start of the load)."""

    at: float  # when it was sent
    instance: str | None  # who answered (None: it never reached one)
    ok: bool
    ttft: float | None  # time to first token (or first byte)
    latency: float | None  # time to the last byte
    output_tokens: int = 0
    decision: str | None = None  # the router's decision label, when known
    group: str = ""  # the workload's shared-prefix id
    prompt_tokens: int = 0  # as the instance counted them (0: unknown)
    cached_tokens: int = 0  # prompt tokens served from the instance's prefix cache


@dataclass
class Run:
    """Every sample of one routing target on one workload."""

    target: str  # "RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE", ...
    samples: list[Sample]
    duration: float  # seconds the load ran, for throughput
    instances: list[str]  # every instance, so idle ones show 0 %
    hit_rate: float | None  # prefix-cache hits / queries in tokens, from the instances
    hit_rate_series: list[tuple[float, float]] = field(default_factory=list)  # (t, hit rate)
    notes: str = ""
    # Per instance, in ``instances`` order: the share of ``duration`` it spent
    # computing (prefill, the serialised resource), when the harness knows it.
    utilisation: list[float] | None = None


# ---------------------------------------------------------------- numbers


def hit_rate_series(samples: Iterable[Sample], window: float) -> list[tuple[float, float]]:
    """Token hit rate per ``window`` seconds of send time, from the samples' token counts.

    Each point is (window end, cached / prompt tokens); windows without prompt
    tokens are left out.
    """
    if window <= 0:
        raise ValueError("window must be > 0")
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    for sample in samples:
        if sample.prompt_tokens:
            slot = int(sample.at // window)
            prompt[slot] = prompt.get(slot, 0) + sample.prompt_tokens
            cached[slot] = cached.get(slot, 0) + sample.cached_tokens
    return [((slot + 1) * window, cached[slot] / prompt[slot]) for slot in sorted(prompt)]


def _is(decision: str | None, name: str) -> bool:
    return decision is not None and (decision == name or decision.startswith(name + " "))


def summarize(run: Run) -> dict[str, Any]:
    """Every figure the table, the JSON and the plots use (see the module contract)."""
    samples = run.samples
    ok = [s for s in samples if s.ok]
    ttfts = sorted(s.ttft for s in ok if s.ttft is not None)
    latencies = sorted(s.latency for s in ok if s.latency is not None)
    counts = dict.fromkeys(run.instances, 0)
    for s in samples:
        if s.instance is not None:
            counts[s.instance] = counts.get(s.instance, 0) + 1
    routed = sum(counts.values())
    shares = [counts[name] / routed if routed else 0.0 for name in counts]
    decided = [s.decision for s in samples if s.decision is not None]
    duration = run.duration if run.duration > 0 else math.nan
    out: dict[str, Any] = {
        "target": run.target,
        "requests": len(samples),
        "ok": len(ok),
        "success_rate": len(ok) / len(samples) if samples else None,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else None,
        "latency_p50": percentile(latencies, 0.5),
        "latency_p90": percentile(latencies, 0.9),
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / duration,
        "hit_rate": run.hit_rate,
        "instances": list(counts),
        "shares": shares,
        "max_share": max(shares) if shares else None,
        "min_share": min(shares) if shares else None,
        "overflow_rate": (
            sum(_is(d, "overflow") for d in decided) / len(decided) if decided else None
        ),
        "fallback_rate": (
            sum(_is(d, "fallback") for d in decided) / len(decided) if decided else None
        ),
        "utilisation_mean": None,
        "utilisation_max": None,
    }
    if run.utilisation:
        out["utilisation_mean"] = sum(run.utilisation) / len(run.utilisation)
        out["utilisation_max"] = max(run.utilisation)
    return out


def since(run: Run, start: float) -> Run:
    """The run from ``start`` seconds on (see the module contract)."""
    points = run.hit_rate_series
    window = points[1][0] - points[0][0] if len(points) > 1 else 0.0
    series = [(t, h) for t, h in points if t - window >= start]  # windows wholly after it
    return Run(
        target=run.target,
        samples=[s for s in run.samples if s.at >= start],
        duration=max(run.duration - start, 0.0),
        instances=run.instances,
        # The instances' own counters are cumulative: only their windows can be cut.
        hit_rate=sum(h for _, h in series) / len(series) if series else None,
        hit_rate_series=series,
        notes=run.notes,
        utilisation=None,  # measured over the whole run only
    )


# ---------------------------------------------------------------- markdown

NONE = "n/a"
EN_DASH = "\u2013"  # share ranges, "13.9<EN DASH>14.7 %", as AWS prints them


def _seconds(value: float | None) -> str:
    return NONE if value is None else f"{value:.3f}"


def _pct(value: float | None, digits: int = 1) -> str:
    return NONE if value is None else f"{100 * value:.{digits}f} %"


def _change(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0 or math.isnan(old) or math.isnan(new):
        return NONE
    return f"{100 * (new - old) / old:+.1f} %"


def markdown(runs: list[Run], *, baseline: str = "RANDOM") -> str:
    """A table of every run, then the changes against ``baseline`` (if it is among them)."""
    summaries = [summarize(run) for run in runs]
    util = any(s["utilisation_mean"] is not None for s in summaries)
    head = [
        "target", "requests", "ok", "TTFT P50 s", "TTFT P90 s", "TTFT P99 s",
        "latency P50 s", "latency P90 s", "req/s", "out tok/s", "hit rate",
        "share range", "overflow", "fallback",
    ]  # fmt: skip
    if util:
        head.append("busy mean / max")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        share = (
            NONE
            if s["min_share"] is None
            else f"{100 * s['min_share']:.1f}{EN_DASH}{100 * s['max_share']:.1f} %"
        )
        row = [
            s["target"], str(s["requests"]), _pct(s["success_rate"]),
            _seconds(s["ttft_p50"]), _seconds(s["ttft_p90"]), _seconds(s["ttft_p99"]),
            _seconds(s["latency_p50"]), _seconds(s["latency_p90"]),
            f"{s['requests_per_s']:.2f}", f"{s['output_tokens_per_s']:.0f}",
            _pct(s["hit_rate"]), share, _pct(s["overflow_rate"]), _pct(s["fallback_rate"]),
        ]  # fmt: skip
        if util:
            mean, most = s["utilisation_mean"], s["utilisation_max"]
            row.append(NONE if mean is None else f"{100 * mean:.0f} / {100 * most:.0f} %")
        lines.append("| " + " | ".join(row) + " |")
    base = next((s for s in summaries if s["target"] == baseline), None)
    others = [s for s in summaries if s is not base]
    if base is not None and others:
        lines += [
            "",
            f"Change against {baseline}:",
            "",
            "| target | P50 TTFT | P90 TTFT | cache hit rate | throughput |",
            "|---|---|---|---|---|",
        ]
        for s in others:
            hit = f"{_pct(base['hit_rate'], 0)} → {_pct(s['hit_rate'], 0)}"
            row = [
                s["target"],
                _change(s["ttft_p50"], base["ttft_p50"]),
                _change(s["ttft_p90"], base["ttft_p90"]),
                hit,
                _change(s["output_tokens_per_s"], base["output_tokens_per_s"]),
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- JSON

_SAMPLE_FIELDS = [f.name for f in fields(Sample)]


def write_json(runs: list[Run], path: Path, *, meta: dict[str, Any]) -> None:
    """Runs (samples as rows under ``sample_fields``), their summaries, and ``meta``."""
    document = {
        "meta": meta,
        "sample_fields": _SAMPLE_FIELDS,
        "runs": [
            {
                "target": run.target,
                "duration": run.duration,
                "instances": run.instances,
                "hit_rate": run.hit_rate,
                "hit_rate_series": [list(point) for point in run.hit_rate_series],
                "notes": run.notes,
                "utilisation": run.utilisation,
                "summary": summarize(run),
                "samples": [list(asdict(s).values()) for s in run.samples],
            }
            for run in runs
        ],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, separators=(",", ":")) + "\n")


def read_json(path: Path) -> tuple[list[Run], dict[str, Any]]:
    """The runs and the meta dict that ``write_json`` wrote."""
    document = json.loads(Path(path).read_text())
    names = document["sample_fields"]
    runs = [
        Run(
            target=item["target"],
            samples=[Sample(**dict(zip(names, row, strict=True))) for row in item["samples"]],
            duration=item["duration"],
            instances=item["instances"],
            hit_rate=item["hit_rate"],
            hit_rate_series=[(t, h) for t, h in item["hit_rate_series"]],
            notes=item["notes"],
            utilisation=item.get("utilisation"),
        )
        for item in document["runs"]
    ]
    return runs, document["meta"]


# ---------------------------------------------------------------- plots


PLOT_KINDS = ("ttft_cdf", "shares", "hit_rate")


def plots(
    runs: list[Run],
    out_dir: Path,
    *,
    prefix: str = "",
    title: str = "",
    kinds: Sequence[str] = PLOT_KINDS,
    share_band: tuple[float, float] | None = None,
) -> list[Path]:
    """TTFT CDFs, per-instance shares and hit rate over time, one PNG each; their paths.

    ``kinds`` picks among ``PLOT_KINDS``; ``title`` (the workload, the fleet)
    follows each figure's own title; ``share_band`` shades a target range of
    shares, in percent. Colours and the PNG writer are ``loadtests.figstyle``'s:
    a target has one colour in every figure, and the same runs give the same
    bytes.
    """
    # Figure directly, no pyplot: no global state and no GUI backend.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    from .figstyle import color, save

    unknown = set(kinds) - set(PLOT_KINDS)
    if unknown:
        raise ValueError(f"unknown plot kinds {sorted(unknown)}; known: {PLOT_KINDS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    suffix = f"\n{title}" if title else ""

    def seconds(value: float, _pos: object = None) -> str:
        return f"{value:g}"  # 0.03, 0.1, 1, 10 rather than 10^-1

    def percent(value: float, _pos: object = None) -> str:
        return f"{value:.4g} %"  # as the tables print them: "14.3 %"

    def finish(fig: Figure, name: str, title: str, xlabel: str, ylabel: str) -> None:
        """Labels, percent ticks on y, the legend, and the PNG."""
        ax = fig.axes[0]
        ax.set_title(title + suffix)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.yaxis.set_major_formatter(FuncFormatter(percent))
        ax.set_axisbelow(True)
        # Below the axes, outside them: a legend never hides a curve. Two
        # columns hold the longest labels ("LEAST_OUTSTANDING_REQUESTS") at 7 in.
        entries = len(ax.get_legend_handles_labels()[1])
        longest = max((len(run.target) for run in runs), default=0)
        ncols = min(entries, 3 if longest <= 20 else 2) or 1
        fig.legend(loc="outside lower center", ncols=ncols, frameon=False)
        written.append(save(fig, out_dir / f"{prefix}{name}.png"))

    if "ttft_cdf" in kinds:
        fig = Figure(figsize=(7, 4.6), layout="constrained")
        ax = fig.add_subplot()
        for run in runs:
            ttfts = sorted(s.ttft for s in run.samples if s.ok and s.ttft is not None)
            if ttfts:
                n = len(ttfts)
                ys = [100 * (i + 1) / n for i in range(n)]
                ax.step(ttfts, ys, where="post", label=run.target, color=color(run.target), lw=1.6)
        for q in (50, 90):
            ax.axhline(q, color="#bbbbbb", linewidth=0.8, linestyle=":", zorder=0)
            ax.annotate(f"P{q}", (0, q), xycoords=("axes fraction", "data"), xytext=(3, 2),
                        textcoords="offset points", fontsize=8, color="#777777")  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(seconds))
        ax.set_ylim(0, 100.5)
        ax.grid(True, which="major", alpha=0.3)
        finish(fig, "ttft_cdf", "TTFT, cumulative: further left is faster",
               "time to first token (s, log scale)", "requests with TTFT at most x")  # fmt: skip

    if "shares" in kinds:
        names = runs[0].instances if runs else []
        fig = Figure(figsize=(min(max(7.0, 0.45 * len(names)), 24.0), 4.6), layout="constrained")
        ax = fig.add_subplot()
        width = 0.8 / max(len(runs), 1)
        top = 0.0
        for k, run in enumerate(runs):
            shares = [100 * s for s in summarize(run)["shares"]]
            top = max([top, *shares])
            xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(shares))]
            ax.bar(xs, shares, width=width, label=run.target, color=color(run.target))
        if names:
            fair = 100 / len(names)
            ax.axhline(fair, color="black", linestyle="--", linewidth=1,
                       label=f"fair share ({fair:.1f} %)")  # fmt: skip
        if share_band is not None:
            low, high = share_band
            ax.axhspan(low, high, color="#2ca02c", alpha=0.15, linewidth=0, zorder=0,
                       label=f"target range {low:g}{EN_DASH}{high:g} %")  # fmt: skip
        if len(names) <= 16:
            ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, top * 1.08 or 1.0)
        ax.yaxis.set_major_locator(MaxNLocator(steps=[1, 2, 2.5, 5, 10]))
        ax.grid(True, axis="y", alpha=0.3)
        finish(fig, "shares", "Requests per instance", "instance", "share of requests")

    if "hit_rate" in kinds:
        fig = Figure(figsize=(7, 4.6), layout="constrained")
        ax = fig.add_subplot()
        window = None
        for run in runs:
            points = run.hit_rate_series
            if points:
                if len(points) > 1:
                    window = points[1][0] - points[0][0]
                ax.plot([t for t, _ in points], [100 * h for _, h in points],
                        label=run.target, color=color(run.target), lw=1.6)  # fmt: skip
        ax.set_ylim(0, 100)
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        per = f", per {window:.3g} s window" if window else ""
        finish(fig, "hit_rate", f"Hit rate over time{per}", "time since the load began (s)",
               "prefix-cache hits (share of prompt tokens)")  # fmt: skip
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.report", description="Re-print a saved run's tables."
    )
    parser.add_argument("results", type=Path, help="a results.json of bench or offline")
    parser.add_argument("--since", type=float, default=0.0, help="from this second on")
    args = parser.parse_args(argv)
    runs, meta = read_json(args.results)
    if args.since:
        runs = [since(run, args.since) for run in runs]
        print(f"from second {args.since:g} of {meta.get('command', args.results)}\n")
    print(markdown(runs))


if __name__ == "__main__":
    main()
