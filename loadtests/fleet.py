"""Simulated fleets and routers as child processes, for the load tests.

Contract:
- Children are ``loadtests.supervisor`` children (``Child``; its contract:
  own process group, stderr drained, stop by PID with SIGTERM then SIGKILL,
  idempotent); ``spawn`` runs ``python -m ...`` in the repository root.
- Failures raise ``FleetError`` (the supervisor's ``ChildError``) with a
  message that says what and where, including the child's last stderr lines.
- ``start_sims`` / ``start_router`` return addresses read from the children's
  own output; ``counters`` reads vLLM's prefix-cache counters from /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path

import aiohttp

from .supervisor import ROOT, STOP_TIMEOUT_S, Child, ChildError, say, start

__all__ = [
    "ROOT",
    "SERVE",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "Child",
    "FleetError",
    "counters",
    "hit_rate",
    "listening_address",
    "next_line",
    "reset_caches",
    "say",
    "spawn",
    "start_router",
    "start_sims",
    "stop_checked",
]

START_TIMEOUT_S = 20.0  # imports alone take seconds on a busy 2-core machine

FleetError = ChildError  # one error for "a child failed", whoever started it

# ``prefix-router serve`` as every load test starts it: this interpreter, this tree.
SERVE = (sys.executable, "-m", "admin", "serve")


async def spawn(children: list[Child], name: str, *argv: str, stdout: bool = False) -> Child:
    """``python -m argv`` in the repository root, registered in ``children`` at once."""
    return await start(children, name, [sys.executable, "-m", *argv], stdout=stdout)


async def next_line(child: Child, what: str, deadline: float, stdout: bool = False) -> str:
    """The child's next stdout (or stderr) line; FleetError if it exits or is too slow."""
    return await child.line(what, deadline, stdout)


async def start_sims(
    children: list[Child], count: int, *flags: str, name: str = "sim"
) -> tuple[Child, dict[str, str]]:
    """One ``loadtests.simserver`` process serving ``count`` instances; name -> URL."""
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    child = await spawn(
        children, "simulated fleet", "loadtests.simserver", "--name", name,
        "--count", str(count), "--port", "0", *flags, stdout=True,
    )  # fmt: skip
    sims: dict[str, str] = {}
    while len(sims) < count:
        line = await next_line(child, "instance addresses", deadline, stdout=True)
        try:
            entry = json.loads(line)
            sims[entry["name"]] = entry["url"]
        except (ValueError, TypeError, KeyError):
            raise FleetError(f"unexpected line from the simulated fleet: {line!r}") from None
    return child, sims


# router/log.py renders structlog events as JSON lines; the regex also reads
# key=value renderings, so a change of log format does not break the demo.
_ADDRESS = re.compile(r"""\baddress["'=:\s]+([\w.\-\[\]]+:\d+)""")


def listening_address(line: str, event_name: str = "listening") -> str | None:
    """The address in a router's ``listening`` (or ``admin listening``) log line."""
    with contextlib.suppress(ValueError):
        event = json.loads(line)
        if isinstance(event, dict):
            address = event.get("address") if event.get("event") == event_name else None
            return address if isinstance(address, str) else None
    match = (
        _ADDRESS.search(line) if line.startswith(event_name) or f" {event_name} " in line else None
    )
    return match.group(1) if match else None


async def start_router(
    children: list[Child],
    sims: dict[str, str],
    *flags: str,
    label: str = "router",
    tree: Path | None = None,
) -> tuple[Child, str, str]:
    """``prefix-router serve`` in front of ``sims``: (child, URL, admin URL); the
    router of ``tree`` (another checkout: its own ``admin``, ``router``) if given."""
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    backends = [arg for name, url in sims.items() for arg in ("--backend", f"{name}={url}")]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    child = await start(
        children, label,
        [*SERVE, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", *flags, *backends],
        cwd=tree or ROOT, env=env,
    )  # fmt: skip
    address = admin = None
    while address is None or admin is None:
        line = await next_line(child, "'listening' log lines", deadline)
        address = address or listening_address(line)
        admin = admin or listening_address(line, "admin listening")
    return child, f"http://{address}", f"http://{admin}"


_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)_total(?:\{[^}]*\})? (\S+)$", re.M)


async def counters(sims: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Each instance's prefix-cache (hits, queries), in tokens, as vLLM counts them."""
    out = {}
    async with aiohttp.ClientSession(raise_for_status=True) as session:
        for name, url in sims.items():
            async with session.get(f"{url}/metrics") as resp:
                samples = dict(_COUNTER.findall(await resp.text()))
            if set(samples) != {"hits", "queries"}:
                raise FleetError(f"{name}: no vllm:prefix_cache_{{hits,queries}}_total in /metrics")
            out[name] = (float(samples["hits"]), float(samples["queries"]))
    return out


def hit_rate(
    now: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]] | None = None
) -> float:
    """Hits / queries summed over instances, since ``before`` if given."""
    hits = sum(h for h, _ in now.values()) - sum(h for h, _ in (before or {}).values())
    queries = sum(q for _, q in now.values()) - sum(q for _, q in (before or {}).values())
    return hits / queries if queries else math.nan


async def reset_caches(sims: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for name, url in sims.items():
            # 409 = blocks still pinned: an instance retires a request just after its
            # client read the last byte. A documented conflict: retry with backoff.
            for attempt in range(10):
                async with session.post(f"{url}/reset_prefix_cache") as resp:
                    if resp.status == 200:
                        break
                    if resp.status != 409:
                        raise FleetError(f"{name}: reset_prefix_cache: HTTP {resp.status}")
                await asyncio.sleep(0.01 * 2**attempt)
            else:
                raise FleetError(f"{name}: cache still in use after the workload ended")


async def stop_checked(child: Child) -> None:
    await child.stop()
    if child.proc.returncode != 0:
        raise FleetError(f"{child.name} did not exit cleanly on SIGTERM: {child.explain()}")
