"""The figures command (loadtests/make_figures.py) on a tiny input.

Runs the documented command itself (``python -m loadtests.make_figures``) with
30 model seconds on 3 instances instead of an hour on 7, into a temporary
directory, and the proxy-ladder figure on a partial proxybench JSON. Checks
that every PNG is written, is a PNG, and stays small; never how it looks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from loadtests import make_figures

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
FIGURES = [
    "long-ttft_cdf.png",
    "long-shares.png",
    "long-hit_rate.png",
    "sysprompt-shares.png",
    "long-replicas.png",
    "proxy_ladder.png",
]


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG), path
    assert 2_000 < len(data) < 100_000, (path, len(data))


def test_the_command_writes_every_figure(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "loadtests.make_figures", "--out", str(tmp_path)),
            *("--duration", "30", "--instances", "3"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FIGURES)
    for name in FIGURES:
        check_png(tmp_path / name)
    # The tables behind the figures are printed, one per workload.
    assert "### long" in done.stdout
    assert "### sysprompt" in done.stdout
    assert "| PREFIX_AWARE TRAFFIC PREFILL |" in done.stdout
    assert "### long, R routers" in done.stdout
    assert "| 8 |" in done.stdout


def test_the_committed_ladder_is_redrawn_byte_for_byte(tmp_path: Path) -> None:
    first = make_figures.ladder(make_figures.DEFAULT_LADDER, tmp_path / "one")
    second = make_figures.ladder(make_figures.DEFAULT_LADDER, tmp_path / "two")
    check_png(first)
    assert first.read_bytes() == second.read_bytes()


def test_a_partial_proxybench_run_draws_what_it_has(tmp_path: Path) -> None:
    # The shape of `proxybench.py --targets prefix-router --workloads a`: the
    # ceiling and one target, one workload.
    document = json.loads(make_figures.DEFAULT_LADDER.read_text())
    results = document["results"]
    document["results"] = {
        name: {**results[name], "workloads": {"a": results[name]["workloads"]["a"]}}
        for name in ("direct", "prefix-router")
    }
    source = tmp_path / "proxybench.json"
    source.write_text(json.dumps(document))
    check_png(make_figures.ladder(source, tmp_path))


def test_a_run_with_no_proxy_figures_is_refused(tmp_path: Path) -> None:
    document = json.loads(make_figures.DEFAULT_LADDER.read_text())
    document["results"] = {"direct": document["results"]["direct"]}
    source = tmp_path / "proxybench.json"
    source.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="no proxy CPU or memory figures"):
        make_figures.ladder(source, tmp_path)
