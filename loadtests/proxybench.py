"""The ladder: prefix-router's cost as a proxy, against C, Rust and naive-Python proxies.

    python loadtests/proxybench.py            # every target it can run, every workload
    python loadtests/proxybench.py --install  # first apt-get/pip what is missing
    python loadtests/proxybench.py --targets haproxy,prefix-router --workloads a,b --seconds 5

Contract:
- One run, one machine, the same fast backends (``loadtests/fastbackend.py``, N
  instances in one process) behind every target in turn.  With two or more CPUs,
  the load generator, the backends and this script run on CPU 0 and the proxy
  under test (with all its processes and threads) on CPU 1, as ``taskset -c``
  would do: children inherit the affinity of the thread that starts them, and
  every thread of a proxy's process tree is pinned again once it is ready.
- Targets, in order (``--targets`` selects; ``direct`` always runs, it is the
  baseline): ``direct`` (no proxy: the ceiling), ``haproxy`` and ``nginx`` (apt),
  ``sglang`` (sglang-router cache_aware), ``vllm-ca`` / ``vllm-ch`` (vllm-router
  cache_aware / consistent_hash) from ``loadtests.peers``, ``aiohttp`` (the
  30-line naive-Python floor below) and ``prefix-router`` (PREFIX_AWARE).  A
  target that cannot run here is skipped with the reason printed and recorded;
  ``--install`` installs what is missing (apt-get, and the peers' own venv),
  otherwise nothing is installed and what is missing is named.
  Nobody logs per request: HAProxy has no log, nginx ``access_log off``, the
  peers ``--log-level warn`` (sglang-router logs two lines per request at its
  default info), prefix-router ``--access-log off``.
- Workloads (``--workloads``): (a) OpenAI chat, 4 KiB prompt, small non-streaming
  reply; (b) the same with ``stream: true``, 64 SSE chunks; (c) native
  ``/invocations`` with a 64 KiB body; (d) ``--streams`` idle SSE streams (one
  chunk every 5 s) held open at once.  Requests cycle over ``--keys`` distinct
  prompts, each with its own ``x-session-id``, so every target spreads them.
- ``--rounds`` rounds (3) go over every target in turn, each target started
  afresh, so that a burst of outside load spreads over targets instead of
  spoiling one; throughput figures are medians over rounds.  Per round, target
  and workload (a)-(c): a warm-up (``--warmup`` s, not measured), then a
  closed-loop throughput run of ``--seconds`` s with ``--connections``
  keep-alive connections by wrk (a Lua script cycling prebuilt requests; or our
  Python generator with ``--generator python``, or when wrk is missing).  Over
  exactly that run: requests/s, the generator's latency P50/P99, proxy CPU per
  request (utime+stime of every process and thread of the proxy's tree, from
  /proc: the steadiest figure on a noisy machine), how busy the proxy's core
  was, how busy CPU 0 was (generator + backends + this script: near 100 %, the
  client side was the limit, not the proxy), how much CPU other processes took
  meanwhile, peak RSS of the proxy's tree, how requests split over the
  backends, and errors.
- Probes, our client, in the last round: (a) paced open loop at
  ``--probe-rate`` (1,000/s) and at ``--probe-fraction`` of direct's (a) rate,
  latency from the moment a request is due; (b) time to first body byte in a
  closed loop on ``--ttfb-connections`` keep-alive connections, each request
  sent as soon as the last ended (where Nagle meets delayed ACKs), the first
  chunk 2 ms after the head.  Added latency = the target's P50/P99 minus
  direct's in the same probe.
- (d), in the last round: RSS of the proxy's tree with no stream, then with
  ``--streams`` streams established (response head and first chunk received by
  every client), as a median of three samples; memory per stream = the
  difference / streams established.
- Output: a markdown table per workload, ratio lines against the best C and the
  best Rust target of this run, a check of prefix-router against the issue's
  targets, and ``results/proxybench-<time>.json`` with every figure and the
  run's parameters.  Every process is started by this script, stopped by PID
  (SIGTERM, SIGKILL after 5 s) on success, error or Ctrl-C; every loop is
  bounded in time.
- ``python loadtests/proxybench.py floor --listen HOST:PORT --backend URL ...``
  runs the naive aiohttp proxy (the ``aiohttp`` target) on its own;
  ``python loadtests/proxybench.py report results/proxybench-<time>.json``
  prints a saved run's report again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from time import perf_counter
from typing import Any

import httptools

from router.metrics import percentile

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
GEN_CPUS, PROXY_CPUS = {0}, {1}
STOP_TIMEOUT_S = 5.0
START_TIMEOUT_S = 30.0
PREFIX = 4096  # the key length every target is asked to use (prefix-router's default)
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
APT = {"wrk": "wrk", "haproxy": "haproxy", "nginx": "nginx"}  # binary -> Debian package

WORKLOADS = {
    "a": "(a) OpenAI chat, 4 KiB prompt, non-streaming",
    "b": "(b) OpenAI chat, 4 KiB prompt, stream: true, 64 SSE chunks",
    "c": "(c) native /invocations, 64 KiB body",
    "d": "(d) idle SSE streams held open",
}


class BenchError(Exception):
    """A failure the user should read; the message says what and where."""


def say(*parts: object) -> None:
    print(*parts, flush=True)


# ----------------------------------------------------------------- workloads


def _prompt(key: int, size: int) -> str:
    words = ("cache", "prefix", "token", "router", "fleet", "engine", "batch", "decode")
    out = [f"Document {key}:"]
    n, i = len(out[0]), key
    while n < size:
        i = (i * 1103515245 + 12345) & 0x7FFFFFFF  # a fixed LCG: the same text every run
        word = words[i % len(words)] + str(i % 97)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:size]


def build_requests(workload: str, keys: int, events_marker: str = "") -> list[tuple[str, bytes]]:
    """(session id, body) per key: the bodies a workload cycles over."""
    out = []
    for k in range(keys):
        if workload == "c":
            filler = _prompt(k, 64 * 1024)
            head = b'{"parameters":{"max_new_tokens":16},"inputs":"'
            body = head + filler.encode()[: 64 * 1024 - len(head) - 2] + b'"}'
        else:
            message = {
                "model": "fast",
                "stream": workload in ("b", "d"),
                "max_tokens": 64,
                "messages": [
                    {"role": "system", "content": _prompt(k, PREFIX)},
                    {"role": "user", "content": f"Question about document {k}.{events_marker}"},
                ],
            }
            body = json.dumps(message, separators=(",", ":")).encode()
        out.append((f"s{k}", body))
    return out


def path_of(workload: str) -> str:
    return "/invocations" if workload == "c" else "/v1/chat/completions"


def raw_request(host: str, path: str, session: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        f"x-session-id: {session}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# ----------------------------------------------------------------- /proc and CPUs


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()  # [0] is field 3 (state)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu(root: int) -> float:
    """Seconds of CPU (user + system, all threads) of ``root``'s tree, reaped children too."""
    ticks = 0
    for pid in process_tree(root):
        fields = _stat(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            if pid == root:
                ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / _TICK


def tree_rss(root: int) -> int:
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def pin_tree(root: int, cpus: set[int] | None) -> None:
    """Pin every thread of every process of ``root``'s tree to ``cpus``."""
    if not cpus:
        return
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def on_cpu(cpus: set[int] | None) -> Iterator[None]:
    """Run this thread, and so the children it starts meanwhile, on ``cpus``."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def self_cpu() -> tuple[float, float]:
    """(this process, its reaped children) CPU seconds: the generator side."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


# ----------------------------------------------------------------- child processes


def _open_log(path: Path) -> Any:
    return path.open("wb")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@dataclass(eq=False)
class Proc:
    """A process we started: output to a log file, stopped by its PID only."""

    name: str
    argv: list[str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None

    async def start(self, cpus: set[int] | None, env: dict[str, str] | None = None) -> None:
        log = _open_log(self.log_path)
        try:
            with on_cpu(cpus):
                # A session of its own: a terminal's Ctrl-C reaches only us; we stop each child.
                self.proc = await asyncio.create_subprocess_exec(
                    *self.argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, env=env,
                )  # fmt: skip
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def tail(self, lines: int = 15) -> str:
        return "\n".join(_read(self.log_path).splitlines()[-lines:]) or "(no output)"

    async def wait_for(self, find: Callable[[str], Any], what: str) -> Any:
        """Poll the log until ``find(text)`` is truthy; BenchError if it exits or is slow."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            found = find(_read(self.log_path))
            if found:
                return found
            if self.proc is None or self.proc.returncode is not None:
                raise BenchError(f"{self.name} exited before {what}; its log:\n{self.tail()}")
            if time.monotonic() > deadline:
                late = f"{self.name}: no {what} within {START_TIMEOUT_S:.0f} s"
                raise BenchError(f"{late}:\n{self.tail()}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await proc.wait()
        except TimeoutError:
            say(f"{self.name} (pid {proc.pid}) ignored SIGTERM; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _split_url(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


# ----------------------------------------------------------------- our HTTP client


class _Conn(asyncio.Protocol):
    """One keep-alive client connection; ``request`` -> (status, first byte, end, bytes)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, float, float, int]] | None = None
        self.first_waiter: asyncio.Future[float] | None = None
        self.closed = False
        self.keep = True
        self.keep_body: list[bytes] | None = None  # set to collect the body
        self._status = 0
        self._first = 0.0
        self._bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("connection closed"))

    def _fail(self, exc: Exception) -> None:
        for waiter in (self.waiter, self.first_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
        self.waiter = self.first_waiter = None

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self._first:
            self._first = perf_counter()
            first = self.first_waiter
            if first is not None and not first.done():
                first.set_result(self._first)
        self._bytes += len(body)
        if self.keep_body is not None:
            self.keep_body.append(body)

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        waiter, self.waiter = self.waiter, None
        end = perf_counter()
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, self._first or end, end, self._bytes))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, float, float, int]]:
        assert self.transport is not None
        self._first, self._bytes, self._status = 0.0, 0, 0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _connect(host: str, port: int) -> _Conn:
    _, conn = await asyncio.get_running_loop().create_connection(_Conn, host, port)
    return conn


