"""Loop-stall benchmark: how long one request can keep every other client waiting.

    python -m loadtests.bench_stall [--body-mib 31.9] [--repeats 2] [--adds 200]
                                    [--stats-backends 2001] [--only SUBSTRING]

Starts ``loadtests.fastbackend`` (answers at once, keeps no body) and
``prefix-router serve`` in front of it with its admin listener, all on
127.0.0.1, then runs a probe: one keep-alive connection sending a small chat
request every ``--probe-ms`` (1 ms) and timing each answer: by default a body
the router refuses itself (400, connection kept), so that the figure is the
router's loop and not the backend, which receives the large bodies too
(``--probe-backend`` sends a real chat request instead).  While the probe
runs, each shape is sent on a connection of its own:

- data plane, bodies just under ``max_body_bytes`` (32 MiB): the pathological
  OpenAI shapes of issue 10 item 3 (a tool of 11 M empty lists, 11 M empty
  tools, 2.7 M content parts, 1 M messages, 11 M empty messages, 6 M token
  ids flat and nested, 5 M prompt strings, 32 MiB strings plain and escaped)
  and random large bodies of three kinds (chat, tools, an unread field);
- the wire (a review of the request path): a native and a chat body of
  ``--chunked-mib`` sent in 2-byte chunks, 6,000 pipelined ``GET /health``
  in one write, and a response of ``--chunked-mib`` that the backend sends
  in 2-byte chunks (``GET /_tiny/N``);
- admin API (item 5): ``PATCH weight=1000`` and back to 1, ``--adds``
  backends added one by one, ``GET /admin/stats`` on a second router started
  with ``--stats-backends`` backends.

For each shape it prints the longest probe latency seen while the shape was
in flight (a probe sent during a stall waits for it: that latency is the
stall as a client sees it), the probe's median and maximum over a baseline
window of the same run with no shape, and the ratio of the two.  Each data
shape is sent ``--repeats`` times; the worst is shown.  "extract ms" is
``decode_openai`` + ``prompt_key`` of the same body timed in this process:
the part of the stall that is routing-key extraction.  Every wait has a
timeout, the run stops by itself, and only processes it started are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial

from . import fleet

MiB = 1024 * 1024
SHAPE_TIMEOUT_S = 120.0
PROBE_BODY = json.dumps(
    {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}
).encode()
# Answered by the router itself (400, keep-alive): the probe then measures the
# router's loop alone, not the backend that receives the large bodies too.
LOCAL_PROBE_BODY = b'{"messages": 1}'


class Http:
    """A minimal HTTP/1.1 keep-alive client: enough for Content-Length answers."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head)
        if body:
            self.writer.write(body)
        await self.writer.drain()
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        answer = await self.reader.readexactly(length)
        if any(line.lower().startswith("connection: close") for line in lines):
            await self.close()
        return status, answer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def blocking_post(url: str, path: str, body: bytes) -> int:
    """POST ``body`` on a new connection with a blocking socket; the status (body read)."""
    host, port = host_port(url)
    with socket.create_connection((host, port), timeout=SHAPE_TIMEOUT_S) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        sock.sendall(head)
        sock.sendall(body)  # releases the GIL while the kernel takes it
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    return int(raw.split(b" ", 2)[1])


def host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


