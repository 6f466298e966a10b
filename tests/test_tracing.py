"""Tracing (``--otel-endpoint``): spans reach a real OTLP/HTTP receiver, context reaches backends.

The receiver is an aiohttp server on 127.0.0.1 that decodes each POST with
``opentelemetry-proto``'s ``ExportTraceServiceRequest``, as a collector does; the
router is the real one (in this process, or ``prefix-router serve --workers 2``),
the backends record the heads they receive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from router.config import ConfigError, build_config
from router.tracing import parse_traceparent, truncate_tracestate
from tests.harness.backends import Backend, Seen, StartBackend, echo
from tests.harness.http import COMPLETION, WAIT, connect, quiet, req
from tests.harness.processes import ADMIN_PORTS, ROOT, admin_call, spawn_router, stop
from tests.harness.routers import StartRouter

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01".encode()
TENANT = b"x-amzn-sagemaker-prefix-aware-id"


@dataclass
class Received:
    span: Span
    resource: dict[str, Any]

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes(self.span.attributes)


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: every span it decoded, with its resource."""

    url: str = ""
    spans: list[Received] = field(default_factory=list)
    posts: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self, count: int) -> list[Received]:
        async with asyncio.timeout(WAIT):
            while len(self.spans) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.spans


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in pairs}


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    received = Collector()

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name == "prefix-router"
                received.spans += [Received(s, resource) for s in scope_spans.spans]
        received.posts += 1
        received.changed.set()
        return web.Response(body=b"", content_type="application/x-protobuf")

    async with receiver(traces) as url:
        received.url = url
        yield received


@contextlib.asynccontextmanager
async def receiver(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """An OTLP/HTTP endpoint on 127.0.0.1 whose POST /v1/traces ``handler`` answers: its URL."""
    app = web.Application()
    app.router.add_post("/v1/traces", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def otel(url: str, **overrides: Any) -> dict[str, Any]:
    return {"endpoint": url, "export_interval": 0.02, **overrides}


def sent_traceparent(seen: Seen) -> tuple[str, str, str]:
    """(trace id, parent id, flags) of the one traceparent a backend received."""
    values = seen.values("traceparent")
    assert len(values) == 1, values
    version, trace, parent, flags = values[0].decode().split("-")
    assert version == "00"
    return trace, parent, flags


async def get(router: Any, target: bytes, headers: bytes = b"") -> int:
    async with connect(router) as client:
        await client.send(req(b"GET", target, headers=headers))
        return (await client.response()).status


async def test_a_client_traceparent_makes_our_span_its_child_and_the_backends_parent(
    backends: StartBackend, start_router: StartRouter, collector: Collector, tmp_path: Path
) -> None:
    backend = await backends(echo)
    log = tmp_path / "access.log"
    router = await start_router(
        [backend.spec], otel=otel(collector.url, service_name="edge"), access_log=str(log)
    )
    headers = b"traceparent: %s\r\ntracestate: vendor=abc\r\n%s: t1\r\n" % (
        CLIENT_TRACEPARENT,
        TENANT,
    )
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION, headers=headers))
        resp = await client.response()
    assert resp.status == 200
    [received] = await collector.wait(1)
    span = received.span
    assert span.trace_id.hex() == CLIENT_TRACE
    assert span.parent_span_id.hex() == CLIENT_PARENT
    assert span.kind == Span.SPAN_KIND_SERVER
    assert span.trace_state == "vendor=abc"
    assert span.name == "POST /v1/completions"
    assert span.start_time_unix_nano < span.end_time_unix_nano
    assert span.flags == 0x301  # sampled, and its parent is remote
    # The backend's traceparent: the same trace, our span as its parent, sampled.
    [seen] = backend.requests
    assert sent_traceparent(seen) == (CLIENT_TRACE, span.span_id.hex(), "01")
    assert seen.values("tracestate") == [b"vendor=abc"]  # passed through
    # The routing attributes are the access log's fields, value for value.
    router.access.sync()
    [line] = log.read_text().splitlines()
    record = json.loads(line)
    attrs = received.attributes
    assert attrs["prefix_router.request_id"] == record["request_id"]
    assert attrs["prefix_router.kind"] == record["kind"] == "openai"
    assert attrs["prefix_router.prefix_hash"] == record["prefix_hash"]
    assert len(record["prefix_hash"]) == 16
    assert attrs["prefix_router.tenant_salted"] is record["tenant"] is True
    assert attrs["prefix_router.backend"] == record["backend"] == backend.name
    assert attrs["prefix_router.decision"] == record["decision"] == "primary"
    assert attrs["http.response.status_code"] == record["status"] == 200
    assert attrs["http.request.body.size"] == record["bytes_in"] == len(COMPLETION)
    assert attrs["http.response.body.size"] == record["bytes_out"] == len(resp.body)
    assert attrs["http.request.method"] == "POST"
    assert attrs["url.path"] == "/v1/completions"
    assert COMPLETION.decode()[:20] not in str(span)  # never the prompt
    assert received.resource["service.name"] == "edge"
    assert span.status.code == Status.STATUS_CODE_UNSET


