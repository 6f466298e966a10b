"""A/B arms without a router: the config's shape, the assignment, the statistics.

The promises of ``router/arms.py`` and ``router/abtest.py`` held to their
definitions: arms get their weights' shares of keys, a key's arm depends on
nothing but the key and the config, a weight change moves keys only to or
from the arm whose weight changed (hypothesis), Mann-Whitney's U is the pair
count and its p-value the permutation test's, bottom-k samples merge exactly,
and the hit-rate attribution recovers the rates it was fed.  Each arm routes
with its own balancer over the one fleet's in-flight counts, and its TRAFFIC
placements travel between processes tagged with the arm.  The same through
the real daemon, workers and replicas: ``tests/test_ab_live.py``.
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import hash_key
from router.abreport import SAMPLE
from router.abtest import bootstrap_difference, least_squares, mann_whitney, merge
from router.arms import ArmStats, HitAttribution, arm_seed, rendezvous
from router.balancer import Balancer
from router.config import (
    BackendSpec,
    ConfigError,
    RoutingConfig,
    Strategy,
    build_config,
    parse_routing,
)
from router.fleet import Fleet
from router.state import State

KEYS = [hash_key(b"conversation %d" % i) for i in range(20_000)]


def experiment(*arms: tuple[str, float, dict[str, Any]], name: str = "e1", **top: Any) -> Any:
    return {
        **top,
        "Experiment": name,
        "Arms": [
            {"Name": arm, "Weight": weight, "RoutingConfig": routing}
            for arm, weight, routing in arms
        ],
    }


AB = experiment(("control", 90, {"RoutingStrategy": "RANDOM"}), ("prefix", 10, {}))


# -- the config --------------------------------------------------------------------------


def test_an_experiment_document_comes_back_as_given_and_arms_inherit_the_top_level() -> None:
    document = {
        "RoutingConfig": {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {
                "PrefixLength": 8192,
                "ConcurrencyThreshold": 10,
                "BalanceFactor": 1.5,
                "BalanceMode": "TRAFFIC",
                "ConcurrencyScope": "PREFILL",
                "SessionKeys": ["header", "prefix"],
                "SessionHeader": "X-Chat",
            },
            "Experiment": "pa-rollout",
            "Arms": [
                {"Name": "control", "Weight": 90.0, "RoutingConfig": {"RoutingStrategy": "RANDOM"}},
                {
                    "Name": "prefix",
                    "Weight": 10.0,
                    "RoutingConfig": {
                        "PrefixAwareRoutingConfig": {
                            "ConcurrencyThreshold": 4,
                            "BalanceFactor": None,
                        }
                    },
                },
            ],
        }
    }
    routing = parse_routing(document)
    assert routing.document() == document
    control, prefix = routing.arm_configs()
    assert control.strategy is Strategy.RANDOM
    assert control.prefix_aware == routing.prefix_aware  # everything else: the top level's
    assert prefix.strategy is Strategy.PREFIX_AWARE
    assert prefix.prefix_aware.concurrency_threshold == 4
    assert prefix.prefix_aware.balance_factor is None  # null in an arm turns it off
    assert prefix.prefix_aware.prefix_length == 8192
    assert not control.arms
    assert not prefix.arms


def test_a_config_without_arms_is_written_as_before() -> None:
    """No Arms: the document and the state file have no new keys, so a version without
    experiments reads them (its structs forbid unknown fields)."""
    assert set(RoutingConfig().document()["RoutingConfig"]) == {
        "RoutingStrategy",
        "PrefixAwareRoutingConfig",
    }
    saved = msgspec.json.decode(msgspec.json.encode(State(1, [], RoutingConfig())))
    assert set(saved["RoutingConfig"]) <= {"RoutingStrategy", "PrefixAwareRoutingConfig"}
    with_arms = msgspec.json.encode(State(1, [], parse_routing(AB)))
    assert msgspec.json.decode(with_arms, type=State).routing == parse_routing(AB)


@pytest.mark.parametrize(
    ("routing", "words"),
    [
        ({"Experiment": "e1"}, "give Arms too"),
        ({"Arms": AB["Arms"]}, "Arms need an Experiment id"),
        (experiment(("a", 1, {})), "2 or more"),
        (experiment(("a", 1, {}), ("a", 1, {})), "a name of its own"),
        (experiment(("a", 0, {}), ("b", 0, {})), "Weight above 0"),
        (experiment(("a", -1, {}), ("b", 1, {})), ">= 0.0"),
        (
            experiment(
                ("a", 1, {}), ("b", 1, {"PrefixAwareRoutingConfig": {"PrefixLength": 2048}})
            ),
            "arm 'b': PrefixLength is the experiment's",
        ),
        (
            experiment(
                ("a", 1, {"PrefixAwareRoutingConfig": {"SessionKeys": ["prefix"]}}), ("b", 1, {})
            ),
            "arm 'a': SessionKeys is the experiment's",
        ),
        (experiment(("a", 1, {"Arms": []}), ("b", 1, {})), "unknown field `Arms`"),
        (experiment(("a b", 1, {}), ("c", 1, {})), "Name"),
        (
            experiment(*((f"a{i}", 1, {}) for i in range(9))),
            "length <= 8",
        ),
        (
            experiment(
                ("a", 1, {"PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 0}}), ("b", 1, {})
            ),
            "ConcurrencyThreshold",
        ),
    ],
)
def test_a_bad_experiment_is_refused_naming_what_is_wrong(routing: Any, words: str) -> None:
    with pytest.raises(ConfigError, match="RoutingConfig") as caught:
        parse_routing(routing)
    assert words in str(caught.value)
    with pytest.raises(ConfigError):  # a config file's, the same
        build_config({"RoutingConfig": routing})


def test_an_arm_may_repeat_the_experiments_key_fields() -> None:
    """A whole SageMaker config pasted into an arm is fine while its key fields agree."""
    same = {"PrefixAwareRoutingConfig": {"PrefixLength": 4096, "ConcurrencyThreshold": 3}}
    routing = parse_routing(experiment(("a", 1, {}), ("b", 1, same)))
    assert routing.arm_configs()[1].prefix_aware.concurrency_threshold == 3


@pytest.mark.parametrize(
    ("split", "said"),
    [("", ","), ('Split = "BACKENDS"\n', ", each arm on backends of its own,")],
)
def test_check_config_names_the_experiment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], split: str, said: str
) -> None:
    from admin.cli import main

    path = tmp_path / "ab.toml"
    path.write_text(
        f'[RoutingConfig]\nRoutingStrategy = "PREFIX_AWARE"\nExperiment = "pa-1"\n{split}'
        '[[RoutingConfig.Arms]]\nName = "control"\nWeight = 90\n'
        'RoutingConfig = {RoutingStrategy = "LEAST_OUTSTANDING_REQUESTS"}\n'
        '[[RoutingConfig.Arms]]\nName = "prefix"\nWeight = 10\n'
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        f"experiment pa-1 (control 90 LEAST_OUTSTANDING_REQUESTS, prefix 10 PREFIX_AWARE){said}"
        in out
    )


# -- the assignment ------------------------------------------------------------------------


def assignments(names: list[str], weights: list[float], experiment_id: str = "e1") -> list[str]:
    seeds = [arm_seed(experiment_id, name) for name in names]
    return [names[rendezvous(key, seeds, weights)] for key in KEYS]


def test_arms_get_their_weights_share_of_keys_whatever_their_order() -> None:
    arms = assignments(["control", "prefix"], [90, 10])
    share = arms.count("prefix") / len(arms)
    # 20,000 keys: the binomial's standard deviation is 0.2 points; 1 point is 5 of them.
    assert abs(share - 0.10) < 0.01
    assert assignments(["prefix", "control"], [10, 90]) == arms
    three = assignments(["a", "b", "c"], [1, 2, 0])
    assert "c" not in three  # weight 0: paused
    assert abs(three.count("b") / len(three) - 2 / 3) < 0.01


def test_an_experiment_assigns_as_the_rule_says() -> None:
    routing = parse_routing(experiment(("a", 3, {}), ("b", 0, {}), ("c", 1.5, {})))
    arms = Balancer(fleet(), routing).arms
    assert arms is not None
    seeds = [arm_seed("e1", name) for name in "abc"]
    for key in KEYS[:2000]:
        assert arms.assign(key).name == "abc"[rendezvous(key, seeds, [3, 0, 1.5])]


def test_a_weight_change_moves_only_the_keys_the_new_shares_need() -> None:
    before = assignments(["control", "prefix"], [90, 10])
    after = assignments(["control", "prefix"], [80, 20])
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert set(moved) == {("control", "prefix")}  # none the other way
    assert abs(len(moved) / len(KEYS) - 0.10) < 0.01  # the minimum: 10 points of keys
    # A new arm takes keys from each, and no key moves between the old ones.
    three = assignments(["control", "prefix", "new"], [80, 20, 25])
    assert {(a, b) for a, b in zip(after, three, strict=True) if a != b} <= {
        ("control", "new"),
        ("prefix", "new"),
    }


def test_a_new_experiment_id_draws_the_keys_afresh() -> None:
    one = assignments(["a", "b"], [1, 1], "first")
    two = assignments(["a", "b"], [1, 1], "second")
    agree = sum(x == y for x, y in zip(one, two, strict=True)) / len(KEYS)
    assert abs(agree - 0.5) < 0.02  # independent draws agree half the time at 50/50


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 100), min_size=2, max_size=5),
    changed=st.integers(0, 4),
    new_weight=st.integers(0, 100),
)
def test_changing_one_arms_weight_moves_keys_only_to_or_from_it(
    weights: list[int], changed: int, new_weight: int
) -> None:
    changed %= len(weights)
    names = [f"arm{i}" for i in range(len(weights))]
    seeds = [arm_seed("p", name) for name in names]
    after = list(weights)
    after[changed] = new_weight
    if not any(after):
        return
    for key in KEYS[:500]:
        a, b = rendezvous(key, seeds, weights), rendezvous(key, seeds, after)
        assert a == b or changed in (a, b)


# -- the statistics ---------------------------------------------------------------------


def test_mann_whitney_u_is_the_pair_count_and_its_p_value_the_permutation_tests() -> None:
    rng = random.Random(7)
    a = [round(rng.gauss(100, 20)) for _ in range(25)]  # rounded: ties
    b = [round(rng.gauss(108, 20)) for _ in range(30)]  # p ~ 0.1: one-sided would be 0.05
    test = mann_whitney(a, b)
    assert test is not None
    pairs = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    assert test.u == pairs
    assert test.effect == pytest.approx(pairs / (len(a) * len(b)))
    assert test.z < 0  # a tends lower
    # The two-sided permutation test, by a seeded Monte Carlo of 20,000 relabellings
    # (its own error about 0.002 at p = 0.1): the normal approximation within 0.015.
    pooled = sorted(a + b)
    # Relabelling the pooled values: U is a random subset's rank sum less its minimum.
    ranks = [
        (pooled.index(v) + len(pooled) - pooled[::-1].index(v)) / 2 for v in pooled
    ]  # mid-ranks (1-based means of tied positions)
    extreme = abs(pairs - len(a) * len(b) / 2)
    hits = 0
    for _ in range(20_000):
        u = sum(rng.sample(ranks, len(a))) - len(a) * (len(a) + 1) / 2
        hits += abs(u - len(a) * len(b) / 2) >= extreme
    assert test.p_value == pytest.approx(hits / 20_000, abs=0.015)
    same = mann_whitney([5.0] * 30, [5.0] * 30)
    assert same is not None
    assert same.p_value == 1.0
    assert mann_whitney(a[:19], b) is None  # too few to test


def test_bottom_k_samples_merge_into_the_sample_of_the_union() -> None:
    rng = random.Random(3)
    everything = [(rng.random(), float(i)) for i in range(10_000)]
    parts = [everything[i::3] for i in range(3)]
    kept = [sorted(part)[:SAMPLE] for part in parts]
    assert merge(kept, SAMPLE) == sorted(everything)[:SAMPLE]
    stats = [ArmStats(), ArmStats()]
    for i, value in enumerate(range(6000)):
        stats[i % 2]._keep(rng.random(), float(value))
    merged = ArmStats()
    for part in stats:
        merged.absorb(part.report("e", "a"))
    assert sorted(merged.sample()) == merge([s.sample() for s in stats], SAMPLE)
    assert len(merged.sample()) == SAMPLE


def test_least_squares_recovers_the_coefficients_or_says_it_cannot() -> None:
    rng = random.Random(5)
    xtx = [[0.0, 0.0], [0.0, 0.0]]
    xty, yy = [0.0, 0.0], 0.0
    for _ in range(200):
        x = [rng.uniform(0, 1000), rng.uniform(0, 1000)]
        y = 0.3 * x[0] + 0.9 * x[1] + rng.gauss(0, 20)
        for i in range(2):
            xty[i] += x[i] * y
            for j in range(2):
                xtx[i][j] += x[i] * x[j]
        yy += y * y
    fit = least_squares(xtx, xty, yy, 200)
    assert fit is not None
    (r0, r1), (e0, e1) = fit
    assert abs(r0 - 0.3) < e0 < 0.05
    assert abs(r1 - 0.9) < e1 < 0.05
    collinear = [[1.0, 2.0], [2.0, 4.0]]
    assert least_squares(collinear, [1.0, 2.0], 1.0, 50) is None
    assert least_squares(xtx, xty, yy, 3) is None  # fewer rows than it needs


def test_the_hit_rate_attribution_recovers_each_arms_rate_from_backend_counters() -> None:
    """Synthetic engines: per round, each backend gets some of each arm's requests, and
    its hit tokens are each arm's rate times its tokens there (plus the requests' own
    randomness); the fit over the cells finds the rates back."""
    rng = random.Random(11)
    rates = (0.25, 0.9)
    attribution = HitAttribution(2)
    hits = dict.fromkeys("xyz", 0.0)
    queries = dict.fromkeys("xyz", 0.0)
    sent = {name: [0, 0] for name in "xyz"}
    for _ in range(60):
        for name in "xyz":
            for arm, rate in enumerate(rates):
                for _ in range(rng.randrange(0, 8)):
                    tokens = rng.randrange(500, 3000)
                    sent[name][arm] += tokens * 4  # ~4 bytes a token
                    queries[name] += tokens
                    hits[name] += tokens if rng.random() < rate else 0
            attribution.round(name, hits[name], queries[name], (sent[name][0], sent[name][1]))
    view = attribution.view()
    fit = least_squares(view.xtx, view.xty, view.yy, view.cells)
    assert fit is not None
    for rate, found, half_width in zip(rates, *fit, strict=True):
        assert abs(found - rate) < max(half_width, 0.02) < 0.15
    # A counter that went down (an engine restarted): no cell, a new base.
    cells = attribution.cells
    attribution.round("x", 0.0, 0.0, (sent["x"][0], sent["x"][1]))
    assert attribution.cells == cells


def test_bootstrap_intervals_are_seeded_and_cover_a_known_shift() -> None:
    rng = random.Random(2)
    a = [rng.expovariate(1 / 100) for _ in range(400)]
    b = [x + 50 for x in a]
    one = bootstrap_difference(a, b, 0.9, rounds=300)
    assert one == bootstrap_difference(a, b, 0.9, rounds=300)
    assert one is not None
    assert one[0] <= 50 <= one[1]


# -- arms over one fleet ---------------------------------------------------------------------


def fleet(count: int = 3) -> Fleet:
    return Fleet([BackendSpec(f"b{i}", f"http://127.0.0.1:{9000 + i}") for i in range(count)])


def arms_config(*arms: tuple[str, float, dict[str, Any]], name: str = "e1") -> RoutingConfig:
    return parse_routing(experiment(*arms, name=name))


def test_each_arm_routes_by_its_config_and_bounds_on_the_fleets_counts() -> None:
    members = fleet()
    routing = arms_config(
        ("control", 1, {"RoutingStrategy": "RANDOM"}),
        (
            "prefix",
            1,
            {
                "PrefixAwareRoutingConfig": {
                    "ConcurrencyThreshold": 1,
                    "BalanceMode": "IN_FLIGHT",
                    "ConcurrencyScope": "IN_FLIGHT",
                }
            },
        ),
    )
    balancer = Balancer(members, routing, seed=1)
    experiment_ = balancer.arms
    assert experiment_ is not None
    control, prefix = experiment_.arms
    prefix_keys = [k for k in KEYS[:200] if experiment_.assign(k) is prefix]
    control_keys = [k for k in KEYS[:200] if experiment_.assign(k) is control]
    first_control = control.balancer.choose(control_keys[0])
    assert first_control is not None
    assert first_control.decision == "random"
    first_control.release()
    # The control arm's lease counts where the prefix arm bounds: a prefix key whose
    # first backend holds the control's request overflows (threshold 1).
    key = prefix_keys[0]
    first = next(iter(members.ring.walk(key)))
    held = []
    while members.loads.get(first) == 0:
        choice = control.balancer.choose(control_keys[len(held) + 1])
        assert choice is not None
        held.append(choice)
    choice = prefix.balancer.choose(key)
    assert choice is not None
    assert (choice.backend.name, choice.decision) != (first, "primary")
    for lease in [*held, choice]:
        lease.release()
    assert members.loads.total == 0


def test_a_config_change_keeps_arms_by_name_and_a_new_experiment_counts_afresh() -> None:
    members = fleet()
    balancer = Balancer(members, arms_config(("a", 1, {}), ("b", 1, {})), seed=1)
    assert balancer.arms is not None
    a, b = balancer.arms.arms
    a.stats.requests = 7
    balancer.configure(arms_config(("a", 3, {}), ("b", 1, {"RoutingStrategy": "RANDOM"})))
    assert balancer.arms.arms[0] is a
    assert a.stats.requests == 7
    assert a.weight == 3
    assert b.balancer.config.strategy is Strategy.RANDOM
    balancer.configure(arms_config(("a", 1, {}), ("c", 1, {}), name="e2"))
    assert balancer.arms.arms[0] is a
    assert a.stats.requests == 0
    assert b.retired
    balancer.configure(RoutingConfig())
    assert balancer.arms is None
    assert a.retired


def test_an_arms_traffic_placement_travels_between_processes_tagged_with_the_arm() -> None:
    """Two processes (workers, replicas) with the same experiment: a new key placed by
    one's TRAFFIC arm reaches the other's same arm, and only it."""
    routing = arms_config(("control", 1, {"RoutingStrategy": "RANDOM"}), ("prefix", 1, {}))
    one, two = (Balancer(fleet(), routing, seed=i) for i in (1, 2))
    one.share_placement(1)
    two.share_placement(2)
    assert one.arms is not None
    assert two.arms is not None
    key = next(k for k in KEYS if one.arms.assign(k).name == "prefix")
    choice = one.arms.arms[1].balancer.choose(key)
    assert choice is not None
    records = one.publish_records()
    assert {record.pool for record in records} == {"arm prefix"}
    two.apply_records(records)
    placement = two.arms.arms[1].balancer.placement_of()
    assert placement is not None
    assert placement.home(key) == choice.backend.name
    root = two.placement_of()
    assert root is not None
    assert root.home(key) is None
    choice.release()


def test_hit_rate_cells_need_a_baseline_and_skip_restarts() -> None:
    attribution = HitAttribution(2)
    attribution.round("x", 100.0, 1000.0, (10, 10))
    assert attribution.cells == 0  # the first round is the baseline
    attribution.round("x", 600.0, 2000.0, (1010, 10))
    assert attribution.cells == 1
    assert attribution.xty[0] == pytest.approx(1000.0 * 500.0)
    attribution.round("x", 700.0, 2500.0, (5, 5))  # a worker restarted: its bytes went down
    assert attribution.cells == 1
    assert not any(math.isnan(v) for v in itertools.chain(*attribution.xtx))
