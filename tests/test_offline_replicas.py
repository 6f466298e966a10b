"""Offline benchmark with several routers (``loadtests/offline.py``, ``replicas``).

R uncoordinated routers, each with its own fleet, in-flight counts and
balancer, in front of the same simulated engines. Short simulations; the
simulation is deterministic, so every figure compared here is exact.
"""

from __future__ import annotations

import functools

import pytest

from loadtests import offline, report, workloads
from loadtests.offline import Outcome, simulate
from loadtests.workloads import FLEET, Request
from router.config import RoutingConfig, parse_routing

# The README's recommendation: its PREFILL scope takes a second lease per request.
TRAFFIC_PREFILL = {"BalanceMode": "TRAFFIC", "ConcurrencyScope": "PREFILL"}


def routing(**prefix: object) -> RoutingConfig:
    return parse_routing({"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": prefix})


@functools.cache
def long_run() -> list[Request]:
    # A minute at the calibrated load of 4 instances: ~240 requests.
    return workloads.build("long", seed=3, duration=60, rate=FLEET["long"].rate_for(4))


def run(replicas: int, *, seed: int = 1, split: bool = False, **prefix: object) -> Outcome:
    return simulate(
        long_run(),
        routing(**prefix),
        instances=4,
        params=FLEET["long"],
        seed=seed,
        replicas=replicas,
        split_threshold=split,
    )


def figures(outcome: Outcome) -> tuple[list[report.Sample], float | None, list[float] | None]:
    return outcome.run.samples, outcome.run.hit_rate, outcome.run.utilisation


@pytest.mark.parametrize("prefix", [{}, TRAFFIC_PREFILL], ids=["in-flight", "traffic-prefill"])
def test_one_replica_is_the_plain_simulation(prefix: dict[str, object]) -> None:
    plain = simulate(long_run(), routing(**prefix), instances=4, params=FLEET["long"], seed=1)
    one = run(1, **prefix)
    assert figures(one) == figures(plain)
    assert one.run.notes == plain.run.notes
    # Splitting the threshold over one router leaves it whole.
    assert figures(run(1, split=True, **prefix)) == figures(plain)
    assert one.fleets == [one.fleet]
    assert one.balancers == [one.balancer]
    # Two routers do change the run: the replicas are really used.
    assert figures(run(2, **prefix)) != figures(plain)


@pytest.mark.parametrize("prefix", [{}, TRAFFIC_PREFILL], ids=["in-flight", "traffic-prefill"])
def test_two_replicas_serve_everything_and_release_every_lease(
    prefix: dict[str, object],
) -> None:
    outcome = run(2, **prefix)
    requests = long_run()
    samples = outcome.run.samples
    assert len(samples) == len(requests)
    assert all(s.ok and s.instance in outcome.run.instances for s in samples)
    assert [s.at for s in samples] == [r.at for r in requests]
    assert len(outcome.fleets) == len(outcome.balancers) == 2
    routed = [sum(b.requests for b in f.backends.values()) for f in outcome.fleets]
    assert sum(routed) == len(requests)
    assert min(routed) > len(requests) // 4  # both routers took a fair part
    for fleet, balancer in zip(outcome.fleets, outcome.balancers, strict=True):
        assert balancer.fleet is fleet
        assert fleet.loads.total == 0
        assert not fleet.loads.counts
        assert fleet.waiting.total == 0
        assert not fleet.waiting.counts
    assert outcome.fleets[0] is not outcome.fleets[1]
    # Same specs, same ring: a key's first choice is the same on every router.
    assert outcome.fleets[0].ring == outcome.fleets[1].ring
    for engine in outcome.engines.values():
        assert engine.running == engine.waiting == 0
        assert engine.cache.pinned_blocks == 0
    assert "2 routers" in outcome.run.notes


def test_the_same_seed_gives_the_same_result() -> None:
    first, again = run(2, **TRAFFIC_PREFILL), run(2, **TRAFFIC_PREFILL)
    assert figures(first) == figures(again)
    assert [s.instance for s in first.run.samples] == [s.instance for s in again.run.samples]
    assert figures(run(2, seed=2, **TRAFFIC_PREFILL)) != figures(first)


def test_split_threshold_divides_it_rounding_up() -> None:
    outcome = run(4, split=True, ConcurrencyThreshold=10)
    for balancer in outcome.balancers:
        assert balancer.config.prefix_aware.concurrency_threshold == 3  # ceil(10 / 4)
    assert "ConcurrencyThreshold 10 split: 3 each" in outcome.run.notes
    assert all(
        b.config.prefix_aware.concurrency_threshold == 10 for b in run(4, split=False).balancers
    )


def test_cli_takes_replicas_and_refuses_zero(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "long", "--instances", "3", "--duration", "20", "--strategies", "prefix"]
    assert offline.main([*argv, "--replicas", "3", "--replica-threshold", "split"]) == 0
    out = capsys.readouterr().out
    assert "ConcurrencyThreshold 10 split: 4 each" in out
    assert offline.main([*argv, "--replicas", "0"]) == 2
    assert "--replicas" in capsys.readouterr().err
    with pytest.raises(ValueError, match="replicas"):
        run(0)
