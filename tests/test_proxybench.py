"""The proxy ladder (``python -m loadtests.proxybench``) and its fast backend, CI-sized.

One smoke run of the real command with no apt package and no peer: the fast
backends, direct, the aiohttp floor, prefix-router and prefix-router with 2
workers, workloads (a) and (b) for about a second each with our own
generator.  It checks that the run produces sane figures and tables, never
how fast anything was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.proxybench import measure, procfs, report, targets, workloads, wrk

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_smoke_run_produces_tables_with_sane_fields(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "loadtests.proxybench",
        "--targets", "direct,aiohttp,prefix-router,prefix-router-w2", "--workloads", "a,b",
        "--generator", "python", "--seconds", "0.5", "--warmup", "0",
        "--probe-seconds", "0.2", "--probe-rate", "200", "--probe-fraction", "0", "--pause", "0",
        "--ttfb-connections", "1", "--connections", "8", "--keys", "4", "--rounds", "1",
        "--results", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = tmp_path.glob("proxybench-*.json")
    doc = json.loads(path.read_text())
    assert doc["skipped"] == {}
    results = doc["results"]
    assert list(results) == ["direct", "aiohttp", "prefix-router", "prefix-router-w2"]
    for name, entry in results.items():
        for workload in ("a", "b"):
            row = entry["workloads"][workload]
            assert "error" not in row, (name, workload, row)
            assert "invalid" not in row, (name, workload, row)
            assert row["requests"] > 0
            assert row["errors"] == 0
            assert row["bad_status"] == 0
            assert sum(row["split"]) >= row["requests"]  # the backends saw every request
            [probe] = row["probes"]
            if probe.get("over_capacity"):
                # A machine busy enough that the closed loop got under 1.25x the
                # probe's rate: the bench then declines to probe, and says so.
                assert row["rps"] < probe["rate"] * 1.25, (name, workload, row)
            else:
                assert probe["requests"] > 0
                assert probe["p50_ms"] > 0
            if name == "direct":
                assert row["cpu_us"] is None
            else:
                assert row["cpu_us"] > 0
                assert row["rss_mib"] > 0
                assert all(n > 0 for n in row["split"])  # keys spread over both backends
        # (b) relays the whole stream: 64 chunks of about 160 bytes each
        assert entry["workloads"]["b"]["bytes_per_response"] > 64 * 100
    out = done.stdout
    assert "### (a) OpenAI chat, 4 KiB prompt, non-streaming" in out
    assert "### (b) OpenAI chat" in out
    for label in (
        "direct (no proxy)",
        "aiohttp floor",
        "prefix-router",
        "prefix-router, 2 workers",
    ):
        assert f"| {label} |" in out
    assert "(a) prefix-router:" in out  # a ratio line, even with no C or Rust target
    assert "| prefix-router, 2 workers | a |" in out  # the workers table
    # Both prefix-router targets stopped cleanly each round, with nothing logged above info.
    assert results["prefix-router"]["log_problems"] == []
    assert results["prefix-router-w2"]["log_problems"] == []


def test_workload_bodies_have_the_issue_sizes() -> None:
    chat = workloads.build_requests("a", 3)
    assert len({body for _, body in chat}) == 3
    for _, body in chat:
        request = json.loads(body)
        assert request["stream"] is False
        assert len(request["messages"][0]["content"]) == workloads.PREFIX
    streamed = json.loads(workloads.build_requests("b", 1)[0][1])
    assert streamed["stream"] is True
    [(_, native)] = workloads.build_requests("c", 1)
    assert len(native) == 64 * 1024
    json.loads(native)
    idle = workloads.build_requests("d", 1, " [[sse:1000:5000]]")[0][1]
    assert b"[[sse:1000:5000]]" in idle


def test_wrk_script_cycles_every_body_with_its_session() -> None:
    requests = workloads.build_requests("a", 2)
    script = wrk.wrk_script("/v1/chat/completions", requests)
    for session, body in requests:
        assert body.decode() in script
        assert f'"{session}"' in script
    assert 'wrk.format("POST", "/v1/chat/completions"' in script
    assert "PROXYBENCH" in script  # the summary line run_wrk parses


def test_process_tree_figures_of_this_process() -> None:
    me = os.getpid()
    assert me in procfs.process_tree(me)
    assert procfs.tree_cpu(me) > 0
    assert procfs.tree_rss(me) > 1 << 20


def test_report_ratios_and_checks_from_a_made_up_run() -> None:
    def row(rps: float, cpu: float | None) -> dict[str, object]:
        return {
            "requests": int(rps), "rps": rps, "request_mb_s": 1.0, "p50_ms": 1.0,
            "p99_ms": 2.0, "cpu_us": cpu, "proxy_core_pct": 50, "client_core_pct": 50,
            "others_core_pct": 0, "rss_mib": 10.0, "split": [1, 1], "errors": 0,
            "bad_status": 0, "probes": [],
        }  # fmt: skip

    def entry(label: str, kind: str, rps: float, cpu: float | None) -> dict[str, object]:
        return {"label": label, "kind": kind, "key": "k", "version": "v",
                "workloads": {"a": row(rps, cpu)}}  # fmt: skip

    results = {
        "direct": entry("direct (no proxy)", "ceiling", 1000, None),
        "haproxy": entry("HAProxy", "C", 800, 20.0),
        "vllm-ch": entry("vllm-router consistent_hash", "Rust", 400, 100.0),
        "prefix-router": entry("prefix-router", "Python", 500, 50.0),
    }
    lines = report.ratio_lines(results, ["a"])
    assert lines == [
        "(a) prefix-router: 50 µs/req = 2.50x best C (HAProxy, 20 µs/req), "
        "0.50x best Rust (vllm-router consistent_hash, 100 µs/req); "
        "500 req/s = 0.62x best C (HAProxy, 800), 1.25x best Rust "
        "(vllm-router consistent_hash, 400)"
    ]
    checks = report.target_checks(results)
    assert checks[0].startswith("- [x] (a) CPU/request 50 µs below the best Rust")
    assert checks[1].startswith("- [ ] (a) CPU/request 50 µs within 2x the best C")
    table = report.table("a", results)
    assert "| prefix-router | 500 | 0.50 |" in table


def test_combine_takes_medians_sums_and_peaks_and_leaves_single_runs() -> None:
    def run(rps: float, cpu: float, rss: float) -> dict[str, object]:
        return {
            "requests": int(rps), "rps": rps, "cpu_us": cpu, "rss_mib": rss, "errors": 1,
            "bad_status": 0, "split": [1, 2], "probes": [],
        }  # fmt: skip

    row = measure.combine([run(100, 30, 5), run(300, 10, 7), run(200, 20, 6)])
    assert row["rps"] == 200
    assert row["cpu_us"] == 20
    assert row["cpu_us_range"] == [10, 30]
    assert row["rss_mib"] == 7
    assert row["requests"] == 600
    assert row["errors"] == 3
    assert row["split"] == [3, 6]
    streams = {"streams": 10, "established": 10, "kib_per_stream": 4.0}
    assert measure.combine([streams]) == streams
    failed = {"error": "OSError: boom"}
    assert measure.combine([failed, failed]) == failed


def test_workers_table_compares_with_one_worker_of_the_same_run() -> None:
    def row(rps: float, cpu: float, per_round: list[tuple[float, float]]) -> dict[str, object]:
        return {
            "rps": rps, "cpu_us": cpu, "p50_ms": 1.0, "p99_ms": 4.0, "proxy_core_pct": 90,
            "per_round": [{"rps": r, "cpu_us": c} for r, c in per_round],
        }  # fmt: skip

    one = row(1000, 50.0, [(1000, 50.0), (800, 60.0)])
    two = row(1500, 55.0, [(1600, 52.0), (1000, 66.0)])
    results = {
        "prefix-router": {"label": "prefix-router", "workloads": {"a": one}},
        "prefix-router-w2": {"label": "prefix-router, 2 workers", "workloads": {"a": two}},
    }
    table = report.workers_table(results, ["a"])
    assert (
        "| prefix-router, 2 workers | a | 1,500 | 1.50x (per round 1.25-1.60) | 55.0 "
        "| 1.10x (per round 1.04-1.10) | 1.000 | 1.00x | 4.000 | 1.00x | 90 |"
    ) in table
    assert report.workers_table({"prefix-router": results["prefix-router"]}, ["a"]) == ""


def test_log_problems_keeps_warnings_errors_and_lines_that_are_not_json(tmp_path: Path) -> None:
    log = tmp_path / "prefix-router.log"
    log.write_text(
        '{"event": "listening", "level": "info"}\n'
        '{"event": "worker exited", "level": "warning"}\n'
        '{"event": "a", "level": "info"}{"event": "b", "level": "info"}\n'
        "\n"
        "Traceback (most recent call last):\n"
    )
    assert targets.log_problems(log) == [
        '{"event": "worker exited", "level": "warning"}',
        '{"event": "a", "level": "info"}{"event": "b", "level": "info"}',
        "Traceback (most recent call last):",
    ]
    assert targets.log_problems(tmp_path / "missing.log") == []
