"""``prefix-router ab-report``: an A/B experiment's arms side by side, and whether they differ.

Contract:
- Reads ``GET /admin/ab`` of one router, or of every replica given
  (``--admin`` repeated), and merges them (``router.abreport.merge_views``:
  counts added up, TTFT samples merged bottom-k, the hit-rate fit's sums
  added up), so R replicas report as one experiment.
- Prints per arm its weight, requests and share, 5xx errors, TTFT
  P50/P90/P99 (nearest rank, over the merged sample), the attributed
  prefix-cache hit rate (± its 95 % half-width) and the repeat rate; then
  each arm against the first: the changes, the Mann-Whitney U test
  (``router.abreport.TEST`` says which) and a percentile-bootstrap 95 %
  interval of the P90 difference (``--bootstrap`` resamples, seeded: run
  twice, the same interval).  ``--json``: the merged view (samples left out).
  Under Split BACKENDS (router.split) a line names each arm's own backends.
- Exit status: 0 reported, 1 an admin API answered an error (404: no
  experiment) or the replicas run different experiments, 2 bad arguments or
  an admin API that cannot be reached.  Blocking stdlib HTTP: a command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

import msgspec

from router.abreport import ExperimentView, merge_views
from router.abtest import bootstrap_difference
from router.config import ConfigError

from .auth import load_token

__all__ = ["add_parser", "render", "run"]


def add_parser(sub: Any) -> None:
    report = sub.add_parser(
        "ab-report",
        help="an A/B experiment's arms side by side, with a significance test (GET /admin/ab)",
    )
    report.add_argument(
        "--admin",
        action="append",
        metavar="URL",
        help="an admin API (repeat for each replica; default http://127.0.0.1:9091)",
    )
    report.add_argument("--admin-token-file", metavar="FILE")
    report.add_argument(
        "--bootstrap", type=int, default=1000, metavar="N", help="resamples of the P90 interval"
    )
    report.add_argument("--json", action="store_true", help="print the merged view as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        token = load_token(args.admin_token_file, os.environ)
    except (ConfigError, OSError) as exc:
        print(f"prefix-router ab-report: {exc}", file=sys.stderr)
        return 2
    if args.bootstrap < 0:
        print("prefix-router ab-report: --bootstrap must be 0 or more", file=sys.stderr)
        return 2
    views = []
    for url in args.admin or ["http://127.0.0.1:9091"]:
        request = urllib.request.Request(
            f"{url.rstrip('/')}/admin/ab",
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                views.append(msgspec.json.decode(response.read(), type=ExperimentView))
        except urllib.error.HTTPError as exc:
            error = json.loads(exc.read() or b"{}").get("error", {})
            print(f"{url}: {exc.code}: {error.get('message', exc.reason)}", file=sys.stderr)
            return 1
        except (urllib.error.URLError, OSError, msgspec.DecodeError) as exc:
            print(f"prefix-router ab-report: cannot read {url}: {exc}", file=sys.stderr)
            return 2
    try:
        view = merge_views(views)
    except ValueError as exc:
        print(f"prefix-router ab-report: {exc}", file=sys.stderr)
        return 1
    if args.bootstrap:
        base = [value for _, value in view.arms[0].sample]
        for arm, comparison in zip(view.arms[1:], view.comparisons, strict=True):
            sample = [value for _, value in arm.sample]
            comparison.p90_difference_ms = bootstrap_difference(
                base, sample, 0.9, rounds=args.bootstrap
            )
    for arm in view.arms:
        arm.sample = []
    if args.json:
        print(json.dumps(msgspec.to_builtins(view), indent=2))
    else:
        print(render(view, args.bootstrap))
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def _percent(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.0f} %" if signed else f"{value * 100:.1f} %"


def render(view: ExperimentView, rounds: int) -> str:
    """The report for people (see the contract)."""
    since = min(arm.since for arm in view.arms)
    started = datetime.datetime.fromtimestamp(since, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    replicas = f"{view.replicas} replica{'s' if view.replicas > 1 else ''}"
    lines = [
        f"experiment {view.experiment}: {len(view.arms)} arms, {replicas}, since {started} UTC"
    ]
    header = (
        "arm", "weight", "requests", "share", "5xx", "TTFT P50", "P90", "P99", "hit rate", "repeats"
    )  # fmt: skip
    rows = [header]
    for arm in view.arms:
        rate = arm.prefix_cache_hit_rate
        hit = "-" if rate is None else f"{rate * 100:.1f} %"
        if rate is not None and arm.prefix_cache_hit_rate_error is not None:
            hit += f" ± {arm.prefix_cache_hit_rate_error * 100:.1f}"
        rows.append(
            (
                arm.name,
                f"{arm.weight:g} ({arm.target_share * 100:.0f} %)",
                f"{arm.requests:,}",
                _percent(arm.share),
                f"{arm.errors:,}",
                _ms(arm.ttft_p50_ms),
                _ms(arm.ttft_p90_ms),
                _ms(arm.ttft_p99_ms),
                hit,
                _percent(arm.repeat_rate),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        padded = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
        padded[0] = row[0].ljust(widths[0])
        lines.append("  ".join(padded).rstrip())
    if view.split_suspended:
        lines.append("Split BACKENDS suspended: fewer backends than arms, every arm shares them")
    elif view.split == "BACKENDS":  # router.split: the arms share no backend
        owned = "; ".join(f"{arm.name} {', '.join(arm.owns or ())}" for arm in view.arms)
        lines.append(f"Split BACKENDS, each arm on its own: {owned}")
    for c in view.comparisons:
        changes = (
            f"TTFT P50 {_percent(c.ttft_p50_change, True)},"
            f" P90 {_percent(c.ttft_p90_change, True)}, P99 {_percent(c.ttft_p99_change, True)}"
        )
        if c.hit_rate_change is not None:
            changes += f"; hit rate {c.hit_rate_change * 100:+.1f} points"
        lines.append(f"{c.arm} against {c.baseline}: {changes}")
        if c.p_value is None:
            lines.append("  Mann-Whitney U: too few TTFTs in a sample to test (20 each at least)")
        else:
            verdict = "significant" if c.significant else "not significant"
            lines.append(
                f"  Mann-Whitney U = {c.u:,.0f}, z = {c.z:.2f}, p = {c.p_value:.2g}:"
                f" {verdict} at alpha {c.alpha:g}; P({c.arm}'s TTFT > {c.baseline}'s)"
                f" = {c.effect:.2f}"
            )
        if c.p90_difference_ms is not None:
            low, high = c.p90_difference_ms
            lines.append(
                f"  P90 difference ({c.arm} - {c.baseline}): 95 % bootstrap interval"
                f" [{low:,.1f}, {high:,.1f}] ms ({rounds:,} resamples)"
            )
    rounds_read = view.attribution.cells
    lines.append(
        f"hit rates: the backends' prefix-cache counters over {rounds_read:,} (backend, scrape"
        " round) cells, attributed to the arms by least squares (README: A/B on live traffic)"
    )
    lines.append(f"test: {view.test}")
    return "\n".join(lines)
