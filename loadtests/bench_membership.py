"""Benchmark of membership changes: start-up cost and how long they stall the loop.

    python -m loadtests.bench_membership [--baseline /work/main] [--repeats 3]

Each figure is measured in a fresh child process running a real ``Router``
(uvloop, listening on 127.0.0.1, health checks off, no traffic) and its
``RouterControl``, the object behind the admin API:
  start-up     ``Router(config)`` + ``start()`` with 200 / 1,000 / 2,001
               backends of weight 1: seconds, and the child's peak RSS
  add          ``add_backend`` of one backend to 1,000
  remove       ``remove_backend(wait=True)`` of one of 1,000 (drained at once)
  weight       ``update_backend(weight=100)`` of one of 1,000 (from 1)
  stats        ``stats()`` (``GET /admin/stats``) with 2,001 backends
For each change: its wall time until the published ring has it (``settled``
where the fleet has one), and the longest loop stall meanwhile, measured by a
probe callback scheduled every 1 ms (its lateness).  ``idle`` is the probe
alone: the noise floor of a shared machine.  Medians over --repeats children.
With ``--baseline TREE`` the same children also run TREE's code (a checkout of
main) in the same run, and the table shows both and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import supervisor  # imports no router: a child imports it from its tree

HERE = supervisor.ROOT
CHILD_TIMEOUT_S = 600.0
SIZES = (200, 1000, 2001)
CHANGE_FLEET = 1000
STATS_FLEET = 2001


# -- the child: one measurement against one tree ------------------------------------------------


def _use_tree(tree: Path) -> None:
    """Import ``router`` from ``tree``, not from the editable install."""
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
    sys.path.insert(0, str(tree))
    import router

    assert Path(router.__file__).resolve().is_relative_to(tree), router.__file__


class Probe:
    """A callback every ``period`` seconds; ``worst`` is its greatest lateness."""

    def __init__(self, loop: asyncio.AbstractEventLoop, period: float = 0.001):
        self.loop = loop
        self.period = period
        self.worst = 0.0
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.worst = 0.0
        self._schedule()

    def stop(self) -> float:
        if self._handle is not None:
            self._handle.cancel()
        return self.worst

    def _schedule(self) -> None:
        self._due = time.perf_counter() + self.period
        self._handle = self.loop.call_later(self.period, self._tick)

    def _tick(self) -> None:
        self.worst = max(self.worst, time.perf_counter() - self._due)
        self._schedule()


def _config(count: int) -> Any:
    from router.config import build_config

    return build_config(
        {
            "listen": "127.0.0.1:0",
            "access_log": "off",
            "health": {"active": False},
            "backends": [
                {"name": f"backend-{i}", "url": f"http://127.0.0.1:{10000 + i % 50000}"}
                for i in range(count)
            ],
        }
    )


async def _settled(router: Any) -> None:
    settled = getattr(router.fleet, "settled", None)
    if settled is not None:  # the ring may still be rebuilding in slices
        await settled()


async def _child(kind: str, count: int) -> dict[str, float]:
    from router.app import Router
    from router.config import BackendSpec
    from router.control import BackendPatch
    from router.control.live import RouterControl

    config = _config(count)
    start = time.perf_counter()
    router = Router(config)
    await router.start()
    startup = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    control = RouterControl(router)
    probe = Probe(asyncio.get_running_loop())
    result = {"startup_s": startup, "peak_rss_mib": peak_mib}
    try:
        if kind == "startup":
            return result
        probe.start()
        start = time.perf_counter()
        if kind == "idle":
            await asyncio.sleep(0.5)
        elif kind == "add":
            await control.add_backend(BackendSpec("newcomer", "http://127.0.0.1:9"))
        elif kind == "remove":
            await control.remove_backend("backend-7", timeout=1.0, wait=True)
        elif kind == "weight":
            await control.update_backend("backend-7", BackendPatch(weight=100))
        elif kind == "stats":
            await control.stats()
        await _settled(router)
        result["change_s"] = time.perf_counter() - start
        await asyncio.sleep(0.003)  # let the probe see the last slice
        result["stall_ms"] = probe.stop() * 1000
        return result
    finally:
        probe.stop()
        await control.close()
        await router.shutdown(grace=0)


def child_main(tree: str, kind: str, count: int) -> None:
    _use_tree(Path(tree).resolve())
    import uvloop

    from router.log import configure

    configure()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    print(json.dumps(uvloop.run(_child(kind, count))))


# -- the parent: children per tree, medians, the table ---------------------------------------


async def measure(tree: Path, kind: str, count: int, repeats: int) -> dict[str, float]:
    runs = []
    argv = [sys.executable, "-m", "loadtests.bench_membership", "--child", str(tree), kind]
    for _ in range(repeats):
        done = await supervisor.run([*argv, str(count)], CHILD_TIMEOUT_S)
        if done.returncode != 0:
            raise supervisor.ChildError(f"{kind} {count} in {tree} failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _ratio(after: float, before: float | None) -> str:
    if before is None or not after:
        return ""
    return f"{before / after:,.1f}x"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_membership", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--baseline", metavar="TREE", help="a checkout to compare with (main)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--child", nargs=3, metavar=("TREE", "KIND", "COUNT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        tree, kind, count = args.child
        child_main(tree, kind, int(count))
        return
    trees = {"after": HERE}
    if args.baseline:
        trees = {"before": Path(args.baseline).resolve(), **trees}
    asyncio.run(table(trees, args.repeats))


async def table(trees: dict[str, Path], repeats: int) -> None:
    print(
        f"# membership benchmark: Python {sys.version.split()[0]}, median of {repeats}"
        f" child processes; {', '.join(f'{k} = {v}' for k, v in trees.items())}"
    )
    columns = list(trees)
    print()
    header = " | ".join(f"{c} s | {c} peak RSS MiB" for c in columns)
    print(f"| backends | {header} | speed-up |")
    print("|---:|" + "---:|---:|" * len(columns) + "---:|")
    for count in SIZES:
        got = {c: await measure(t, "startup", count, repeats) for c, t in trees.items()}
        cells = " | ".join(
            f"{got[c]['startup_s']:.2f} | {got[c]['peak_rss_mib']:,.0f}" for c in columns
        )
        before = got["before"]["startup_s"] if "before" in got else None
        print(f"| {count:,} | {cells} | {_ratio(got['after']['startup_s'], before)} |")
    print()
    header = " | ".join(f"{c} s | {c} longest stall ms" for c in columns)
    print(f"| change | {header} | stall ratio |")
    print("|---|" + "---:|---:|" * len(columns) + "---:|")
    changes = [
        ("idle 0.5 s, 1,000 backends", "idle", CHANGE_FLEET),
        ("add one to 1,000", "add", CHANGE_FLEET),
        ("remove one of 1,000", "remove", CHANGE_FLEET),
        ("weight 1 -> 100, one of 1,000", "weight", CHANGE_FLEET),
        ("stats() at 2,001", "stats", STATS_FLEET),
    ]
    for label, kind, count in changes:
        got = {c: await measure(t, kind, count, repeats) for c, t in trees.items()}
        cells = " | ".join(f"{got[c]['change_s']:.3f} | {got[c]['stall_ms']:,.1f}" for c in columns)
        before = got["before"]["stall_ms"] if "before" in got else None
        print(f"| {label} | {cells} | {_ratio(got['after']['stall_ms'], before)} |")


if __name__ == "__main__":
    main()
