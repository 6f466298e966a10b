"""The live benchmark, CI-sized: orderings that must hold on any machine, never times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_prefix_aware_beats_random_on_long_documents_live(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # 4 instances, 6 s of wall time per target at 1/20 of model time: two minutes of
    # the long workload.  The orderings below hold from the first minute on.
    done = subprocess.run(
        [
            sys.executable, "-m", "loadtests.bench", "--workload", "long", "--instances", "4",
            "--strategies", "random,prefix", "--duration", "6", "--time-scale", "0.05",
            "--rate", "4", "--out", str(out),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| RANDOM |" in done.stdout
    assert "| PREFIX_AWARE |" in done.stdout
    results = json.loads((out / "results.json").read_text())
    runs = {run["target"]: run for run in results["runs"]}
    random, prefix = runs["RANDOM"]["summary"], runs["PREFIX_AWARE"]["summary"]
    assert random["success_rate"] == prefix["success_rate"] == 1.0
    assert prefix["hit_rate"] > random["hit_rate"]
    assert prefix["ttft_p50"] < random["ttft_p50"]
    for name in ("ttft_cdf.png", "shares.png", "hit_rate.png"):
        assert (out / name).stat().st_size > 0
