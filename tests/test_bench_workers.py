"""``loadtests.bench_workers``: its command line and its comparison, without a fleet.

The live figures it prints are a benchmark's (run it by hand); here only what
must hold on any machine: bad options refused, N workers compared with 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtests import bench_workers

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("ours", "theirs", "says"),
    [
        (["--workers", "2"], [], "including 1"),
        (["--workers", "1,1"], [], "distinct"),
        (["--workers", "1,x"], [], "distinct"),
        (["--repeat", "0"], [], "--repeat"),
        ([], ["--strategies", "prefix,sglang"], "peers have no workers: sglang"),
    ],
)
def test_bad_options_are_refused_with_the_reason(
    ours: list[str], theirs: list[str], says: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_workers", *ours, "--", *theirs],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert says in done.stderr


def test_bench_options_go_through_after_the_separator() -> None:
    workers, repeat, args = bench_workers.parse_args(
        ["--workers", "1,2", "--repeat", "2", "--", "--workload", "short", "--strategies",
         "prefix,prefix-traffic-prefill", "--out", "/tmp/x"]
    )  # fmt: skip
    assert (workers, repeat) == ([1, 2], 2)
    assert args.workload == "short"
    assert args.strategies == ["prefix", "prefix-traffic-prefill"]


def test_compare_gives_points_and_a_ratio() -> None:
    one = {"hit_rate": 0.94, "ttft_p90": 0.040, "max_share": 0.16}
    two = {"hit_rate": 0.84, "ttft_p90": 0.800, "max_share": 0.20}
    assert bench_workers.compare(one, two) == {
        "hit_points": -10.0,
        "p90_ratio": 20.0,
        "busiest_points": 4.0,
    }
    assert bench_workers.compare(one, {**two, "ttft_p90": None})["p90_ratio"] is None


def test_problems_keeps_warnings_and_lines_that_are_not_json() -> None:
    lines = [
        '{"event": "listening", "level": "info"}',
        '{"event": "BalanceMode TRAFFIC places keys per worker", "level": "warning"}',
        '{"a": 1}{"b": 2}',
        "",
    ]
    assert bench_workers.problems(lines) == lines[1:3]
