"""Accept rate: prefix-router with one new connection per request, two trees compared.

    python loadtests/acceptbench.py --base /tmp/base-tree [--rounds 3] [--seconds 5]

Contract:
- ``--base`` is another checkout of the project (``git archive REV | tar -x -C
  DIR``); this tree is the candidate.  One fast backend (``fastbackend.py``)
  serves both.  Each round starts each tree's router afresh, base then
  candidate, and runs wrk against it twice: ``close`` (``Connection: close``:
  a TCP connect, an accept and a close per request, what a connection cap
  could slow) and ``keepalive`` (32 kept connections, as proxybench's (a)).
- Prints requests/s per tree and mode (median over rounds) and the ratio
  candidate / base.  Every process is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"close": ["-H", "Connection: close"], "keepalive": []}


def _router(tree: Path, backend: str) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "admin", "serve", "--listen", "127.0.0.1:0",
         "--admin-listen", "off", "--access-log", "off", "--no-health-checks",
         "--backend", f"fb={backend}"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        event = json.loads(proc.stderr.readline() or b'{"event": "exited"}')
        if event["event"] == "listening":
            return proc, int(event["address"].rpartition(":")[2])
        if event["event"] == "exited":
            break
    proc.kill()
    raise RuntimeError(f"the router of {tree} did not start")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wrk(port: int, mode: str, seconds: int) -> float:
    out = subprocess.run(
        ["wrk", "-t1", "-c32", f"-d{seconds}s", *MODES[mode],
         f"http://127.0.0.1:{port}/v1/models"],
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout  # fmt: skip
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw {errors[1]} error answers:\n{out}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert match, out
    return float(match[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the tree to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=5)
    args = p.parse_args()
    trees = {"base": args.base.resolve(), "candidate": ROOT}
    backend_proc = subprocess.Popen(
        [sys.executable, str(ROOT / "loadtests" / "fastbackend.py"), "--count", "1"],
        stdout=subprocess.PIPE,
    )
    assert backend_proc.stdout is not None
    backend = json.loads(backend_proc.stdout.readline())["url"]
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                proc, port = _router(tree, backend)
                try:
                    for mode in MODES:
                        _wrk(port, mode, 1)  # warm-up
                        rate = _wrk(port, mode, args.seconds)
                        rates.setdefault((name, mode), []).append(rate)
                finally:
                    _stop(proc)
    finally:
        _stop(backend_proc)
    print(f"| mode | base req/s | candidate req/s | candidate / base |  ({args.rounds} rounds)")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        base = statistics.median(rates["base", mode])
        cand = statistics.median(rates["candidate", mode])
        print(f"| {mode} | {base:,.0f} | {cand:,.0f} | {cand / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
