"""Accept rate: prefix-router with one new connection per request, two trees compared.

    python -m loadtests.acceptbench --base /tmp/base-tree [--rounds 3] [--seconds 5]

Contract:
- ``--base`` is another checkout of the project (``git archive REV | tar -x -C
  DIR``); this tree is the candidate.  One fast backend (``loadtests.fastbackend``)
  serves both.  Each round starts each tree's router afresh, base then
  candidate, and runs wrk against it twice: ``close`` (``Connection: close``:
  a TCP connect, an accept and a close per request, what a connection cap
  could slow) and ``keepalive`` (32 kept connections, as proxybench's (a)).
- Prints requests/s per tree and mode (median over rounds) and the ratio
  candidate / base.  Every process is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
from pathlib import Path

from . import supervisor
from .fleet import SERVE, listening_address
from .supervisor import Child, ChildError

ROOT = supervisor.ROOT
MODES = {"close": ["-H", "Connection: close"], "keepalive": []}
START_TIMEOUT_S = 20.0


async def _router(children: list[Child], tree: Path, backend: str) -> tuple[Child, int]:
    child = await supervisor.start(
        children, f"router of {tree}",
        [*SERVE, "--listen", "127.0.0.1:0",
         "--admin-listen", "off", "--access-log", "off", "--no-health-checks",
         "--backend", f"fb={backend}"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    address = await child.wait_line(listening_address, "'listening' log line", deadline)
    return child, int(address.rpartition(":")[2])


async def _wrk(port: int, mode: str, seconds: int) -> float:
    argv = ["wrk", "-t1", "-c32", f"-d{seconds}s", *MODES[mode],
            f"http://127.0.0.1:{port}/v1/models"]  # fmt: skip
    done = await supervisor.run(argv, within=seconds + 30)
    out = done.stdout
    if done.returncode != 0:
        raise ChildError(f"wrk exited with {done.returncode}: {done.stderr[-500:]}")
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise ChildError(f"wrk saw {errors[1]} error answers:\n{out}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None:
        raise ChildError(f"wrk printed no rate:\n{out}")
    return float(match[1])


async def measure(base: Path, rounds: int, seconds: int) -> dict[tuple[str, str], list[float]]:
    trees = {"base": base, "candidate": ROOT}
    children: list[Child] = []
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        backend = await supervisor.start(
            children, "fastbackend",
            [sys.executable, "-m", "loadtests.fastbackend", "--count", "1"], stdout=True,
        )  # fmt: skip
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        url = json.loads(await backend.line("the backend's address", deadline, stdout=True))["url"]
        for _ in range(rounds):
            for name, tree in trees.items():
                router, port = await _router(children, tree, url)
                try:
                    for mode in MODES:
                        await _wrk(port, mode, 1)  # warm-up
                        rate = await _wrk(port, mode, seconds)
                        rates.setdefault((name, mode), []).append(rate)
                finally:
                    await router.stop()
    finally:
        for child in reversed(children):
            await child.stop()
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.acceptbench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--base", type=Path, required=True, help="the tree to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=5)
    args = p.parse_args(argv)
    try:
        rates = asyncio.run(measure(args.base.resolve(), args.rounds, args.seconds))
    except ChildError as exc:
        print(f"acceptbench: {exc}", file=sys.stderr)
        return 1
    print(f"| mode | base req/s | candidate req/s | candidate / base |  ({args.rounds} rounds)")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        base = statistics.median(rates["base", mode])
        cand = statistics.median(rates["candidate", mode])
        print(f"| {mode} | {base:,.0f} | {cand:,.0f} | {cand / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
