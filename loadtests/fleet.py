"""Child processes of the load tests: simulated fleets, routers, peers.

Contract:
- ``spawn`` runs ``python -m ...`` in the repository root, in a process group
  of its own (a terminal's Ctrl-C reaches only the parent, which then stops
  each child once), registered in the caller's list before any await, with
  its stderr always drained (a full pipe would block it).
- ``Child.stop`` is SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``, then
  reaping; idempotent.  Only processes started here are ever signalled.
- Failures raise ``FleetError`` with a message that says what and where,
  including the child's last stderr lines.
- ``start_sims`` / ``start_router`` return addresses read from the children's
  own output; ``counters`` reads vLLM's prefix-cache counters from /metrics.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0  # imports alone take seconds on a busy 2-core machine
STOP_TIMEOUT_S = 5.0


class FleetError(Exception):
    """A failure the user should read; the message says what and where."""


def say(*parts: object) -> None:
    print(*parts, flush=True)  # stdout is a pipe under make and in tests


@dataclass
class Child:
    """A subprocess we started; its stderr is always drained (a full pipe would block it)."""

    name: str
    proc: asyncio.subprocess.Process
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    lines: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)  # None: EOF
    drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def explain(self) -> str:
        code = self.proc.returncode
        status = "running" if code is None else f"exit code {code}"
        log = "".join(f"\n    {line}" for line in self.tail) or " (none)"
        return f"{self.name} (pid {self.pid}, {status}); its last stderr lines:{log}"

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after STOP_TIMEOUT_S; reaped. Idempotent."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self.proc.wait()
            except TimeoutError:
                say(f"{self.name} (pid {self.pid}) ignored SIGTERM; killing it")
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self.drain is not None:
            await self.drain  # reaches EOF now that the process is gone


async def spawn(children: list[Child], name: str, *argv: str, stdout: bool = False) -> Child:
    """``python -m argv`` in the repository root, registered in ``children`` at once."""
    pipe, devnull = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
    # process_group=0: a terminal's Ctrl-C reaches only us, and we stop each child
    # with one SIGTERM. Had the child got the SIGINT too, our SIGTERM could land
    # after its loop has removed its handlers and kill it mid-exit (seen: -15).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *argv, cwd=ROOT, stdin=devnull,
        stdout=pipe if stdout else devnull, stderr=pipe, process_group=0,
    )  # fmt: skip
    child = Child(name, proc)
    children.append(child)  # no await since the fork: an interrupt still finds it

    async def drain() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            child.tail.append(raw.decode(errors="replace").rstrip())
            child.lines.put_nowait(child.tail[-1])
        child.lines.put_nowait(None)

    child.drain = asyncio.create_task(drain())
    return child


async def next_line(child: Child, what: str, deadline: float, stdout: bool = False) -> str:
    """The child's next stdout (or stderr) line; FleetError if it exits or is too slow."""
    try:
        async with asyncio.timeout_at(deadline):
            if stdout:
                assert child.proc.stdout is not None
                line = (await child.proc.stdout.readline()).decode() or None
            else:
                line = await child.lines.get()
    except TimeoutError:
        await child.stop()
        raise FleetError(f"no {what} within {START_TIMEOUT_S:.0f} s: {child.explain()}") from None
    if line is None:
        await child.stop()  # reaps it, and its stderr is complete
        raise FleetError(f"{child.name} exited before {what}: {child.explain()}")
    return line


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
    children: list[Child], sims: dict[str, str], *flags: str, label: str = "router"
) -> tuple[Child, str, str]:
    """``prefix-router serve`` in front of ``sims``: (child, URL, admin URL)."""
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    backends = [arg for name, url in sims.items() for arg in ("--backend", f"{name}={url}")]
    child = await spawn(
        children, label, "admin", "serve", "--listen", "127.0.0.1:0",
        "--admin-listen", "127.0.0.1:0", *flags, *backends,
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
