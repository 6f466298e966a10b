"""What an A/B experiment (router.arms) shows: its views, their derived figures, merges.

Contract:
- The views are msgspec Structs: ``/admin/stats`` (``Stats.experiment``,
  without samples), ``GET /admin/ab`` (with each arm's TTFT sample) and
  ``prefix-router ab-report`` (several replicas' merged) encode and decode
  them.  They carry the counts and sums that add up across processes (an
  arm's requests, errors, repeats, per-backend requests; the hit-rate fit's
  normal equations) and its bottom-k TTFT sample, and ``derive`` computes the
  rest from those alone (shares, rates, percentiles, the fit, the test), so a
  view made by one process and one merged from R replicas are read the same.
- ``merge_views``: counts added up, samples merged (``router.abtest.merge``),
  the fit's sums added up; ValueError unless every view is of one experiment
  with the same arms.  Split BACKENDS: an arm's ``owns`` is the replicas'
  if they agree, else every backend any of them names.
- ``ArmCollector``: the ``prefix_router_arm_*`` families at scrape time, an
  ``arm`` label of at most ``MAX_ARMS`` values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .abtest import least_squares, mann_whitney, merge
from .metrics import percentile

if TYPE_CHECKING:
    from .app import Router

__all__ = [
    "SAMPLE",
    "TEST",
    "ArmCollector",
    "ArmView",
    "Attribution",
    "Comparison",
    "ExperimentView",
    "derive",
    "merge_views",
]

SAMPLE = 2048  # TTFTs kept per arm and process (bottom-k); merged, as many in all
ALPHA = 0.05
TEST = (
    "Mann-Whitney U, two-sided, normal approximation with tie and continuity corrections,"
    " on the TTFT samples of 2xx answers; each arm against the first, significant below"
    " alpha = 0.05 / (arms - 1) (Bonferroni)"
)


class Attribution(msgspec.Struct):
    """The hit-rate fit's normal equations (sums over cells: they add up across replicas)."""

    cells: int  # (backend, scrape round) pairs read
    xtx: list[list[float]]
    xty: list[float]
    yy: float


class ArmView(msgspec.Struct):
    name: str
    weight: float
    target_share: float  # weight / the weights' sum: the share of keys it is given
    routing: dict[str, Any]  # the arm's whole RoutingConfig (the top level and its fields)
    requests: int  # answered (or failed) since the experiment started here
    errors: int  # answered 5xx
    repeats: int  # sent where this process had sent the key before (router.cachecheck)
    backends: dict[str, int]  # requests per backend
    sample: list[tuple[float, float]]  # /admin/ab only: (priority, TTFT ms), bottom-k
    ttft_samples: int  # TTFTs in the sample the percentiles are read from
    since: float  # unix seconds: when these counts started (the earliest, merged)
    share: float = 0.0  # of the experiment's requests
    error_rate: float | None = None
    repeat_rate: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    prefix_cache_hit_rate: float | None = None  # the engines' counters, attributed
    prefix_cache_hit_rate_error: float | None = None  # its 95 % half-width under the model
    # Split BACKENDS (router.split): the backends it owns and routes over, by name;
    # None: it shares the fleet (Split KEYS, or the split suspended).
    owns: list[str] | None = None


class Comparison(msgspec.Struct):
    """An arm against the first arm (the control)."""

    arm: str
    baseline: str
    ttft_p50_change: float | None  # P50 of the arm / the baseline's - 1
    ttft_p90_change: float | None
    ttft_p99_change: float | None
    hit_rate_change: float | None  # in points (0.1: ten points more)
    u: float | None
    z: float | None  # < 0: the arm's TTFTs tend lower
    p_value: float | None
    effect: float | None  # P(the arm's TTFT > the baseline's): 0.5 for no difference
    alpha: float
    significant: bool | None  # None: too few samples to test
    p90_difference_ms: tuple[float, float] | None = None  # bootstrap 95 % interval (ab-report)


class ExperimentView(msgspec.Struct):
    experiment: str
    arms: list[ArmView]
    attribution: Attribution
    comparisons: list[Comparison] = msgspec.field(default_factory=list)
    test: str = TEST
    replicas: int = 1  # whose counts these are (ab-report merges several)
    split: str = "KEYS"  # what the arms divide: KEYS, or BACKENDS too (router.split)
    # BACKENDS with fewer backends than arms of weight above 0: every arm shares the fleet.
    split_suspended: bool = False


def derive(view: ExperimentView, values: Sequence[Sequence[float]]) -> ExperimentView:
    """Fill the derived fields of ``view`` from its counts and each arm's TTFT sample
    (``values``, in arm order); the same whether one process or a merge made them."""
    total = sum(arm.requests for arm in view.arms)
    attribution = view.attribution
    fit = least_squares(attribution.xtx, attribution.xty, attribution.yy, attribution.cells)
    for index, (arm, sample) in enumerate(zip(view.arms, values, strict=True)):
        arm.share = arm.requests / total if total else 0.0
        arm.error_rate = arm.errors / arm.requests if arm.requests else None
        arm.repeat_rate = arm.repeats / arm.requests if arm.requests else None
        arm.ttft_p50_ms = percentile(sample, 0.5)
        arm.ttft_p90_ms = percentile(sample, 0.9)
        arm.ttft_p99_ms = percentile(sample, 0.99)
        if fit is not None:
            rate, half_width = fit[0][index], fit[1][index]
            arm.prefix_cache_hit_rate = min(max(rate, 0.0), 1.0)
            arm.prefix_cache_hit_rate_error = half_width
    alpha = ALPHA / max(len(view.arms) - 1, 1)
    base, base_sample = view.arms[0], values[0]
    view.comparisons = []
    for arm, sample in zip(view.arms[1:], values[1:], strict=True):
        test = mann_whitney(sample, base_sample)
        view.comparisons.append(
            Comparison(
                arm=arm.name,
                baseline=base.name,
                ttft_p50_change=_change(arm.ttft_p50_ms, base.ttft_p50_ms),
                ttft_p90_change=_change(arm.ttft_p90_ms, base.ttft_p90_ms),
                ttft_p99_change=_change(arm.ttft_p99_ms, base.ttft_p99_ms),
                hit_rate_change=(
                    None
                    if arm.prefix_cache_hit_rate is None or base.prefix_cache_hit_rate is None
                    else arm.prefix_cache_hit_rate - base.prefix_cache_hit_rate
                ),
                u=None if test is None else test.u,
                z=None if test is None else test.z,
                p_value=None if test is None else test.p_value,
                effect=None if test is None else test.effect,
                alpha=alpha,
                significant=None if test is None else test.p_value < alpha,
            )
        )
    return view


