"""Offline benchmark (loadtests/offline.py) and reports (loadtests/report.py).

Short simulations (a minute of model time or less) through the router's real
balancer and the simulator's real engine. Asserts orderings that follow from
how routing works, never wall-clock figures.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from loadtests import offline, report, workloads
from loadtests.offline import simulate
from loadtests.report import Run, Sample
from loadtests.workloads import FLEET, Request
from router.config import RoutingConfig, parse_routing
from tests.harness.routers import SAGEMAKER


def routing(strategy: str, **prefix: object) -> RoutingConfig:
    return parse_routing({"RoutingStrategy": strategy, "PrefixAwareRoutingConfig": prefix})


@functools.cache
def long_minute() -> list[Request]:
    # Five minutes at the calibrated load of 4 instances: ~1,200 requests over
    # 1,000 Zipf-popular documents, enough repeats to tell routing apart.
    return workloads.build("long", seed=1, duration=300, rate=FLEET["long"].rate_for(4))


@functools.cache
def long_runs() -> dict[str, offline.Outcome]:
    return {
        strategy: simulate(
            long_minute(), routing(strategy), instances=4, params=FLEET["long"], seed=1
        )
        for strategy in ("RANDOM", "PREFIX_AWARE")
    }


def test_prefix_aware_hits_more_than_random_on_long() -> None:
    runs = long_runs()
    prefix, rand = runs["PREFIX_AWARE"].run, runs["RANDOM"].run
    assert prefix.hit_rate is not None
    assert rand.hit_rate is not None
    assert prefix.hit_rate > rand.hit_rate
    # Cached prefills are short: TTFT follows the hit rate.
    p50 = {name: report.summarize(o.run)["ttft_p50"] for name, o in runs.items()}
    assert p50["PREFIX_AWARE"] < p50["RANDOM"]
    # Same document, same instance: every primary pick of a group lands on one instance.
    placement: dict[str, set[str | None]] = {}
    for s in prefix.samples:
        if s.decision == "primary":
            placement.setdefault(s.group, set()).add(s.instance)
    assert len(placement) > 300
    assert all(len(where) == 1 for where in placement.values())


def test_every_request_is_served_and_every_lease_and_block_released() -> None:
    for outcome in long_runs().values():
        run = outcome.run
        assert len(run.samples) == len(long_minute())
        assert all(s.ok and s.instance in run.instances for s in run.samples)
        assert outcome.fleet.loads.total == 0
        assert not outcome.fleet.loads.counts
        assert sum(b.requests for b in outcome.fleet.backends.values()) == len(run.samples)
        for engine in outcome.engines.values():
            assert engine.running == engine.waiting == 0
            assert engine.cache.pinned_blocks == 0
            assert engine.stats.finished == sum(
                1 for s in run.samples if outcome.engines[s.instance] is engine
            )


def test_samples_are_consistent_with_the_engines() -> None:
    outcome = long_runs()["RANDOM"]
    run = outcome.run
    queries = sum(e.cache.queries for e in outcome.engines.values())
    assert sum(s.prompt_tokens for s in run.samples) == queries
    assert sum(s.cached_tokens for s in run.samples) == sum(
        e.cache.hits for e in outcome.engines.values()
    )
    for s, request in zip(run.samples, long_minute(), strict=True):
        assert s.at == request.at
        assert s.group == request.group
        assert s.output_tokens == request.max_tokens
        assert s.ttft is not None
        assert s.latency is not None
        assert 0 < s.ttft <= s.latency
        assert s.decision == "random"
    assert run.duration >= max(s.at + (s.latency or 0) for s in run.samples)
    assert run.utilisation is not None
    assert all(0 < u < 1 for u in run.utilisation)


def test_same_inputs_same_results() -> None:
    again = simulate(
        long_minute(), routing("PREFIX_AWARE"), instances=4, params=FLEET["long"], seed=1
    )
    assert again.run == long_runs()["PREFIX_AWARE"].run


def test_native_form_routes_by_the_same_shared_part() -> None:
    requests = long_minute()[:400]
    chat = simulate(requests, routing("PREFIX_AWARE"), instances=4, params=FLEET["long"])
    native = simulate(
        requests, routing("PREFIX_AWARE"), instances=4, params=FLEET["long"], form="native"
    )
    for run in (chat.run, native.run):
        groups: dict[str, set[str | None]] = {}
        for s in run.samples:
            if s.decision == "primary":
                groups.setdefault(s.group, set()).add(s.instance)
        assert len(groups) > 100
        assert all(len(where) == 1 for where in groups.values())
    # Different key bytes (raw JSON vs extracted text): a different placement.
    assert [s.instance for s in chat.run.samples] != [s.instance for s in native.run.samples]


def test_a_concurrency_threshold_of_one_overflows_a_hot_prefix() -> None:
    requests = workloads.build("sysprompt", seed=1, duration=20, rate=10)
    params = FLEET["sysprompt"]
    # SageMaker's semantics: the threshold alone spreads a hot prefix (BalanceMode
    # TRAFFIC, the default, also serves it from several instances below it).
    tight = simulate(
        requests,
        routing("PREFIX_AWARE", ConcurrencyThreshold=1, **SAGEMAKER),
        instances=4,
        params=params,
    )
    loose = simulate(
        requests,
        routing("PREFIX_AWARE", ConcurrencyThreshold=1024, **SAGEMAKER),
        instances=4,
        params=params,
    )
    tight_summary, loose_summary = report.summarize(tight.run), report.summarize(loose.run)
    assert tight_summary["overflow_rate"] > 0
    assert loose_summary["overflow_rate"] == loose_summary["fallback_rate"] == 0
    assert loose_summary["max_share"] == 1  # one key, no bound: one instance takes it all
    assert tight_summary["max_share"] < 1
    assert sum(b.overflow for b in tight.fleet.backends.values()) > 0
    assert tight.fleet.loads.total == 0


def test_markdown_lists_every_target_and_the_deltas() -> None:
    runs = [o.run for o in long_runs().values()]
    least = simulate(
        long_minute()[:200],
        routing("LEAST_OUTSTANDING_REQUESTS"),
        instances=4,
        params=FLEET["long"],
        target="LEAST_OUTSTANDING_REQUESTS",
    ).run
    text = report.markdown([*runs, least])
    for target in ("RANDOM", "PREFIX_AWARE", "LEAST_OUTSTANDING_REQUESTS"):
        assert f"| {target} |" in text
    assert "Change against RANDOM" in text
    delta = next(
        line for line in text.splitlines() if line.startswith("| PREFIX_AWARE") and "→" in line
    )
    assert delta.count("%") >= 4
    # Without the baseline, only the first table.
    assert "Change against" not in report.markdown([least])


def test_json_round_trips(tmp_path: Path) -> None:
    runs = [o.run for o in long_runs().values()]
    runs.append(
        Run(
            "live thing",
            [
                Sample(1.0, None, False, None, None),
                Sample(2.0, "a", True, 0.5, 1.5, 3, "overflow 2"),
            ],
            duration=3.0,
            instances=["a", "b"],
            hit_rate=None,
        )
    )
    path = tmp_path / "out" / "runs.json"
    meta = {"workload": "long", "seed": 1}
    report.write_json(runs, path, meta=meta)
    back, back_meta = report.read_json(path)
    assert back == runs
    assert back_meta == meta
    saved = json.loads(path.read_text())
    assert saved["runs"][0]["summary"] == json.loads(json.dumps(report.summarize(runs[0])))


# ---------------------------------------------------------------- report arithmetic


def test_summary_arithmetic() -> None:
    samples = [
        Sample(0.0, "a", True, 1.0, 2.0, 10, "primary"),
        Sample(1.0, "a", True, 2.0, 3.0, 10, "overflow 1"),
        Sample(2.0, "b", True, 3.0, 4.0, 10, "fallback"),
        Sample(3.0, None, False, None, None, 0, None),
    ]
    s = report.summarize(Run("X", samples, duration=10.0, instances=["a", "b", "c"], hit_rate=0.5))
    assert s["requests"] == 4
    assert s["ok"] == 3
    assert s["success_rate"] == 0.75
    assert s["ttft_p50"] == 2.0
    assert s["ttft_p90"] == 3.0  # nearest rank: the ceil(0.9 * 3) = 3rd smallest
    assert s["requests_per_s"] == 0.3
    assert s["output_tokens_per_s"] == 3.0
    assert s["shares"] == [2 / 3, 1 / 3, 0.0]
    assert s["min_share"] == 0.0
    assert s["overflow_rate"] == s["fallback_rate"] == pytest.approx(1 / 3)
    assert report.percentile([], 0.5) is None
    assert report.percentile([4.0], 0.99) == 4.0


def test_percentile_is_the_nearest_rank() -> None:
    """One definition for /admin/stats and every loadtests table: the ceil(q n)-th smallest."""
    values = [float(v) for v in range(10, 0, -1)]  # 10 .. 1, any order
    got = [report.percentile(values, q) for q in (0, 0.1, 0.5, 0.7, 0.9, 0.91, 1)]
    assert got == [1.0, 1.0, 5.0, 7.0, 9.0, 10.0, 10.0]  # 0.7 * 10 is 7.000000000000001
    assert report.percentile([1.0, 2.0], 0.5) == 1.0  # an observed value, never 1.5
    with pytest.raises(ValueError, match="q must be in"):
        report.percentile(values, 50)


def test_hit_rate_series_windows_by_send_time() -> None:
    samples = [
        Sample(0.5, "a", True, 0.1, 0.2, prompt_tokens=100, cached_tokens=0),
        Sample(1.5, "a", True, 0.1, 0.2, prompt_tokens=100, cached_tokens=80),
        Sample(1.7, "a", True, 0.1, 0.2, prompt_tokens=100, cached_tokens=100),
        Sample(3.2, "a", False, None, None),
    ]
    assert report.hit_rate_series(samples, 1.0) == [(1.0, 0.0), (2.0, 0.9)]


def test_since_keeps_the_samples_and_windows_after_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = [Sample(float(t), "a" if t < 5 else "b", True, t / 10, 1.0) for t in range(10)]
    series = [(2.0, 0.1), (4.0, 0.3), (6.0, 0.8), (8.0, 0.9), (10.0, 1.0)]
    run = Run("X", samples, 10.0, ["a", "b"], hit_rate=0.6, hit_rate_series=series)
    warm = report.since(run, 5.0)
    assert [s.at for s in warm.samples] == [5.0, 6.0, 7.0, 8.0, 9.0]
    # Windows of 2 s: the one ending at 6 began before second 5.
    assert warm.hit_rate_series == [(8.0, 0.9), (10.0, 1.0)]
    assert warm.hit_rate == pytest.approx(0.95)
    assert warm.duration == 5.0
    assert report.summarize(warm)["shares"] == [0.0, 1.0]
    path = tmp_path / "results.json"
    report.write_json([run], path, meta={"command": "bench X"})
    report.main([str(path), "--since", "5"])
    out = capsys.readouterr().out
    assert out.startswith("from second 5 of bench X")
    assert "| X | 5 | 100.0 % | 0.700 |" in out  # five samples, TTFT P50 0.7


def test_cli_prints_the_table_and_writes_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", "tenants", "--instances", "3", "--duration", "10", "--rate", "5"]
    argv += ["--strategies", "random,prefix", "--concurrency-threshold", "4", "--out"]
    assert offline.main([*argv, str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| RANDOM |" in out
    assert "| PREFIX_AWARE |" in out
    runs, meta = report.read_json(tmp_path / "offline-tenants.json")
    assert [r.target for r in runs] == ["RANDOM", "PREFIX_AWARE"]
    assert (
        meta["routing"][1]["RoutingConfig"]["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"] == 4
    )
    assert all(math.isclose(sum(report.summarize(r)["shares"]), 1) for r in runs)
    pytest.importorskip("matplotlib")
    assert len(list(tmp_path.glob("offline-tenants-*.png"))) == 3


def test_cli_refuses_out_of_range_routing(capsys: pytest.CaptureFixture[str]) -> None:
    assert offline.main(["--concurrency-threshold", "0", "--duration", "1"]) == 2
    assert "ConcurrencyThreshold" in capsys.readouterr().err
