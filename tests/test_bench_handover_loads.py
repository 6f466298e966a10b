"""``loadtests.bench_handover_loads``: one tiny run of the real command, and its summary.

The live figures it prints are a benchmark's (run it by hand, README of
``loadtests``); here only what must hold on any machine: the run ends, writes
each round's fields within their ranges and prints its table; the summary of
given samples is exact.  Never how many requests went past the bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.bench_handover_loads import Sample, summarise, table

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_a_tiny_run_writes_sane_rounds_and_the_table(tmp_path: Path) -> None:
    out = tmp_path / "rounds.json"
    command = [
        sys.executable, "-m", "loadtests.bench_handover_loads",
        "--rounds", "1", "--threshold", "1", "--documents", "2", "--stream-s", "0.3",
        "--warmup-s", "0.5", "--time-scale", "0.1", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["rounds"]) == ["after"]  # one tree (the table: below)
    for label, rounds in doc["rounds"].items():
        [r] = rounds
        assert r["tree"] == str(ROOT), label
        assert r["old_exit"] == 0, label  # the old router drained and exited
        assert r["drain_s"] >= 0
        assert 0 <= r["failed"] <= r["drain_requests"]
        assert 0 <= r["past_bound"] <= r["drain_requests"]
        assert set(r["peaks"]) <= {"sim-0", "sim-1", "sim-2"}
        assert r["peak"] == max(r["peaks"].values(), default=0)
        assert r["warm_peak"] <= 3  # 3 clients (3 T) in all
        assert r["peak"] <= 3
    assert "python -m loadtests.bench_handover_loads --rounds 1" in done.stdout
    assert "drain requests that arrived at an instance already at T:" in done.stdout


def test_the_table_compares_the_two_trees_row_by_row() -> None:
    before: dict[str, float | None] = {"peak": 6, "warm_peak": 4, "past_bound": 8}
    after: dict[str, float | None] = {"peak": 5, "warm_peak": 4, "past_bound": 0}
    before["drain_requests"], after["drain_requests"] = 15, 16
    for key in ("ttft_p50_ms", "ttft_p90_ms", "drain_s", "failed"):
        before[key] = after[key] = None
    lines = table(before, after).splitlines()
    assert lines[0] == "| median over rounds | before | after | after/before |"
    assert "| peak in flight on an instance, drain | 6 | 5 | 0.83 |" in lines
    assert "| drain requests that arrived at an instance already at T | 8 | 0 | 0.00 |" in lines


def test_summary_counts_the_drain_requests_past_the_bound() -> None:
    samples = [
        Sample(0.5, "a", 2, 0.01, True),  # warm-up, first half: not counted
        Sample(1.5, "a", 3, 0.01, True),  # warm-up, second half
        Sample(2.0, "a", 2, 0.010, True),  # drain
        Sample(2.1, "a", 4, 0.020, True),  # drain, arrived with 3 already there
        Sample(2.2, "b", 3, 0.030, True),  # drain, at the bound: itself the 3rd
        Sample(2.3, "b", 0, None, False),  # drain, failed
        Sample(3.0, "b", 9, 0.5, True),  # after the drain
    ]
    r = summarise(samples, 3, warm=(1.0, 2.0), drain=(2.0, 3.0))
    assert r == {
        "drain_s": 1.0,
        "drain_requests": 4,
        "failed": 1,
        "peak": 4,
        "peaks": {"a": 4, "b": 3},
        "warm_peak": 3,
        "past_bound": 1,
        "ttft_p50_ms": 20.0,
        "ttft_p90_ms": 30.0,
    }