def merge_views(views: Sequence[ExperimentView]) -> ExperimentView:
    """Several replicas' ``/admin/ab`` as one: counts added up, samples merged
    (bottom-k), the hit-rate fit's sums added up; ValueError if they do not run one
    experiment with the same arms."""
    first = views[0]
    names = [arm.name for arm in first.arms]
    for view in views[1:]:
        if view.experiment != first.experiment or [a.name for a in view.arms] != names:
            raise ValueError(
                f"not one experiment: {first.experiment!r} with arms {names} and"
                f" {view.experiment!r} with arms {[a.name for a in view.arms]}"
            )
    arms = []
    for index, arm in enumerate(first.arms):
        parts = [view.arms[index] for view in views]
        backends: dict[str, int] = {}
        for part in parts:
            for name, count in part.backends.items():
                backends[name] = backends.get(name, 0) + count
        sample = merge([part.sample for part in parts], SAMPLE)
        arms.append(
            ArmView(
                name=arm.name,
                weight=arm.weight,
                target_share=arm.target_share,
                routing=arm.routing,
                requests=sum(part.requests for part in parts),
                errors=sum(part.errors for part in parts),
                repeats=sum(part.repeats for part in parts),
                backends=dict(sorted(backends.items())),
                sample=sample,
                ttft_samples=len(sample),
                since=min(part.since for part in parts),
                owns=_agreed([part.owns for part in parts]),
            )
        )
    k = len(names)
    attribution = Attribution(
        sum(view.attribution.cells for view in views),
        [[sum(v.attribution.xtx[i][j] for v in views) for j in range(k)] for i in range(k)],
        [sum(view.attribution.xty[i] for view in views) for i in range(k)],
        sum(view.attribution.yy for view in views),
    )
    replicas = sum(view.replicas for view in views)
    merged = ExperimentView(
        first.experiment,
        arms,
        attribution,
        replicas=replicas,
        split=first.split,
        split_suspended=any(view.split_suspended for view in views),
    )
    return derive(merged, [[value for _, value in arm.sample] for arm in arms])


def _agreed(owns: Sequence[list[str] | None]) -> list[str] | None:
    """An arm's backends as the replicas say: theirs if they agree, else every one any
    of them names (their memberships differ for a moment: a change on its way)."""
    if all(each == owns[0] for each in owns):
        return owns[0]
    return sorted({name for each in owns if each is not None for name in each})


def _change(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return value / baseline - 1


class ArmCollector:
    """The per-arm families (``arm`` label: at most ``MAX_ARMS`` values), built at
    scrape time from the experiment's counts."""

    def __init__(self, router: Router):
        self._router = router

    def collect(self) -> Iterator[Metric]:
        experiment = self._router.balancer.arms
        requests = CounterMetricFamily(
            "prefix_router_arm_requests",
            "Requests of an A/B experiment's arm (keys assigned to it), answered or failed.",
            labels=["arm"],
        )
        errors = CounterMetricFamily(
            "prefix_router_arm_errors", "Requests of an arm answered 5xx.", labels=["arm"]
        )
        repeats = CounterMetricFamily(
            "prefix_router_arm_repeats",
            "Requests of an arm sent to a backend this process had sent their key to before.",
            labels=["arm"],
        )
        ttft = HistogramMetricFamily(
            "prefix_router_arm_ttft_seconds",
            "Time to first response byte of an arm's 2xx answers.",
            labels=["arm"],
        )
        weight = GaugeMetricFamily(
            "prefix_router_arm_weight_share",
            "An arm's share of the keys (its weight).",
            labels=["arm"],
        )
        hit_rate = GaugeMetricFamily(
            "prefix_router_arm_prefix_cache_hit_rate",
            "An arm's prefix-cache hit rate, the backends' counters attributed by"
            " least squares over (backend, scrape round) cells; absent while unknown.",
            labels=["arm"],
        )
        if experiment is not None:
            view = experiment.view()
            for arm, shown in zip(experiment.arms, view.arms, strict=True):
                stats = arm.stats
                requests.add_metric([arm.name], stats.requests)
                errors.add_metric([arm.name], stats.errors)
                repeats.add_metric([arm.name], stats.repeats)
                ttft.add_metric([arm.name], stats.ttft.cumulative(), stats.ttft.total)
                weight.add_metric([arm.name], shown.target_share)
                if shown.prefix_cache_hit_rate is not None:
                    hit_rate.add_metric([arm.name], shown.prefix_cache_hit_rate)
        yield from (requests, errors, repeats, ttft, weight, hit_rate)