async def test_without_a_traceparent_a_new_trace_starts_and_reaches_the_backend(
    backends: StartBackend, start_router: StartRouter, collector: Collector
) -> None:
    backend = await backends(echo)
    router = await start_router([backend.spec], otel=otel(collector.url))
    assert await get(router, b"/health") == 200
    assert await get(router, b"/health", b"traceparent: 00-zz-not-valid\r\n") == 200
    first, second = await collector.wait(2)
    for received, seen in zip((first, second), backend.requests, strict=True):
        span = received.span
        assert len(span.trace_id) == 16
        assert any(span.trace_id)
        assert span.parent_span_id == b""  # a root span
        assert span.flags == 0x101  # sampled, no remote parent
        # One traceparent (an invalid one is replaced, not forwarded next to ours).
        assert sent_traceparent(seen) == (span.trace_id.hex(), span.span_id.hex(), "01")
        assert received.attributes["prefix_router.kind"] == "passthrough"
        assert received.attributes["prefix_router.decision"] == "passthrough"
        assert "prefix_router.prefix_hash" not in received.attributes
        assert "prefix_router.ttft_ms" in received.attributes
        assert received.resource["service.name"] == "prefix-router"
    assert first.span.trace_id != second.span.trace_id


async def test_sampling_is_parent_based_and_the_ratio_applies_to_new_traces(
    backends: StartBackend, start_router: StartRouter, collector: Collector
) -> None:
    backend = await backends(echo)
    router = await start_router([backend.spec], otel=otel(collector.url, sample=0.0))
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-00".encode()
    assert await get(router, b"/new") == 200  # a new trace: ratio 0, not sampled
    assert await get(router, b"/unsampled", b"traceparent: %s\r\n" % unsampled) == 200
    assert await get(router, b"/sampled", b"traceparent: %s\r\n" % CLIENT_TRACEPARENT) == 200
    [received] = await collector.wait(1)  # only the client's sampled trace
    assert received.attributes["url.path"] == "/sampled"
    new, not_sampled, sampled = backend.requests
    assert sent_traceparent(new)[2] == "00"  # the decision travels on: the backend skips it too
    assert sent_traceparent(not_sampled)[:1] == (CLIENT_TRACE,)
    assert sent_traceparent(not_sampled)[2] == "00"
    assert sent_traceparent(sampled) == (CLIENT_TRACE, received.span.span_id.hex(), "01")
    await quiet(router)
    await router.shutdown()
    assert len(collector.spans) == 1  # nothing else came at the last flush