class Probe:
    """Small requests back to back on one connection; each one's (sent, latency)."""

    def __init__(self, url: str, interval: float, local: bool = True):
        self.client = Http(*host_port(url))
        self.body, self.expect = (LOCAL_PROBE_BODY, 400) if local else (PROBE_BODY, 200)
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self.answered = asyncio.Event()  # set at each answer

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            sent = time.perf_counter()
            async with asyncio.timeout(SHAPE_TIMEOUT_S):
                status, _ = await self.client.request("POST", "/v1/chat/completions", self.body)
            if status != self.expect:
                raise fleet.FleetError(f"probe got HTTP {status}")
            self.samples.append((sent, time.perf_counter() - sent))
            self.answered.set()
            await asyncio.sleep(self.interval)
        await self.client.close()

    def worst(self, start: float, end: float) -> float:
        """The longest latency of probes in flight at some time in [start, end]."""
        worst = 0.0
        for sent, latency in self.samples:
            if sent <= end and sent + latency >= start:
                worst = max(worst, latency)
        return worst

    def window(self, start: float, end: float) -> list[float]:
        return [latency for sent, latency in self.samples if start <= sent <= end]

    async def settle(self) -> None:
        """Wait until the probe has answered a request sent after now."""
        mark = time.perf_counter()
        async with asyncio.timeout(SHAPE_TIMEOUT_S):
            while not self.samples or self.samples[-1][0] < mark:
                self.answered.clear()
                await self.answered.wait()


# -- bodies ----------------------------------------------------------------------


def filled(head: bytes, unit: bytes, tail: bytes, size: int) -> bytes:
    count = max(1, (size - len(head) - len(tail)) // (len(unit) + 1))
    return head + b",".join([unit] * count) + tail


def random_text(rng: random.Random, size: int) -> str:
    alphabet = 'abcdefghij klmnop\n"\\é€😀\x01'
    return "".join(rng.choices(alphabet, k=size))


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.random()
    if depth > 6 or kind < 0.3:
        return rng.choice([0, -1.5, True, None, "", "x", random_text(rng, rng.randint(0, 20))])
    if kind < 0.65:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 8))]
    return {random_text(rng, 4): random_value(rng, depth + 1) for _ in range(rng.randint(0, 8))}


def random_body(kind: str, size: int, seed: int) -> bytes:
    """A random OpenAI-shaped JSON body of about ``size`` bytes."""
    rng = random.Random(seed)
    pieces: list[bytes] = []
    total = 0
    while total < size - 4096:
        if kind == "chat":
            content: object = random_text(rng, rng.randint(0, 200))
            if rng.random() < 0.3:
                content = [
                    {"type": rng.choice(["text", "image_url"]), "text": random_text(rng, 5)}
                    for _ in range(rng.randint(0, 30))
                ]
            item: object = {"role": rng.choice(["user", "assistant", ""]), "content": content}
        else:
            item = random_value(rng)
        piece = json.dumps(item, ensure_ascii=rng.random() < 0.5).encode()
        pieces.append(piece)
        total += len(piece) + 1
    array = b"[" + b",".join(pieces) + b"]"
    if kind == "chat":
        return b'{"model":"m","messages":' + array + b"}"
    if kind == "tools":
        return b'{"tools":' + array + b',"messages":[{"role":"user","content":"hi"}]}'
    return b'{"model":"m","junk":' + array + b',"messages":[{"role":"user","content":"hi"}]}'


