"""``python -m loadtests.soak --attackers``: a short run through the real router process.

The soak's own end checks must pass with abusive clients beside its checked
traffic (no violation, no failure without an instance kill, every checked
request logged once, no lease held, fds and RSS after the second attack no
higher than after the first), and every attacker whose answer does not depend
on timing gets it: 431/414/413 for oversized heads and bodies, 400/501 for
malformed requests, 200 for bodies in 2-byte chunks, never a 503 for the
flood (it stays under the client cap).  The timed kinds leave after
``--hold`` 0.3 s, before the router's timeouts (5 s): their answers are not
asserted.  Figures: loadtests/RESULTS.md, "Attackers beside the soak".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests import attackers

ROOT = Path(__file__).resolve().parent.parent

# The run holds a request rate: beside another test on 2 cores it could be starved.
pytestmark = pytest.mark.serial


def test_a_short_soak_with_attackers_passes_its_end_checks(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.soak", "--seconds", "4", "--rate", "50",
         "--instances", "2", "--restart-every", "1000", "--sample-every", "0.1",
         "--attackers", "--flood", "50", "--hold", "0.3", "--pipelined", "2000",
         "--max-body-mib", "1", "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=40, check=False,
    )  # fmt: skip
    results = list(tmp_path.glob("soak-*.json"))
    assert len(results) == 1, done.stdout + done.stderr
    result = json.loads(results[0].read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"{failed}\n{done.stdout}"
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["outcomes"] == {"ok": result["sent"]}
    kinds = result["attackers"]["kinds"]
    assert set(attackers.EXPECTED) <= set(kinds)
    for name, allowed in attackers.EXPECTED.items():
        assert kinds[name]["connections"] > 0, name
        assert set(kinds[name]["answers"]) <= allowed, (name, kinds[name])
    assert kinds["oversized: declared body"]["answers"] == {"HTTP 413": 2}  # one per burst
    assert kinds["flood"]["connections"] == 100
    assert result["attackers"]["exit_status"] == 0