async def chunks(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
    """A streamed answer: the head, then three SSE events, each in its own write."""
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    for n in range(3):
        await writer.drain()
        event = b"data: %d\n\n" % n
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
    writer.write(b"0\r\n\r\n")
    return True


async def test_a_streamed_response_has_its_ttft_as_attribute_and_first_byte_event(
    backends: StartBackend, start_router: StartRouter, collector: Collector
) -> None:
    backend = await backends(chunks)
    router = await start_router([backend.spec], otel=otel(collector.url))
    body = b"x" * 5000  # native: keyed on the first PrefixLength bytes
    target = b"/generate/" + b"p" * 300  # lengths past one varint byte
    request_id = b"r" * 200
    headers = b"x-request-id: %s\r\ntracestate: %s\r\ntraceparent: %s\r\n" % (
        request_id,
        b"v=" + b"s" * 250,
        CLIENT_TRACEPARENT,
    )
    async with connect(router) as client:
        await client.send(req(b"POST", target, body=body, headers=headers))
        resp = await client.response()
    assert resp.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    [received] = await collector.wait(1)
    span = received.span
    attrs = received.attributes
    assert attrs["prefix_router.kind"] == "native"
    assert attrs["url.path"] == target.decode()
    assert attrs["prefix_router.request_id"] == request_id.decode()
    assert span.trace_state == "v=" + "s" * 250
    assert attrs["prefix_router.tenant_salted"] is False
    assert attrs["http.response.body.size"] == len(resp.body)
    assert span.name == "POST"  # native paths are the client's: not in the name
    [event] = span.events
    assert event.name == "first_byte"
    assert span.start_time_unix_nano <= event.time_unix_nano <= span.end_time_unix_nano
    ttft_ms = (event.time_unix_nano - span.start_time_unix_nano) / 1e6
    assert attrs["prefix_router.ttft_ms"] == pytest.approx(ttft_ms, abs=0.01)


async def test_an_error_answered_by_the_router_is_an_error_span(
    backends: StartBackend, start_router: StartRouter, collector: Collector
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    router = await start_router(
        [("gone", url)], otel=otel(collector.url), retries=0, health={"active": False}
    )
    assert await get(router, b"/health") == 502
    [received] = await collector.wait(1)
    assert received.attributes["http.response.status_code"] == 502
    assert received.attributes["error.type"] == "502"
    assert received.span.status.code == Status.STATUS_CODE_ERROR
    assert received.span.status.message == "could not connect to backend gone"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_collector_that_is_down_costs_requests_nothing_and_drops_are_counted(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(echo)
    down = f"http://127.0.0.1:{free_port()}"
    # The queue holds 4 spans; the exporter's first turn comes after the test.
    router = await start_router([backend.spec], otel=otel(down, export_interval=3600, max_queue=4))
    for n in range(10):
        assert await get(router, b"/r%d" % n) == 200
    assert len(backend.requests) == 10
    for seen in backend.requests:
        sent_traceparent(seen)  # context propagates whether or not spans can be exported
    assert router.tracer is not None
    assert router.tracer.dropped["queue_full"] == 6
    metrics = router.collector.render().decode()
    assert 'prefix_router_trace_spans_dropped_total{reason="queue_full"} 6.0' in metrics
    assert "prefix_router_trace_spans_queued 4.0" in metrics
    await quiet(router)
    await router.shutdown()  # the last flush fails: those 4 are counted too
    assert router.tracer.dropped["export_failed"] == 4
    assert router.tracer.export_errors == 1


async def test_tracing_off_adds_no_traceparent_and_forwards_the_clients_untouched(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(echo)
    router = await start_router([backend.spec])
    assert router.tracer is None
    assert await get(router, b"/a") == 200
    assert await get(router, b"/b", b"traceparent: %s\r\n" % CLIENT_TRACEPARENT) == 200
    plain, traced = backend.requests
    assert plain.values("traceparent") == []
    assert traced.values("traceparent") == [CLIENT_TRACEPARENT]
    assert "prefix_router_trace" not in router.collector.render().decode()


@pytest.mark.timeout(120)
async def test_serve_with_workers_exports_each_workers_spans(
    backends: StartBackend, collector: Collector, tmp_path: Path
) -> None:
    backend = await backends(echo)
    config = tmp_path / "router.toml"
    config.write_text(f'[otel]\nendpoint = "{collector.url}"\nexport_interval = 0.02\n')
    proc, port = await spawn_router(
        "--config",
        str(config),
        "--otel-service-name",
        "fleet-a",
        "--workers",
        "2",
        "--no-health-checks",
        "--backend",
        "{}={}".format(*backend.spec),
    )
    try:
        async with aiohttp.ClientSession() as http:
            # Each request on a connection of its own: SO_REUSEPORT spreads them; 2^-39
            # is the chance that 40 all land on one worker.
            for n in range(40):
                headers = {"Connection": "close", "traceparent": CLIENT_TRACEPARENT.decode()}
                async with http.get(f"http://127.0.0.1:{port}/r{n}", headers=headers) as resp:
                    assert resp.status == 200
            spans = await collector.wait(40)

            # The supervisor's /metrics adds up the workers' tracing counters (each
            # counts a batch once the collector answered: poll, bounded by WAIT).
            async def exported() -> float:
                _, _ = await admin_call(http, proc, "GET", "/admin/stats")  # a refresh
                url = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics"
                async with http.get(url) as resp:
                    text = await resp.text()
                (line,) = [
                    line
                    for line in text.splitlines()
                    if line.startswith("prefix_router_trace_spans_exported_total ")
                ]
                return float(line.split()[1])

            async with asyncio.timeout(WAIT):
                while True:
                    if await exported() == 40:
                        break
                    await asyncio.sleep(0.05)
    finally:
        await stop(proc)
    assert {r.resource["service.name"] for r in spans} == {"fleet-a"}
    assert len({r.resource["process.pid"] for r in spans}) == 2  # both workers export
    assert len({r.resource["service.instance.id"] for r in spans}) == 2
    by_path = {r.attributes["url.path"]: r.span for r in spans}
    for seen in backend.requests:
        span = by_path[seen.target.decode()]
        assert span.trace_id.hex() == CLIENT_TRACE
        assert sent_traceparent(seen) == (CLIENT_TRACE, span.span_id.hex(), "01")


async def test_a_bad_otel_setting_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"must be an http:// or https:// URL - at `\$.otel`"):
        build_config({"otel": {"endpoint": "collector:4318"}})
    with pytest.raises(ConfigError, match=r"<= 1.0 - at `\$.otel.sample`"):
        build_config({"otel": {"endpoint": "http://c:4318", "sample": 2}})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "admin",
        "serve",
        "--otel-endpoint",
        "ftp://collector",
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"otel endpoint 'ftp://collector' must be an http:// or https:// URL" in err


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (CLIENT_TRACEPARENT, (CLIENT_TRACE.encode(), CLIENT_PARENT.encode(), 1)),
        (b"  " + CLIENT_TRACEPARENT + b"\t", (CLIENT_TRACE.encode(), CLIENT_PARENT.encode(), 1)),
        # a later version: its first four fields, whatever follows a dash
        (b"cc-%s-%s-00-what-ever" % (CLIENT_TRACE.encode(), CLIENT_PARENT.encode()), "ok"),
        (CLIENT_TRACEPARENT + b"-extra", None),  # version 00 has exactly four fields
        (b"ff-%s-%s-01" % (CLIENT_TRACE.encode(), CLIENT_PARENT.encode()), None),
        (b"00-%s-%s-01" % (b"0" * 32, CLIENT_PARENT.encode()), None),
        (b"00-%s-%s-01" % (CLIENT_TRACE.encode(), b"0" * 16), None),
        (CLIENT_TRACEPARENT.upper(), None),  # lowercase hex only
        (b"00-%s-%s-01" % (CLIENT_TRACE.encode()[:-1], CLIENT_PARENT.encode()), None),
        (b"", None),
        (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g", None),
    ],
)
def test_traceparent_values_are_read_as_w3c_trace_context_says(
    value: bytes, parsed: object
) -> None:
    result = parse_traceparent(value)
    if parsed == "ok":
        assert result is not None
        assert result[2] == 0
    else:
        assert result == parsed


async def test_a_huge_client_tracestate_is_truncated_on_the_span_and_forwarded_whole(
    backends: StartBackend, start_router: StartRouter, collector: Collector
) -> None:
    # A client's tracestate is recorded on every span it starts; before, all of it
    # (up to max_header_bytes, 32 KiB): 256 such spans filled the 8 MiB export
    # queue that holds ~16,000 ordinary ones, and everyone else's were dropped.
    backend = await backends(echo)
    router = await start_router([backend.spec], otel=otel(collector.url))
    members = [b"k%02d=%s" % (i, b"v" * 20) for i in range(40)]  # 24 bytes each
    cases = [
        b"a=1,big=" + b"x" * 20_000 + b",c=3",  # an oversize member: dropped, the rest kept
        b",".join(members),  # 999 bytes: the first 20 members (499 bytes)
        b"z=" + b"x" * 30_000,  # nothing worth keeping
    ]
    for tracestate in cases:
        headers = b"traceparent: %s\r\ntracestate: %s\r\n" % (CLIENT_TRACEPARENT, tracestate)
        assert await get(router, b"/t", headers) == 200
    received = await collector.wait(3)
    assert [r.span.trace_state for r in received] == [
        "a=1,c=3",
        ",".join(m.decode() for m in members[:20]),
        "",
    ]
    # The backend gets the client's header untouched, as without tracing.
    assert [seen.values("tracestate") for seen in backend.requests] == [[c] for c in cases]
    tracer = router.tracer
    assert tracer is not None
    assert tracer.dropped["queue_full"] == 0


def test_tracestate_truncation_keeps_w3c_limits() -> None:
    assert truncate_tracestate(b"a=1, b=2") == b"a=1, b=2"  # short: as sent
    many = b",".join(b"m%d=1" % i for i in range(200))  # 200 members, 1,089 bytes
    kept = truncate_tracestate(many).split(b",")
    assert kept == [b"m%d=1" % i for i in range(32)]  # at most 32 members
    small, big = b"a=" + b"1" * 126, b"b=" + b"2" * 127  # 128 and 129 bytes
    assert truncate_tracestate(b" ,".join([small, big] * 5)) == b",".join([small] * 3)


async def test_a_collector_answering_an_endless_body_costs_64_kib_an_export(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # Whatever the endpoint points at answers 200 and a body with no end (here 256 MiB
    # then silence). Before, the exporter read all of it until EXPORT_TIMEOUT (10 s),
    # each export: the router's memory grew by what loopback carried meanwhile (the
    # 256 MiB here), and the export failed, retried, its spans dropped.
    sent = 0
    over = asyncio.Event()  # the test is over: the handler may return

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/x-protobuf"})
        await response.prepare(request)
        piece = b"\0" * 65536
        for _ in range(4096):
            await response.write(piece)
            sent += len(piece)
        await over.wait()  # then nothing, no end while the test runs
        return response

    async with receiver(endless) as url:
        backend = await backends(echo)
        router = await start_router([backend.spec], otel=otel(url))
        tracer = router.tracer
        assert tracer is not None
        try:
            for n in range(3):
                assert await get(router, b"/r%d" % n) == 200
                async with asyncio.timeout(5):
                    while True:  # each export ends once 64 KiB of its answer are read
                        if tracer.exported == n + 1:
                            break
                        await asyncio.sleep(0.01)
            assert tracer.export_errors == 0
            assert sent < 4096 * 65536  # each connection dropped before the end came
        finally:
            over.set()