def data_shapes(size: int) -> list[tuple[str, str, Callable[[], bytes]]]:
    chat, completions = "/v1/chat/completions", "/v1/completions"
    hi = b'"messages":[{"role":"user","content":"hi"}]'
    return [
        ("tools[0]: 11 M empty lists", chat,
         lambda: filled(b'{"tools":[{"a":[', b"[]", b"]}]," + hi + b"}", size)),
        ("tools: 11 M empty tools", chat,
         lambda: filled(b'{"tools":[', b"[]", b"]," + hi + b"}", size)),
        ("one message, 2.7 M content parts", chat,
         lambda: filled(b'{"messages":[{"role":"user","content":[',
                        b'{"type":"text","text":""}', b"]}]}", size)),
        ("1 M messages", chat,
         lambda: filled(b'{"messages":[', b'{"role":"","content":""}', b"]}", size)),
        ("11 M empty messages", chat, lambda: filled(b'{"messages":[', b"{}", b"]}", size)),
        ("6 M token ids", completions, lambda: filled(b'{"prompt":[', b"1", b"]}", size)),
        ("6 M token ids, nested", completions,
         lambda: filled(b'{"prompt":[[', b"1", b"]]}", size)),
        ("5 M prompt strings", completions, lambda: filled(b'{"prompt":[', b'"a"', b"]}", size)),
        ("32 MiB content string", chat,
         lambda: b'{"messages":[{"role":"user","content":"' + b"a" * (size - 64) + b'"}]}'),
        ("32 MiB content string of \\n", chat,
         lambda: b'{"messages":[{"role":"user","content":"'
         + b"\\n" * ((size - 64) // 2) + b'"}]}'),
        ("32 MiB prompt string of \\n", completions,
         lambda: b'{"prompt":"' + b"\\n" * ((size - 64) // 2) + b'"}'),
        ("unread field: 11 M empty objects", chat,
         lambda: filled(b'{' + hi + b',"x":[', b"{}", b"]}", size)),
        ("random chat", chat, lambda: random_body("chat", size, 1)),
        ("random tools", chat, lambda: random_body("tools", size, 2)),
        ("random unread field", chat, lambda: random_body("junk", size, 3)),
    ]  # fmt: skip


def tiny_chunks(data: bytes, size: int = 2) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i : i + size]), data[i : i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"  # fmt: skip


def wire_shapes(size: int) -> list[tuple[str, int, Callable[[], bytes]]]:
    """Requests framed to cost the parser most: (name, answers expected, raw bytes)."""
    chunked = b"Host: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    text = b"a" * (size - 64)
    tiny = 6000
    return [
        ("native body in 2-byte chunks", 1,
         lambda: b"POST /invocations HTTP/1.1\r\n" + chunked + tiny_chunks(text)),
        ("chat body in 2-byte chunks", 1,
         lambda: b"POST /v1/chat/completions HTTP/1.1\r\n" + chunked + tiny_chunks(
             b'{"messages":[{"role":"user","content":"' + text + b'"}]}')),
        (f"{tiny:,} pipelined GET /health", tiny,
         lambda: b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * tiny),
        ("response in 2-byte chunks", 0,
         lambda: b"GET /_tiny/%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % size),
    ]  # fmt: skip


def posted(url: str, path: str, body: bytes) -> str:
    return f"HTTP {blocking_post(url, path, body)}"


def blocking_raw(url: str, raw: bytes, answers: int) -> str:
    """Send ``raw`` on a new connection; read until ``answers`` status lines (0: all
    there is) or the close."""
    # Counted a read at a time (this thread holds the GIL the probe needs).
    status_line = b"HTTP/1.1 "
    with socket.create_connection(host_port(url), timeout=SHAPE_TIMEOUT_S) as sock:
        sock.sendall(raw)
        seen, tail, statuses = 0, b"", set[str]()
        while (not answers or seen < answers) and (chunk := sock.recv(1 << 16)):
            window = tail + chunk
            seen += window.count(status_line)
            at = window.find(status_line)
            if at >= 0 and len(statuses) < 4:
                statuses.add(window[at + 9 : at + 12].decode())
            tail = window[-(len(status_line) - 1) :]
    return f"{seen} answers, HTTP {'/'.join(sorted(statuses)) or '-'}"


# -- the run -------------------------------------------------------------------------


Row = tuple[str, str, float, str, str]  # shape, body, worst probe latency (s), extract, note


def extract_ms(path: str, body: bytes) -> str:
    """``decode_openai`` + ``prompt_key`` (PrefixLength 4,096) of ``body`` here.

    The share of the stall that extraction is, against the rest (reading,
    copying and forwarding the body).
    """
    from router.extract import BadRequest, decode_openai, prompt_key

    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        with contextlib.suppress(BadRequest):  # as Exchange calls them
            prompt_key(decode_openai(body), 4096)
        best = min(best, time.perf_counter() - start)
    return f"{best * 1e3:,.1f}"


async def timed(probe: Probe, action: Callable[[], Awaitable[str]]) -> tuple[float, str]:
    """The worst probe latency while ``action`` runs, and its note."""
    await probe.settle()  # what this process did before (building a body) is not counted
    start = time.perf_counter()
    async with asyncio.timeout(SHAPE_TIMEOUT_S):
        note = await action()
    end = time.perf_counter()
    await probe.settle()
    return probe.worst(start, end), note


async def worst_of(
    probe: Probe, name: str, repeats: int, blocking: Callable[[], str]
) -> tuple[float, str]:
    """The worst probe latency over ``repeats`` runs of ``blocking`` (in a thread:
    buffering 32 MiB in this process's own loop would stall the probe here, not
    in the router), and the last run's note."""
    worst, notes = 0.0, list[str]()
    for _ in range(repeats):

        async def send() -> str:
            sent = time.perf_counter()
            note = await asyncio.to_thread(blocking)
            return f"{note} in {(time.perf_counter() - sent) * 1e3:,.0f} ms"

        stall, note = await timed(probe, send)
        worst = max(worst, stall)
        notes.append(note)
    fleet.say(f"  {name}: worst probe {worst * 1e3:,.1f} ms ({'; '.join(notes)})")
    return worst, notes[-1]


async def data_rows(probe: Probe, url: str, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    size = int(args.body_mib * MiB)
    for name, path, make in data_shapes(size):
        if args.only and args.only not in name:
            continue
        body = make()
        worst, note = await worst_of(probe, name, args.repeats, partial(posted, url, path, body))
        rows.append((name, f"{len(body) / MiB:.1f} MiB", worst, extract_ms(path, body), note))
        del body
    for name, answers, build in wire_shapes(int(args.chunked_mib * MiB)):
        if args.only and args.only not in name:
            continue
        raw = build()
        worst, note = await worst_of(
            probe, name, args.repeats, partial(blocking_raw, url, raw, answers)
        )
        size_note = (
            f"{len(raw) / MiB:.1f} MiB on the wire"
            if answers
            else (f"{args.chunked_mib:g} MiB answered ({args.chunked_mib * 3.5:g} MiB on the wire)")
        )
        rows.append((name, size_note, worst, "-", note))
    return rows


async def admin_rows(
    probe: Probe, admin: str, backend_url: str, args: argparse.Namespace
) -> list[Row]:
    rows: list[Row] = []
    client = Http(*host_port(admin))

    async def call(method: str, path: str, payload: object = None) -> str:
        body = b"" if payload is None else json.dumps(payload).encode()
        sent = time.perf_counter()
        status, answer = await client.request(method, path, body)
        if status >= 300:
            raise fleet.FleetError(f"{method} {path}: HTTP {status} {answer[:200]!r}")
        return f"HTTP {status} in {(time.perf_counter() - sent) * 1e3:,.0f} ms"

    for weight in (1000, 1):
        patch = partial(call, "PATCH", "/admin/backends/fb-0", {"weight": weight})
        stall, note = await timed(probe, patch)
        rows.append((f"PATCH weight={weight}", "-", stall, "-", note))
        fleet.say(f"  PATCH weight={weight}: worst probe {stall * 1e3:,.1f} ms ({note})")
    if args.adds:
        durations: list[float] = []

        async def add_all() -> str:
            for i in range(args.adds):
                sent = time.perf_counter()
                await call("POST", "/admin/backends", {"name": f"extra-{i}", "url": backend_url})
                durations.append(time.perf_counter() - sent)
            return (
                f"per add: median {statistics.median(durations) * 1e3:,.0f} ms, "
                f"last {durations[-1] * 1e3:,.0f} ms"
            )

        stall, note = await timed(probe, add_all)
        rows.append((f"add {args.adds} backends one by one", "-", stall, "-", note))
        fleet.say(f"  adds: worst probe {stall * 1e3:,.1f} ms ({note})")
        stall, note = await timed(probe, lambda: call("GET", "/admin/stats"))
        rows.append((f"GET /admin/stats, {args.adds + 1} backends", "-", stall, "-", note))
    await client.close()
    return rows


async def stats_row(
    children: list[fleet.Child], backend_url: str, args: argparse.Namespace
) -> list[Row]:
    """``GET /admin/stats`` on a router started with ``--stats-backends`` backends."""
    if not args.stats_backends:
        return []
    sims = {f"b-{i}": backend_url for i in range(args.stats_backends)}
    started = time.perf_counter()
    router, url, admin = await fleet.start_router(
        children, sims, "--no-health-checks", label="router-stats"
    )
    took = time.perf_counter() - started
    probe = Probe(url, args.probe_ms / 1000, not args.probe_backend)
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    try:
        await probe.settle()
        client = Http(*host_port(admin))

        async def stats() -> str:
            sent = time.perf_counter()
            status, _ = await client.request("GET", "/admin/stats")
            return f"HTTP {status} in {(time.perf_counter() - sent) * 1e3:,.0f} ms"

        worst, notes = 0.0, list[str]()
        for _ in range(args.repeats):
            stall, note = await timed(probe, stats)
            worst, notes = max(worst, stall), [*notes, note]
        await client.close()
    finally:
        stop.set()
        await task
        await router.stop()
    note = f"{notes[-1]}; router started in {took:.1f} s"
    fleet.say(f"  stats with {args.stats_backends} backends: worst probe {worst * 1e3:,.1f} ms")
    return [(f"GET /admin/stats, {args.stats_backends} backends", "-", worst, "-", note)]


async def main_async(args: argparse.Namespace) -> None:
    children: list[fleet.Child] = []
    try:
        backend = await fleet.spawn(
            children, "fastbackend", "loadtests.fastbackend", "--count", "1", stdout=True
        )
        deadline = asyncio.get_running_loop().time() + fleet.START_TIMEOUT_S
        line = await fleet.next_line(backend, "the backend's address", deadline, stdout=True)
        backend_url = json.loads(line)["url"]
        router, url, admin = await fleet.start_router(
            children, {"fb-0": backend_url}, "--no-health-checks"
        )
        probe = Probe(url, args.probe_ms / 1000, not args.probe_backend)
        stop = asyncio.Event()
        task = asyncio.create_task(probe.run(stop))
        try:
            await probe.settle()
            await asyncio.sleep(args.baseline_s)  # the baseline window
            base = probe.window(probe.samples[0][0], time.perf_counter())
            rows = await data_rows(probe, url, args) if not args.admin_only else []
            if not args.data_only:
                rows += await admin_rows(probe, admin, backend_url, args)
        finally:
            stop.set()
            await task
        await router.stop()
        if not args.data_only:
            rows += await stats_row(children, backend_url, args)
    finally:
        for child in reversed(children):
            await child.stop()
    median, worst = statistics.median(base), max(base)
    print(
        f"\n# loop stall: probe every {args.probe_ms:g} ms, baseline {len(base)} probes: "
        f"median {median * 1e3:.2f} ms, max {worst * 1e3:.2f} ms; "
        f"worst of {args.repeats} per data shape"
    )
    print(
        "| shape | body | longest probe ms | baseline median ms | baseline max ms | ratio "
        "| extract ms | note |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, body, stall, extract, note in rows:
        print(
            f"| {name} | {body} | {stall * 1e3:,.1f} | {median * 1e3:.2f} | {worst * 1e3:.2f} "
            f"| {stall / median:,.0f}x | {extract} | {note} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_stall", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--body-mib", type=float, default=31.9, help="data shapes' size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--probe-ms", type=float, default=1.0)
    parser.add_argument(
        "--probe-backend", action="store_true", help="probe through the backend, not a local 400"
    )
    parser.add_argument(
        "--chunked-mib", type=float, default=3.0, help="bodies sent in 2-byte chunks"
    )
    parser.add_argument("--baseline-s", type=float, default=2.0)
    parser.add_argument("--adds", type=int, default=200, help="backends added one by one")
    parser.add_argument("--stats-backends", type=int, default=2001, help="0: skip")
    parser.add_argument("--only", default="", help="data shapes whose name contains this")
    parser.add_argument("--data-only", action="store_true")
    parser.add_argument("--admin-only", action="store_true")
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