@dataclass
class GenStats:
    requests: int = 0
    errors: int = 0
    bad_status: int = 0
    seconds: float = 0.0
    bytes: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)  # seconds
    ttfbs: list[float] = field(default_factory=list, repr=False)
    p50_ms: float | None = None
    p99_ms: float | None = None
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None
    offered_rate: float | None = None
    generator: str = "python"

    def finish(self) -> GenStats:
        if self.latencies:
            self.p50_ms = _ms(percentile(self.latencies, 0.50))
            self.p99_ms = _ms(percentile(self.latencies, 0.99))
        if self.ttfbs:
            self.ttfb_p50_ms = _ms(percentile(self.ttfbs, 0.50))
            self.ttfb_p99_ms = _ms(percentile(self.ttfbs, 0.99))
        return self

    def record(self, status: int, t0: float, first: float, end: float, nbytes: int) -> None:
        self.requests += 1
        self.bytes += nbytes
        if status >= 400 or status == 0:
            self.bad_status += 1
        self.latencies.append(end - t0)
        self.ttfbs.append(first - t0)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def closed_loop(url: str, reqs: list[bytes], seconds: float, connections: int) -> GenStats:
    """``connections`` keep-alive connections, each sending its next request on each answer."""
    host, port = _split_url(url)
    stats = GenStats()
    start = perf_counter()
    deadline = start + seconds

    async def worker(index: int) -> None:
        conn: _Conn | None = None
        j = index
        while perf_counter() < deadline:
            try:
                if conn is None or conn.closed or not conn.keep:
                    if conn is not None:
                        conn.close()
                    conn = await _connect(host, port)
                t0 = perf_counter()
                status, first, end, nbytes = await conn.request(reqs[j % len(reqs)])
            except (OSError, httptools.HttpParserError):
                stats.errors += 1
                conn = None
                await asyncio.sleep(0.01)
                continue
            stats.record(status, t0, first, end, nbytes)
            j += connections
        if conn is not None:
            conn.close()

    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(*(worker(i) for i in range(connections)))
    stats.seconds = perf_counter() - start
    return stats.finish()


async def paced(url: str, reqs: list[bytes], rate: float, seconds: float, pool: int) -> GenStats:
    """Open loop at ``rate``/s in 1 ms ticks (uvloop timers are millisecond-grained).

    Latency runs from the tick a request became due, so waiting for a free
    connection counts (no coordinated omission beyond the tick).
    """
    host, port = _split_url(url)
    stats = GenStats(offered_rate=rate)
    loop = asyncio.get_running_loop()
    idle: deque[_Conn] = deque([await _connect(host, port) for _ in range(pool)])
    waiting: deque[tuple[float, int]] = deque()
    outstanding = 0
    quiet = asyncio.Event()
    reconnects: set[asyncio.Task[None]] = set()

    def launch(conn: _Conn, due: float, j: int) -> None:
        nonlocal outstanding
        outstanding += 1
        try:
            future = conn.request(reqs[j % len(reqs)])
        except Exception:  # a transport that closed meanwhile
            future = loop.create_future()
            future.set_exception(ConnectionResetError())
        future.add_done_callback(lambda f: finished(conn, due, f))

    def finished(conn: _Conn, due: float, future: asyncio.Future[Any]) -> None:
        nonlocal outstanding
        outstanding -= 1
        ok = future.exception() is None
        if ok:
            status, first, end, nbytes = future.result()
            stats.record(status, due, first, end, nbytes)
        else:
            stats.errors += 1
        if ok and conn.keep and not conn.closed:
            ready(conn)
        else:  # a new connection takes its place
            conn.close()
            task = loop.create_task(replace())
            reconnects.add(task)
            task.add_done_callback(reconnects.discard)
        if not outstanding and not waiting:
            quiet.set()

    def ready(conn: _Conn) -> None:
        if waiting:
            launch(conn, *waiting.popleft())
        else:
            idle.append(conn)

    async def replace() -> None:
        with contextlib.suppress(OSError):
            ready(await _connect(host, port))

    total = max(1, round(rate * seconds))
    sent = 0
    start = perf_counter()
    while sent < total:
        now = perf_counter()
        due_count = min(total, int((now - start) * rate) + 1)
        while sent < due_count:
            if idle:
                launch(idle.popleft(), now, sent)
            else:
                waiting.append((now, sent))
            sent += 1
        await asyncio.sleep(0.001)
    stats.seconds = perf_counter() - start
    if outstanding or waiting:
        quiet.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await quiet.wait()
    stats.errors += outstanding + len(waiting)
    for conn in idle:
        conn.close()
    for task in list(reconnects):
        task.cancel()
    return stats.finish()


