"""What a traced request's span costs to make and encode, three ways.

    python -m loadtests.bench_tracing [--spans 20000] [--sdk PATH]

Per span, on one realistic exchange (an OpenAI request routed ``primary``,
tenant-salted, with a TTFT): ``hand`` is ``router.tracing``'s own protobuf
writer (what the router runs); ``proto`` builds the same ``Span`` with the
``opentelemetry-proto`` classes and serialises it; ``sdk`` (with ``--sdk``, a
directory where ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-common``
are installed, e.g. ``pip install --target DIR ...``) starts and ends an SDK
span with the same attributes under a BatchSpanProcessor and encodes it with
the SDK's own OTLP encoder.  Also ``begin``: ``Tracer.begin`` (the part on the
request's way in: traceparent parsing, ids, the upstream header).  Medians of
5 runs, microseconds per span; the process's CPU time, so a busy machine
moves it less than wall time would.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.config import OtelConfig
from router.heads import Request
from router.tracing import Span, Tracer, encode_request, encode_span

ATTRS: dict[str, Any] = {
    "http.request.method": "POST",
    "url.path": "/v1/chat/completions",
    "prefix_router.request_id": "9f86d081-1a2b",
    "prefix_router.kind": "openai",
    "prefix_router.tenant_salted": True,
    "http.request.body.size": 4321,
    "http.response.body.size": 812,
    "http.response.status_code": 200,
    "prefix_router.prefix_hash": "0123456789abcdef",
    "prefix_router.backend": "gpu-0",
    "prefix_router.decision": "primary",
    "prefix_router.ttft_ms": 12.345,
}


class _Backend:
    name = "gpu-0"


class _Choice:
    backend = _Backend()
    label = "primary"


class _Exchange:
    """The fields ``encode_span`` reads, as a finished exchange has them."""

    method = b"POST"
    path = b"/v1/chat/completions"
    request_id = b"9f86d081-1a2b"
    kind = "openai"
    tenant = True
    bytes_in = 4321
    bytes_out = 812
    status = 200
    key_hash = 0x0123456789ABCDEF
    choice = _Choice()
    started = 100.0
    ttft = 100.012345
    ended = 100.02
    span: Span | None = None


def _per_span(fn: Callable[[], object], spans: int) -> float:
    """Median CPU µs per call over 5 runs."""
    runs = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(spans):
            fn()
        runs.append((time.process_time() - start) / spans * 1e6)
    return statistics.median(runs)


def _proto_span(span: Span) -> Callable[[], bytes]:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    def value(v: Any) -> AnyValue:
        if isinstance(v, bool):
            return AnyValue(bool_value=v)
        if isinstance(v, int):
            return AnyValue(int_value=v)
        if isinstance(v, float):
            return AnyValue(double_value=v)
        return AnyValue(string_value=v)

    def build() -> bytes:
        message = PbSpan(
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_span_id=span.parent_id,
            name="POST /v1/chat/completions",
            kind=PbSpan.SPAN_KIND_SERVER,
            start_time_unix_nano=1_700_000_000_000_000_000,
            end_time_unix_nano=1_700_000_000_020_000_000,
            attributes=[KeyValue(key=k, value=value(v)) for k, v in ATTRS.items()],
            events=[PbSpan.Event(time_unix_nano=1_700_000_000_012_345_000, name="first_byte")],
            status=Status(),
            flags=0x301,
        )
        data: bytes = message.SerializeToString()
        return data

    return build


def _sdk(path: Path, spans: int) -> tuple[float, float]:
    """(start+end µs, encode µs) per span with opentelemetry-sdk."""
    sys.path.insert(0, str(path))
    # Imported by name: the SDK is not a dependency of this project (nor typed).
    encoder = importlib.import_module("opentelemetry.exporter.otlp.proto.common.trace_encoder")
    sdk = importlib.import_module("opentelemetry.sdk.trace")
    export: Any = importlib.import_module("opentelemetry.sdk.trace.export")
    server = importlib.import_module("opentelemetry.trace").SpanKind.SERVER

    finished: list[Any] = []

    class Keep(export.SpanExporter):  # type: ignore[misc]
        def export(self, batch: Any) -> Any:
            finished.extend(batch)
            return export.SpanExportResult.SUCCESS

    provider = sdk.TracerProvider()
    provider.add_span_processor(export.BatchSpanProcessor(Keep(), max_queue_size=spans * 6))
    tracer = provider.get_tracer("prefix-router")

    def one() -> None:
        s = tracer.start_span("POST /v1/chat/completions", kind=server)
        s.set_attributes(ATTRS)
        s.add_event("first_byte")
        s.end()

    make = _per_span(one, spans)
    provider.force_flush()
    batch = finished[:512]
    start = time.process_time()
    rounds = max(1, spans // 512)
    for _ in range(rounds):
        encoder.encode_spans(batch).SerializeToString()
    encode = (time.process_time() - start) / (rounds * len(batch)) * 1e6
    provider.shutdown()
    return make, encode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_tracing")
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--sdk", type=Path, default=None, help="where opentelemetry-sdk is")
    args = parser.parse_args(argv)
    tracer = Tracer(OtelConfig(endpoint="http://127.0.0.1:4318"), b"\r\nvia: 1.1 x")
    request = Request(b"POST", b"/v1/chat/completions")
    request.headers = [
        (b"Host", b"router"),
        (b"Content-Type", b"application/json"),
        (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ]
    headers = request.headers
    exchange = _Exchange()
    span = exchange.span = tracer.begin(request)

    def begin() -> None:
        request.headers = headers
        tracer.begin(request)

    hand = _per_span(lambda: encode_span(exchange, span, 0), args.spans)  # type: ignore[arg-type]
    print(f"begin (traceparent in, ids, upstream header): {_per_span(begin, args.spans):.2f} µs")
    print(f"hand  (router.tracing.encode_span):           {hand:.2f} µs per span")
    encoded = [encode_span(exchange, span, 0) for _ in range(512)]  # type: ignore[arg-type]
    wrap = _per_span(lambda: encode_request(b"", encoded), max(1, args.spans // 512)) / 512
    print(f"      + request around a 512-span batch:      {wrap:.2f} µs per span")
    try:
        proto = _per_span(_proto_span(span), args.spans)
        print(f"proto (opentelemetry-proto classes):          {proto:.2f} µs per span")
    except ImportError:
        print("proto: opentelemetry-proto is not installed (pip install '.[otel]')")
    if args.sdk is not None:
        make, encode = _sdk(args.sdk, args.spans)
        print(f"sdk   (start, 12 attributes, event, end):     {make:.2f} µs per span")
        print(f"      + its OTLP encoder:                     {encode:.2f} µs per span")
    return 0


if __name__ == "__main__":
    sys.exit(main())