async def open_streams(
    url: str, request: bytes, count: int, within: float
) -> tuple[list[_Conn], int, int]:
    """Open ``count`` streams; (connections, established, failed) once each has its
    first body byte, or ``within`` seconds have passed."""
    host, port = _split_url(url)
    gate = asyncio.Semaphore(200)  # connects in flight: under every listen backlog
    conns: list[_Conn] = []

    async def one() -> bool:
        async with gate:
            conn = await _connect(host, port)
            conns.append(conn)
            first = conn.first_waiter = asyncio.get_running_loop().create_future()
            # Never awaited: a stream that fails leaves its exception here, read.
            conn.request(request).add_done_callback(_ignore)
            await first
            conn.waiter = None  # never awaited: the stream stays open until we close it
            return True

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    done, pending = await asyncio.wait(tasks, timeout=within)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    ok = sum(1 for t in done if not t.cancelled() and t.exception() is None)
    return conns, ok, count - ok


def _ignore(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def fetch_json(url: str, path: str) -> Any:
    host, port = _split_url(url)
    conn = await _connect(host, port)
    body: list[bytes] = []
    conn.keep_body = body
    try:
        async with asyncio.timeout(5):
            status, *_ = await conn.request(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    finally:
        conn.close()
    return json.loads(b"".join(body)) if status == 200 else None


# ----------------------------------------------------------------- wrk


_WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('PROXYBENCH {"requests":%d,"duration_us":%d,"bytes":%d,'
    .. '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,'
    .. '"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99)))
end
"""


def wrk_script(path: str, requests: list[tuple[str, bytes]]) -> str:
    lines = ["local bodies = {}", "local sessions = {}"]
    for i, (session, body) in enumerate(requests, 1):
        text = body.decode()
        if "]=====]" in text:
            raise ValueError("a body contains the Lua long-string terminator")
        lines.append(f"bodies[{i}] = [=====[{text}]=====]")
        lines.append(f'sessions[{i}] = "{session}"')
    lines.append(
        f"""
local reqs = {{}}
local n = 0
init = function(args)
  for i = 1, #bodies do
    local h = {{}}
    h["Content-Type"] = "application/json"
    h["x-session-id"] = sessions[i]
    reqs[i] = wrk.format("POST", "{path}", h, bodies[i])
  end
end
request = function()
  n = n % #reqs + 1
  return reqs[n]
end
"""
    )
    return "\n".join(lines) + _WRK_DONE


def _write(path: Path, text: str) -> None:
    path.write_text(text)


async def run_wrk(
    url: str, script: Path, seconds: float, connections: int, cpus: set[int] | None
) -> GenStats:
    argv = [
        "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
        "-s", str(script), url,
    ]  # fmt: skip
    with on_cpu(cpus):
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    try:
        async with asyncio.timeout(seconds + 60):
            out, err = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise BenchError("wrk did not finish in time") from None
    line = next((ln for ln in out.decode().splitlines() if ln.startswith("PROXYBENCH ")), None)
    if line is None:
        raise BenchError(f"wrk printed no summary: {(out + err).decode()[-500:]}")
    data = json.loads(line.removeprefix("PROXYBENCH "))
    errors = data["connect"] + data["read"] + data["write"] + data["timeout"]
    return GenStats(
        requests=data["requests"],
        errors=errors,
        bad_status=data["status"],
        seconds=data["duration_us"] / 1e6,
        bytes=data["bytes"],
        p50_ms=round(data["p50_us"] / 1000, 3),
        p99_ms=round(data["p99_us"] / 1000, 3),
        generator="wrk",
    )


# ----------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str  # for --targets
    label: str  # in tables
    kind: str  # ceiling | C | Rust | Python
    key: str  # what it routes on, as close to our key as it allows


TARGETS = (
    Target("direct", "direct (no proxy)", "ceiling", "none: the client talks to fb-0"),
    Target(
        "haproxy", "HAProxy", "C",
        "`balance hash req.body,bytes(0,4096)`, `hash-type consistent`, `hash-balance-factor"
        " 150`: the first 4,096 bytes of the buffered body (`option http-buffer-request`)",
    ),
    Target(
        "nginx", "nginx", "C",
        "`hash $prefix_key consistent`, `$prefix_key` = the first 4,096 bytes of"
        " `$request_body` (a `map` regex; body held in memory); no load bound",
    ),
    Target(
        "sglang", "sglang-router cache_aware", "Rust",
        "cache_aware: radix tree on the messages' text (roles left out); load-balances"
        " past its thresholds",
    ),
    Target(
        "vllm-ca", "vllm-router cache_aware", "Rust",
        "cache_aware: prefix tree on token ids that EVERY worker returns from /render"
        " (a render call per worker per request)",
    ),
    Target(
        "vllm-ch", "vllm-router consistent_hash", "Rust",
        "consistent_hash on the `x-session-id` header (one per prompt): its only key",
    ),
    Target(
        "aiohttp", "aiohttp floor", "Python",
        "crc32 of the first 4,096 body bytes modulo the backends (no ring, no bound)",
    ),
    Target(
        "prefix-router", "prefix-router", "Python",
        "PREFIX_AWARE: mmh3 of the first 4,096 characters of the extracted prompt (chat)"
        " or body bytes (native); bounded-load consistent hashing",
    ),
)  # fmt: skip
BY_NAME = {t.name: t for t in TARGETS}
_PEER_ARGS = {"sglang": ("sglang", "cache_aware"), "vllm-ca": ("vllm", "cache_aware"),
              "vllm-ch": ("vllm", "consistent_hash")}  # fmt: skip
_PEER_QUIET = {"sglang": ["--log-level", "warn"], "vllm": ["--log-level", "warning"]}


@dataclass
class Running:
    url: str
    pid: int | None  # the proxy's root process; None for direct
    stop: Callable[[], Awaitable[Any]]
    version: str = ""


@dataclass
class Ctx:
    opt: argparse.Namespace
    tmp: Path
    backends: list[str]
    backend_pid: int
    gen_cpus: set[int] | None
    proxy_cpus: set[int] | None
    use_wrk: bool
    children: list[Proc] = field(default_factory=list)
    scripts: dict[str, Path] = field(default_factory=dict)
    requests: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)
    probe_rate: float | None = None
    baseline: dict[str, dict[str, Any]] = field(default_factory=dict)  # direct's rows


def _version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (
        (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr) else "?"
    )


async def _spawn(ctx: Ctx, name: str, argv: list[str]) -> Proc:
    proc = Proc(name, argv, ctx.tmp / f"{name}.log")
    ctx.children.append(proc)
    await proc.start(ctx.proxy_cpus)
    return proc


async def _until_serving(proc: Proc, url: str) -> None:
    """Poll GET /health through the proxy until a backend answers 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError, TimeoutError, ValueError, httptools.HttpParserError):
            if await fetch_json(url, "/_stats") is not None:
                return
        if proc.proc is None or proc.proc.returncode is not None:
            raise BenchError(f"{proc.name} exited at start-up; its log:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{proc.name} does not answer on {url}; its log:\n{proc.tail()}")
        await asyncio.sleep(0.1)


def _haproxy_config(port: int, backends: list[str]) -> str:
    servers = "\n".join(
        f"    server fb-{i} {url.removeprefix('http://')}" for i, url in enumerate(backends)
    )
    return f"""global
    maxconn 8000
    nbthread 1
defaults
    mode http
    option http-buffer-request
    timeout connect 5s
    timeout client 120s
    timeout server 300s
    timeout http-request 10s
    timeout http-keep-alive 75s
frontend bench
    bind 127.0.0.1:{port}
    default_backend fleet
backend fleet
    balance hash req.body,bytes(0,{PREFIX})
    hash-type consistent
    hash-balance-factor 150
{servers}
"""


def _nginx_config(port: int, backends: list[str], tmp: Path) -> str:
    servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in backends)
    return f"""worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 10000; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_body_buffer_size 128k;   # $request_body exists only for a body held in memory
    client_max_body_size 1m;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    map $request_body $prefix_key {{
        "~(?s)^(?<head>.{{1,{PREFIX}}})" $head;
        default "";
    }}
    upstream fleet {{
        hash $prefix_key consistent;
{servers}
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;        # SSE events go out as they come, as for any LLM proxy
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


async def start_target(ctx: Ctx, target: Target) -> Running:
    name = target.name
    if name == "direct":
        return Running(ctx.backends[0], None, lambda: asyncio.sleep(0))
    if name in _PEER_ARGS:
        peers = _peers()
        assert peers is not None
        key, policy = _PEER_ARGS[name]
        with on_cpu(ctx.proxy_cpus):  # the peer's threads inherit this affinity
            peer = await peers.start_peer(
                key, ctx.backends, venv=ctx.opt.venv, policy=policy, log_dir=ctx.tmp,
                startup_timeout=START_TIMEOUT_S, extra_args=_PEER_QUIET[key],
            )  # fmt: skip
        return Running(peer.url, peer.pid, peer.stop, peers.PINS[key])
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if name == "haproxy":
        cfg = ctx.tmp / "haproxy.cfg"
        _write(cfg, _haproxy_config(port, ctx.backends))
        proc = await _spawn(ctx, name, ["haproxy", "-db", "-f", str(cfg)])
        await _until_serving(proc, url)
        return Running(url, proc.pid, proc.stop, _version(["haproxy", "-v"]))
    if name == "nginx":
        prefix = ctx.tmp / "nginx"
        prefix.mkdir(exist_ok=True)
        prefix.chmod(0o755)  # the worker (nobody) creates its temp paths in it
        ctx.tmp.chmod(0o755)
        conf = prefix / "nginx.conf"
        _write(conf, _nginx_config(port, ctx.backends, prefix))
        argv = ["nginx", "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "startup.log")]
        proc = await _spawn(ctx, name, argv)
        await _until_serving(proc, url)
        return Running(url, proc.pid, proc.stop, _version(["nginx", "-v"]))
    if name == "aiohttp":
        backends = [a for u in ctx.backends for a in ("--backend", u)]
        argv = [sys.executable, str(SELF), "floor", "--listen", f"127.0.0.1:{port}", *backends]
        proc = await _spawn(ctx, name, argv)
        await _until_serving(proc, url)
        import aiohttp

        return Running(url, proc.pid, proc.stop, f"aiohttp {aiohttp.__version__}")
    if name == "prefix-router":
        backends = [a for i, u in enumerate(ctx.backends) for a in ("--backend", f"fb-{i}={u}")]
        argv = [sys.executable, "-m", "router", "serve", "--listen", "127.0.0.1:0",
                "--strategy", "prefix", "--prefix-length", str(PREFIX), "--access-log", "off",
                "--admin-listen", "127.0.0.1:0", *backends]  # fmt: skip
        proc = await _spawn(ctx, name, argv)
        address = await proc.wait_for(_router_address, "'listening' log line")
        url = f"http://{address}"
        await _until_serving(proc, url)
        return Running(url, proc.pid, proc.stop, _git_version())
    raise BenchError(f"unknown target {name}")


def _router_address(text: str) -> str | None:
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "listening":
                return str(event["address"])
    return None


def _git_version() -> str:
    done = _version(["git", "-C", str(ROOT), "describe", "--always", "--dirty"])
    return f"git {done}"


def _peers() -> Any:
    """``loadtests.peers`` (sglang-router, vllm-router in their own venv), or None."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from loadtests import peers
    except ImportError:
        return None
    return peers


def availability(opt: argparse.Namespace, names: list[str]) -> dict[str, str | None]:
    """Each selected target: None if it can run here, else why not (after --install)."""
    missing = [binary for binary in APT if shutil.which(binary) is None]
    if missing and opt.install:
        packages = [APT[b] for b in missing]
        say(f"installing with apt-get: {' '.join(packages)}")
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(argv, timeout=900, check=False, stdout=subprocess.DEVNULL)
        missing = [binary for binary in APT if shutil.which(binary) is None]
    if missing:
        hint = f"apt-get install {' '.join(APT[b] for b in missing)}, or run with --install"
        say(f"missing: {', '.join(missing)} ({hint})")
    reasons: dict[str, str | None] = {}
    peer_reasons: dict[str, str | None] | None = None
    for name in names:
        reason = None
        if name in ("haproxy", "nginx") and name in missing:
            reason = f"{name} is not installed (apt-get install {name}, or --install)"
        elif name in _PEER_ARGS:
            peers = _peers()
            if peers is None:
                reason = "loadtests/peers.py is not on this branch"
            else:
                if peer_reasons is None:
                    check = peers.ensure_installed if opt.install else peers.check_installed
                    peer_reasons = check(opt.venv)
                reason = peer_reasons.get(_PEER_ARGS[name][0])
                if reason is not None and not opt.install:
                    reason += " (run with --install)"
        elif name == "aiohttp":
            with contextlib.suppress(ImportError):
                import aiohttp  # noqa: F401
            reason = None if "aiohttp" in sys.modules else "aiohttp is not importable"
        reasons[name] = reason
    return reasons


# ----------------------------------------------------------------- measuring


async def backend_counts(ctx: Ctx) -> list[int]:
    counts = []
    for url in ctx.backends:
        stats = await fetch_json(url, "/_stats")
        counts.append(int(stats["requests"]) if stats else 0)
    return counts


def _raw(ctx: Ctx, url: str, requests: str) -> list[bytes]:
    host = url.removeprefix("http://")
    path = path_of(requests[0])
    return [raw_request(host, path, s, b) for s, b in ctx.requests[requests]]


async def generate(ctx: Ctx, url: str, workload: str, seconds: float) -> GenStats:
    if ctx.use_wrk:
        return await run_wrk(url, ctx.scripts[workload], seconds, ctx.opt.connections, ctx.gen_cpus)
    return await closed_loop(url, _raw(ctx, url, workload), seconds, ctx.opt.connections)


class RssPeak:
    """Peak RSS of a process tree, sampled every half second while a run lasts."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self.peak = tree_rss(pid) if pid else 0
        self._task = asyncio.ensure_future(self._sample()) if pid else None

    async def _sample(self) -> None:
        assert self.pid is not None
        while True:
            await asyncio.sleep(0.5)
            self.peak = max(self.peak, tree_rss(self.pid))

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self.peak = max(self.peak, tree_rss(self.pid)) if self.pid else 0
        return self.peak


def system_busy() -> tuple[float, float]:
    """CPU seconds all CPUs spent since boot (/proc/stat) in processes, and in interrupts.

    The second figure is mostly the loopback network's softirq work, which the
    kernel (without IRQ time accounting) charges to no process.
    """
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + steal) / _TICK, (irq + softirq) / _TICK


def _cpu_snapshot(ctx: Ctx, pid: int | None) -> tuple[float, ...]:
    me, kids = self_cpu()
    proxy = tree_cpu(pid) if pid else 0.0
    return perf_counter(), proxy, tree_cpu(ctx.backend_pid), me, kids, *system_busy()


async def measure_load(ctx: Ctx, running: Running, workload: str, probes: bool) -> dict[str, Any]:
    """Throughput run (closed loop), then if ``probes`` the workload's paced probes."""
    opt = ctx.opt
    if opt.warmup > 0:
        await generate(ctx, running.url, workload, opt.warmup)
    split_before = await backend_counts(ctx)
    before = _cpu_snapshot(ctx, running.pid)
    peak = RssPeak(running.pid)
    stats = await generate(ctx, running.url, workload, opt.seconds)
    after = _cpu_snapshot(ctx, running.pid)
    rss = await peak.stop()
    split = [b - a for a, b in zip(split_before, await backend_counts(ctx), strict=True)]
    wall = after[0] - before[0]
    proxy_cpu = after[1] - before[1]
    client_cpu = sum(after[i] - before[i] for i in (2, 3, 4))
    others = after[5] - before[5] - proxy_cpu - client_cpu  # processes not in this run
    softirq = after[6] - before[6]
    n = stats.requests
    body = len(ctx.requests[workload][0][1])
    row: dict[str, Any] = {
        "generator": stats.generator,
        "seconds": round(stats.seconds, 3),
        "requests": n,
        "rps": round(n / stats.seconds, 1) if stats.seconds else 0.0,
        "p50_ms": stats.p50_ms,
        "p99_ms": stats.p99_ms,
        "errors": stats.errors,
        "bad_status": stats.bad_status,
        "bytes_per_response": round(stats.bytes / n) if n else 0,
        "request_mb_s": round(n * body / stats.seconds / 1e6, 1) if stats.seconds else 0.0,
        "cpu_us": round(proxy_cpu / n * 1e6, 1) if running.pid and n else None,
        "proxy_core_pct": round(proxy_cpu / wall * 100) if running.pid else None,
        "client_core_pct": round(client_cpu / wall * 100),
        "others_core_pct": max(0, round(others / wall * 100)),
        "softirq_core_pct": round(softirq / wall * 100),
        "rss_mib": round(rss / 2**20, 1) if running.pid else None,
        "split": split,
    }
    if n == 0 or stats.bad_status + stats.errors > n / 10:
        # Not a proxy of this workload (sglang-router has no /invocations, say): its
        # figures describe error answers, so no ratio may use them.
        row["invalid"] = f"{stats.bad_status} non-2xx answers, {stats.errors} errors in {n}"
        return row
    row["probes"] = []
    if opt.probe_seconds <= 0 or not probes:
        return row
    if workload == "b" and opt.ttfb_connections > 0:
        # Back to back on a few keep-alive connections: the case where a proxy that
        # holds small segments (Nagle) meets the client's delayed ACK.
        raw = _raw(ctx, running.url, "b-probe")
        probe = await closed_loop(running.url, raw, opt.probe_seconds, opt.ttfb_connections)
        rate = round(probe.requests / probe.seconds) if probe.seconds else 0
        row["probes"].append(_probe(probe, rate, opt.ttfb_connections))
    for rate in sorted({r for r in (opt.probe_rate, ctx.probe_rate) if r and workload == "a"}):
        if running.pid and row["rps"] < rate * 1.25:
            # Past ~80 % of what the closed loop got, an open loop measures a queue.
            row["probes"].append({"rate": rate, "over_capacity": True})
            continue
        probe = await paced(running.url, _raw(ctx, running.url, "a"), rate, opt.probe_seconds, 32)
        row["probes"].append(_probe(probe, rate))
    return row


def _probe(probe: GenStats, rate: float, connections: int | None = None) -> dict[str, Any]:
    return {
        "rate": rate,
        "connections": connections,  # None: paced (open loop); else closed loop on these
        "requests": probe.requests,
        "errors": probe.errors + probe.bad_status,
        "p50_ms": probe.p50_ms,
        "p99_ms": probe.p99_ms,
        "ttfb_p50_ms": probe.ttfb_p50_ms,
        "ttfb_p99_ms": probe.ttfb_p99_ms,
    }


def _median_rss(pid: int) -> float:
    return statistics.median(tree_rss(pid) for _ in range(3))


async def measure_streams(ctx: Ctx, running: Running) -> dict[str, Any]:
    """Open ``--streams`` slow SSE streams at once; memory per stream from the proxy's RSS."""
    count = ctx.opt.streams
    request = _raw(ctx, running.url, "d")[0]
    idle = _median_rss(running.pid) if running.pid else 0.0
    cpu0 = tree_cpu(running.pid) if running.pid else 0.0
    started = perf_counter()
    conns, ok, failed = await open_streams(running.url, request, count, within=60.0)
    setup = perf_counter() - started
    try:
        await asyncio.sleep(1.0)
        samples = []
        for _ in range(3 if running.pid else 0):
            samples.append(tree_rss(running.pid))  # type: ignore[arg-type]
            await asyncio.sleep(0.3)
        held = statistics.median(samples) if samples else 0.0
        cpu1 = tree_cpu(running.pid) if running.pid else 0.0
    finally:
        for conn in conns:
            conn.close()
    await asyncio.sleep(1.0)  # let the proxy close its upstream side before the next target
    row: dict[str, Any] = {
        "streams": count,
        "established": ok,
        "failed": failed,
        "setup_s": round(setup, 2),
    }
    if running.pid:
        row.update(
            rss_idle_mib=round(idle / 2**20, 1),
            rss_streams_mib=round(held / 2**20, 1),
            kib_per_stream=round((held - idle) / ok / 1024, 1) if ok else None,
            setup_cpu_us_per_stream=round((cpu1 - cpu0) / ok * 1e6, 1) if ok else None,
        )
    return row


async def measure_target(
    ctx: Ctx, target: Target, running: Running, last: bool
) -> dict[str, dict[str, Any]]:
    """One round of one target: each throughput run; the probes and (d) in the last round."""
    rows: dict[str, Any] = {}
    for workload in ctx.opt.workloads:
        if workload == "d" and not last:
            continue
        say(f"  {target.label}: workload {workload} ...")
        try:
            if workload == "d":
                rows[workload] = await measure_streams(ctx, running)
            else:
                rows[workload] = await measure_load(ctx, running, workload, probes=last)
        except (BenchError, OSError, TimeoutError) as exc:
            rows[workload] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"    {_brief(rows[workload])}")
        await asyncio.sleep(0.5)
    return rows


_MEDIANS = ("rps", "request_mb_s", "p50_ms", "p99_ms", "cpu_us", "proxy_core_pct",
            "client_core_pct", "others_core_pct", "softirq_core_pct", "bytes_per_response",
            "seconds")  # fmt: skip


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of a throughput run: medians, sums of counts, peak RSS."""
    ok = [r for r in rounds if "error" not in r and "requests" in r]
    if not ok or len(rounds) == 1:
        return rounds[-1]  # an error, a (d) run, or a single round: nothing to combine
    row = dict(ok[-1])  # probes (last round only) and anything not combined
    for key in _MEDIANS:
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = round(statistics.median(values), 3) if values else None
    for key in ("requests", "errors", "bad_status"):
        row[key] = sum(r[key] for r in ok)
    row["split"] = [sum(column) for column in zip(*(r["split"] for r in ok), strict=True)]
    rss = [r["rss_mib"] for r in ok if r.get("rss_mib") is not None]
    row["rss_mib"] = max(rss) if rss else None
    cpu = [r["cpu_us"] for r in ok if r.get("cpu_us") is not None]
    row["cpu_us_range"] = [min(cpu), max(cpu)] if cpu else None
    row["rounds"] = len(ok)
    row["per_round"] = [{k: r.get(k) for k in ("rps", "cpu_us", "others_core_pct")} for r in ok]
    invalid = [r["invalid"] for r in ok if "invalid" in r]
    if invalid:
        row["invalid"] = invalid[0]
    return row


def _combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``combine``, but a long run never loses its figures to a bug in it."""
    try:
        return combine(rounds)
    except Exception as exc:  # keep the raw rounds in the JSON
        return {"error": f"could not combine the rounds: {exc!r}", "rounds_raw": rounds}


def _brief(row: dict[str, Any]) -> str:
    keys = ("rps", "cpu_us", "p50_ms", "p99_ms", "errors", "bad_status", "established",
            "kib_per_stream", "failed", "error", "invalid")  # fmt: skip
    text = ", ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None)
    for probe in row.get("probes", ()):
        got = (
            "over capacity"
            if probe.get("over_capacity")
            else (
                f"P50 {probe['p50_ms']} ms, P99 {probe['p99_ms']} ms, "
                f"TTFB P50 {probe['ttfb_p50_ms']} ms, P99 {probe['ttfb_p99_ms']} ms"
            )
        )
        text += f"; probe at {probe['rate']:g}/s: {got}"
    return text


# ----------------------------------------------------------------- report


def _f(value: float | None, spec: str = ",.1f") -> str:
    return "—" if value is None else format(value, spec)


def _added(value: float | None, base: float | None) -> str:
    if value is None:
        return "—"
    if base is None:
        return _f(value, ".3f")
    return f"{value:.3f} ({value - base:+.3f})"


def table(workload: str, results: dict[str, Any]) -> str:
    base = results.get("direct", {}).get("workloads", {}).get(workload, {})
    lines = [f"### {WORKLOADS[workload]}", ""]
    if workload == "d":
        lines += [
            "| target | streams | established | RSS idle MiB | RSS with streams MiB | KiB/stream | proxy CPU µs/stream set-up |",  # noqa: E501
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += [
            "| target | req/s | x direct | MB/s sent | P50 ms | P99 ms | proxy CPU µs/req (range) | proxy core % | CPU 0 % | softirq % | others % | peak RSS MiB | split | errors |",  # noqa: E501
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
    for entry in results.values():
        row = entry["workloads"].get(workload)
        if row is None:
            continue
        label = entry["label"]
        if "error" in row:
            lines.append(f"| {label} | failed: {row['error'][:200]} |")
            continue
        if workload == "d":
            lines.append(
                f"| {label} | {row['streams']:,} | {row['established']:,} "
                f"| {_f(row.get('rss_idle_mib'))} | {_f(row.get('rss_streams_mib'))} "
                f"| {_f(row.get('kib_per_stream'))} | {_f(row.get('setup_cpu_us_per_stream'))} |"
            )
            continue
        ratio = row["rps"] / base["rps"] if base.get("rps") else None
        split = "/".join(str(n) for n in row["split"])
        if "invalid" in row:
            label += f" (invalid: {row['invalid']})"
        lines.append(
            f"| {label} | {row['rps']:,.0f} | {_f(ratio, '.2f')} | {row['request_mb_s']:,.1f} "
            f"| {_f(row['p50_ms'], '.3f')} | {_f(row['p99_ms'], '.3f')} "
            f"| {_cpu_cell(row)} | {_f(row['proxy_core_pct'], '.0f')} "
            f"| {_f(row['client_core_pct'], '.0f')} | {_f(row.get('softirq_core_pct'), '.0f')} "
            f"| {_f(row['others_core_pct'], '.0f')} "
            f"| {_f(row['rss_mib'])} "
            f"| {split} | {row['errors'] + row['bad_status']} |"
        )
    probes = probe_table(workload, results)
    return "\n".join(lines) + ("\n\n" + probes if probes else "")


def _cpu_cell(row: dict[str, Any]) -> str:
    spread = row.get("cpu_us_range")
    if row.get("cpu_us") is None or not spread or row.get("rounds", 1) < 2:
        return _f(row.get("cpu_us"))
    return f"{row['cpu_us']:.1f} ({spread[0]:.1f}-{spread[1]:.1f})"


def _base_probe(results: dict[str, Any], workload: str, probe: dict[str, Any]) -> dict[str, Any]:
    """Direct's probe of the same kind: the same rate, or the same closed-loop connections."""
    base = results.get("direct", {}).get("workloads", {}).get(workload, {})
    for candidate in base.get("probes", ()):
        if probe.get("connections"):
            if candidate.get("connections") == probe["connections"]:
                return dict(candidate)
        elif candidate["rate"] == probe["rate"] and not candidate.get("connections"):
            return dict(candidate)
    return {}


def probe_table(workload: str, results: dict[str, Any]) -> str:
    """The probes: added = this target's figure minus direct's in the same probe."""
    what = "time to first body byte" if workload == "b" else "latency"
    p50, p99 = ("ttfb_p50_ms", "ttfb_p99_ms") if workload == "b" else ("p50_ms", "p99_ms")
    if not any(e["workloads"].get(workload, {}).get("probes") for e in results.values()):
        return ""
    how = {
        "a": "our paced open-loop client on 32 keep-alive connections; latency from when each"
        " request is due; added = minus direct's at the same rate",
        "b": "our client, closed loop on a few keep-alive connections, each request sent as"
        " soon as the last one ended; the first chunk leaves the backend 2 ms after the head"
        " (a short prefill); added = minus direct's in the same probe",
    }[workload]
    lines = [
        f"Probe ({workload}): {how}.",
        "",
        f"| target | rate req/s | {what} P50 ms (added) | P99 ms (added) | full P50 ms | requests | errors |",  # noqa: E501
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = 0
    for name, entry in results.items():
        for probe in entry["workloads"].get(workload, {}).get("probes", ()):
            rows += 1
            if probe.get("over_capacity"):
                lines.append(f"| {entry['label']} | {probe['rate']:,.0f} | over capacity | | | | |")
                continue
            base = {} if name == "direct" else _base_probe(results, workload, probe)
            lines.append(
                f"| {entry['label']} | {probe['rate']:,.0f} | {_added(probe[p50], base.get(p50))} "
                f"| {_added(probe[p99], base.get(p99))} | {_f(probe['p50_ms'], '.3f')} "
                f"| {probe['requests']:,} | {probe['errors']} |"
            )
    return "\n".join(lines) if rows else ""


def _best(results: dict[str, Any], workload: str, kind: str, field_: str, most: bool = False):  # type: ignore[no-untyped-def]
    rows = [
        (entry["workloads"][workload][field_], entry["label"])
        for entry in results.values()
        if entry["kind"] == kind
        and entry["workloads"].get(workload, {}).get(field_) is not None
        and "invalid" not in entry["workloads"][workload]
    ]
    if not rows:
        return None
    return max(rows) if most else min(rows)


def ratio_lines(results: dict[str, Any], workloads: list[str]) -> list[str]:
    """Each Python target against the best C and the best Rust target of this run."""
    out = []
    for workload in workloads:
        field_, unit = ("kib_per_stream", "KiB/stream") if workload == "d" else ("cpu_us", "µs/req")
        for entry in results.values():
            row = entry["workloads"].get(workload, {})
            if entry["kind"] != "Python" or row.get(field_) is None or "invalid" in row:
                continue
            parts = []
            for kind in ("C", "Rust"):
                best = _best(results, workload, kind, field_)
                if best is not None and best[0]:
                    parts.append(
                        f"{row[field_] / best[0]:.2f}x best {kind} ({best[1]}, {best[0]:g} {unit})"
                    )
            line = f"({workload}) {entry['label']}: {row[field_]:g} {unit}"
            if parts:
                line += " = " + ", ".join(parts)
            if workload != "d":
                rps = []
                for kind in ("C", "Rust"):
                    best = _best(results, workload, kind, "rps", most=True)
                    if best is not None and best[0]:
                        rps.append(
                            f"{row['rps'] / best[0]:.2f}x best {kind} ({best[1]}, {best[0]:,.0f})"
                        )
                line += f"; {row['rps']:,.0f} req/s" + (" = " + ", ".join(rps) if rps else "")
            out.append(line)
    return out


def target_checks(results: dict[str, Any]) -> list[str]:
    """prefix-router against the issue's targets, from this run's figures only."""
    ours = results.get("prefix-router", {}).get("workloads")
    if not ours:
        return []
    out = []

    def check(ok: bool, text: str) -> None:
        out.append(f"- [{'x' if ok else ' '}] {text}")

    for workload in ("a", "b"):
        cpu = ours.get(workload, {}).get("cpu_us")
        if cpu is None:
            continue
        rust = _best(results, workload, "Rust", "cpu_us")
        c = _best(results, workload, "C", "cpu_us")
        mine = f"({workload}) CPU/request {cpu:g} µs"
        if rust:
            check(cpu < rust[0], f"{mine} below the best Rust peer's ({rust[1]}, {rust[0]:g} µs)")
        if c:
            check(cpu <= 2 * c[0], f"{mine} within 2x the best C's ({c[1]}, {c[0]:g} µs)")
    a = ours.get("a", {})
    for probe in a.get("probes", ()):
        base = _base_probe(results, "a", probe)
        rate = f"at {probe['rate']:,.0f} req/s"
        if probe.get("over_capacity"):
            check(False, f"(a) added latency {rate}: over prefix-router's capacity here")
        elif base.get("p50_ms") is not None:
            p50 = probe["p50_ms"] - base["p50_ms"]
            p99 = probe["p99_ms"] - base["p99_ms"]
            check(p50 <= 0.2, f"(a) added latency P50 {p50:.3f} ms ≤ 0.2 ms {rate}")
            check(p99 <= 1.0, f"(a) added latency P99 {p99:.3f} ms ≤ 1 ms {rate}")
    c_row = ours.get("c", {})
    c_base = results.get("direct", {}).get("workloads", {}).get("c", {})
    if c_row.get("request_mb_s") and c_base.get("request_mb_s"):
        mb, base_mb = c_row["request_mb_s"], c_base["request_mb_s"]
        check(mb >= 0.8 * base_mb, f"(c) {mb:,.1f} MB/s = {mb / base_mb:.0%} of direct's (≥ 80 %)")
        if a.get("rss_mib") is not None:
            grew = c_row["rss_mib"] - a["rss_mib"]
            check(
                grew < 8,
                f"(c) peak RSS {c_row['rss_mib']:g} MiB with 64 KiB bodies, {a['rss_mib']:g} MiB"
                f" with 4 KiB ones ({grew:+.1f} MiB; under 8 MiB taken as independent)",
            )
    per_stream = ours.get("d", {}).get("kib_per_stream")
    if per_stream is not None:
        rust_rows = [
            (e["workloads"]["d"]["kib_per_stream"], e["label"])
            for e in results.values()
            if e["kind"] == "Rust" and e["workloads"].get("d", {}).get("kib_per_stream") is not None
        ]
        mine = f"(d) {per_stream:g} KiB per idle stream"
        if rust_rows:
            low = min(rust_rows)
            check(
                per_stream < low[0], f"{mine} below every Rust peer's (lowest {low[1]}, {low[0]:g})"
            )
        else:
            out.append(f"- {mine} (no Rust peer ran)")
    return out


LEGEND = """Columns (medians over the rounds): req/s and P50/P99 from the closed-loop
throughput runs; proxy CPU µs/req = (utime + stime of the proxy's process tree over a run)
/ requests, with its range over the rounds; proxy core % = that CPU time / wall time (100 =
the proxy's core was the limit); CPU 0 % = the client side (generator, backends, this
script) in % of one core (near 100 = the client side was the limit); softirq % = interrupt
time on both CPUs, mostly the loopback network's, charged to no process (so in no CPU
figure above); others % = CPU taken meanwhile by processes outside this run (noise from a
shared machine); split = requests each backend answered."""


def report(doc: dict[str, Any]) -> str:
    meta, results = doc["meta"], doc["results"]
    parts = ["## How it ran", ""]
    parts += [f"- {k}: {v}" for k, v in meta.items()]
    parts += ["", "## What each target routes on", ""]
    parts += [f"- {e['label']} ({e['version']}): {e['key']}" for e in results.values()]
    if doc["skipped"]:
        parts += ["", "## Skipped", ""]
        parts += [f"- {name}: {reason}" for name, reason in doc["skipped"].items()]
    for workload in meta["workloads"]:
        parts += ["", table(workload, results)]
    parts += ["", LEGEND]
    lines = ratio_lines(results, meta["workloads"])
    if lines:
        parts += ["", "## Ratios (this run)", "", *(f"- {line}" for line in lines)]
    checks = target_checks(results)
    if checks:
        parts += ["", "## prefix-router against the issue's targets", "", *checks]
    return "\n".join(parts)


# ----------------------------------------------------------------- the run


def _backend_urls(text: str, count: int) -> list[str] | None:
    urls = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            urls.append(json.loads(line)["url"])
    return urls if len(urls) >= count else None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(opt: argparse.Namespace, command: str) -> dict[str, Any]:
    names = ["direct"] + [n for n in opt.targets if n != "direct"]
    reasons = availability(opt, names)
    wrk = shutil.which("wrk") is not None
    if opt.generator == "wrk" and not wrk:
        raise BenchError(
            "--generator wrk: wrk is not installed (apt-get install wrk, or --install)"
        )
    use_wrk = wrk and opt.generator != "python"
    if opt.generator == "auto" and not wrk:
        say("wrk is not installed: our Python generator drives the throughput runs")
    cpus = os.sched_getaffinity(0)
    pinned = opt.pin and len(cpus) >= 2 and cpus >= GEN_CPUS | PROXY_CPUS
    if opt.pin and not pinned:
        say(f"not pinning: CPUs {sorted(cpus)} do not include both 0 and 1")
    gen_cpus, proxy_cpus = (GEN_CPUS, PROXY_CPUS) if pinned else (None, None)
    _raise_fd_limit()
    tmp = Path(tempfile.mkdtemp(prefix="proxybench-"))
    backend = Proc(
        "fastbackend",
        [sys.executable, str(SELF.parent / "fastbackend.py"),
         "--count", str(opt.backends), "--events", str(opt.events)],
        tmp / "fastbackend.log",
    )  # fmt: skip
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    ctx: Ctx | None = None
    try:
        with on_cpu(gen_cpus):  # this script is part of the client side
            await backend.start(gen_cpus)
            urls = await backend.wait_for(lambda t: _backend_urls(t, opt.backends), "addresses")
            ctx = Ctx(opt, tmp, urls, backend.pid, gen_cpus, proxy_cpus, use_wrk)
            for workload in opt.workloads:
                marker = " [[sse:1000:5000]]" if workload == "d" else ""
                ctx.requests[workload] = build_requests(workload, opt.keys, marker)
                if workload != "d" and use_wrk:
                    script = tmp / f"workload-{workload}.lua"
                    _write(script, wrk_script(path_of(workload), ctx.requests[workload]))
                    ctx.scripts[workload] = script
            # The (b) probe's streams start 2 ms after their head, as after a short prefill.
            ctx.requests["b-probe"] = build_requests("b", opt.keys, f" [[sse:{opt.events}:0:2]]")
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
            versions: dict[str, str] = {}
            for name in names:
                if reasons.get(name):
                    skipped[name] = str(reasons[name])
                    say(f"{BY_NAME[name].label}: skipped: {skipped[name]}")
            for round_ in range(1, opt.rounds + 1):
                last = round_ == opt.rounds
                for name in names:
                    if name in skipped:
                        continue
                    target = BY_NAME[name]
                    say(f"{target.label}: starting (round {round_} of {opt.rounds})")
                    try:
                        running = await start_target(ctx, target)
                    except (BenchError, OSError, RuntimeError, TimeoutError) as exc:
                        skipped[name] = f"could not start: {exc}"
                        say(f"{target.label}: skipped: {skipped[name]}")
                        continue
                    try:
                        if running.pid:
                            pin_tree(running.pid, proxy_cpus)
                        rows = await measure_target(ctx, target, running, last)
                    finally:
                        await running.stop()
                    versions[name] = running.version
                    for workload, row in rows.items():
                        runs.setdefault(name, {}).setdefault(workload, []).append(row)
                    if name == "direct" and "a" in runs["direct"]:
                        rps = combine(runs["direct"]["a"]).get("rps") or 0
                        ctx.probe_rate = round(rps * opt.probe_fraction) or None
            for name, by_workload in runs.items():
                if name in skipped:
                    continue
                target = BY_NAME[name]
                results[name] = {
                    "label": target.label, "kind": target.kind, "key": target.key,
                    "version": versions[name],
                    "workloads": {w: _combined(rows) for w, rows in by_workload.items()},
                }  # fmt: skip
    finally:
        for child in reversed(ctx.children if ctx else []):
            await child.stop()
        await backend.stop()
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}",
        "pinning": "generator, backends and this script on CPU 0; proxy on CPU 1"
        if pinned
        else "none",
        "generator": f"wrk -t1 -c{opt.connections} ({_version(['wrk', '-v'])})"
        if use_wrk
        else f"Python closed loop, {opt.connections} connections",
        "seconds": f"{opt.seconds:g} s per run, {opt.warmup:g} s warm-up before each; "
        f"{opt.rounds} rounds over every target in turn, medians (the (d) run and the "
        "probes in the last round only)",
        "probes": f"(a) paced at {opt.probe_rate:g} req/s and at "
        f"{ctx.probe_rate if ctx else None} req/s ({opt.probe_fraction:.0%} of direct's (a)); "
        f"skipped where a target's closed-loop rate is under 1.25 x the probe's; (b) TTFB, "
        f"closed loop on {opt.ttfb_connections} connections; {opt.probe_seconds:g} s each",
        "backends": f"{opt.backends} x loadtests/fastbackend.py in one process, "
        f"{opt.events} SSE chunks per stream",
        "keys": opt.keys,
        "streams": opt.streams,
        "workloads": opt.workloads,
    }
    return {"meta": meta, "skipped": skipped, "results": results}


def _write_json(directory: Path, doc: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"proxybench-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


# ----------------------------------------------------------------- the naive floor


def floor(listen: str, backends: list[str]) -> None:
    """The naive-Python floor: what 30 lines of aiohttp give (uvloop, no access log)."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    hop = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
           "proxy-connection", "host", "content-length"}  # fmt: skip

    async def main() -> None:
        session = ClientSession(
            connector=TCPConnector(limit=0),
            timeout=ClientTimeout(total=None, sock_read=300),
            auto_decompress=False,
        )

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            base = backends[zlib.crc32(body[:PREFIX]) % len(backends)]
            headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
            url = base + request.path_qs
            async with session.request(request.method, url, data=body, headers=headers) as up:
                out = {k: v for k, v in up.headers.items() if k.lower() not in hop}
                response = web.StreamResponse(status=up.status, headers=out)
                if up.content_length is not None:
                    response.content_length = up.content_length
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, _, port = listen.rpartition(":")
        await web.TCPSite(runner, host, int(port), backlog=4096).start()
        say(f"floor listening {listen}")
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        await session.close()

    _runner()(main())


def _runner() -> Callable[[Any], Any]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run  # type: ignore[no-any-return]


# ----------------------------------------------------------------- command line


def _list(choices: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = choices if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (or all)")
        return items

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="proxybench",
        description="The proxy ladder: direct, HAProxy, nginx, sglang-router, vllm-router, "
        "an aiohttp floor and prefix-router in front of the same fast backends.",
    )
    p.add_argument(
        "--targets",
        type=_list([t.name for t in TARGETS]),
        default="all",
        help=f"comma-separated, from: {', '.join(t.name for t in TARGETS)} (all)",
    )
    p.add_argument(
        "--workloads",
        type=_list(list(WORKLOADS)),
        default="all",
        help="comma-separated from a,b,c,d (all)",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="measured run per workload (5)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all targets; figures are medians over rounds (3)",
    )
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured run before it (2)")
    p.add_argument("--probe-seconds", type=float, default=5.0, help="each latency probe (5)")
    p.add_argument(
        "--probe-rate",
        type=float,
        default=1000.0,
        help="(a) probe at this fixed rate, req/s (1000; 0: none)",
    )
    p.add_argument(
        "--probe-fraction",
        type=float,
        default=0.25,
        help="(a) and also at this share of direct's (a) req/s (0.25; 0: none)",
    )
    p.add_argument(
        "--ttfb-connections",
        type=int,
        default=2,
        help="(b) TTFB probe: closed loop on this many connections (2; 0: none)",
    )
    p.add_argument("--connections", type=int, default=32, help="throughput connections (32)")
    p.add_argument("--streams", type=int, default=2000, help="(d) idle streams (2000)")
    p.add_argument("--keys", type=int, default=64, help="distinct prompts cycled (64)")
    p.add_argument("--backends", type=int, default=2, help="fast backends (2)")
    p.add_argument("--events", type=int, default=64, help="SSE chunks per (b) stream (64)")
    p.add_argument(
        "--generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="throughput load generator: wrk if installed (auto), or ours",
    )
    p.add_argument(
        "--install",
        action="store_true",
        help="apt-get install wrk/haproxy/nginx and pip the peers if missing",
    )
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-peers", help="the peers' venv")
    p.add_argument("--results", type=Path, default=ROOT / "results", help="JSON goes here")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin CPUs")
    opt = p.parse_args(argv)  # fmt: skip
    if opt.seconds <= 0 or opt.warmup < 0 or opt.probe_seconds < 0 or opt.connections < 1:
        p.error("--seconds must be > 0, --warmup/--probe-seconds >= 0, --connections >= 1")
    if min(opt.keys, opt.backends, opt.streams, opt.events, opt.rounds) < 1:
        p.error("--keys, --backends, --streams, --events and --rounds must be >= 1")
    return opt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        p = argparse.ArgumentParser(prog="proxybench report", description="Print a saved run.")
        p.add_argument("json", type=Path, help="a results/proxybench-*.json file")
        say(report(json.loads(p.parse_args(argv[1:]).json.read_text())))
        return 0
    if argv[:1] == ["floor"]:
        p = argparse.ArgumentParser(prog="proxybench floor", description=floor.__doc__)
        p.add_argument("--listen", required=True, help="HOST:PORT")
        p.add_argument("--backend", action="append", required=True, help="http://HOST:PORT")
        args = p.parse_args(argv[1:])
        floor(args.listen, [u.rstrip("/") for u in args.backend])
        return 0
    opt = parse_args(argv)
    command = " ".join(["python", "loadtests/proxybench.py", *argv])
    try:
        doc = _runner()(run(opt, command))
    except BenchError as exc:
        print(f"proxybench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("proxybench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    path = _write_json(opt.results, doc)
    say("")
    say(report(doc))
    say("")
    say(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
