"""The simulated vLLM instance over HTTP: a thin aiohttp shell around ``model.Engine``.

Contract
--------
- ``SimConfig`` is all of an instance's knobs; ``SimInstance`` owns one engine
  and maps the monotonic clock onto model time: a model second lasts
  ``timing.time_scale`` real seconds. Every request is a ticket of the engine
  from its arrival to the end of its response; whatever way the response ends
  (completed, client gone, error, shutdown) the ticket is finished or aborted
  exactly once, so its batch slot and pinned blocks are freed.
- ``make_app(instance)`` builds the ``web.Application``; serve it with
  ``handler_cancellation=True`` (``SimServer`` does) so a client that goes away
  cancels its handler, even while it is queued. ``SimServer`` runs one instance
  on a TCP port (port 0 = ephemeral) inside a running loop; ``serve_fleet``
  runs several.
- Response headers on generations, sent when the first token is ready (so a
  router's time to first byte is the model's TTFT; vLLM would send headers
  earlier): ``x-sim-ttft-ms`` (model TTFT, independent of ``time_scale``),
  ``x-sim-queue-ms``, ``x-sim-prompt-tokens``, ``x-sim-cached-tokens``,
  ``x-sim-in-flight`` (the instance's requests, running or waiting, as this
  one arrived, itself included: a router's bound held or not). A
  ``cache_salt`` (chat, completions, responses: vLLM's field) separates cache
  entries as vLLM's does (``model.KVCache``). Every
  response, errors and ``/metrics`` included, carries ``x-sim-instance``.
- Test hooks, in real (unscaled) seconds, outside the model and not in
  ``x-sim-ttft-ms``: ``extra_ttft_s`` delays every first byte, ``extra_token_s``
  is added between streamed tokens. A request holds its slot while it waits.
- ``/v1/responses`` (``responses``): each instance keeps its own bounded store
  of finished responses, as vLLM keeps them in process memory; a follow-up
  (``previous_response_id``), ``GET``, ``DELETE`` or ``cancel`` of an id
  another instance produced is a 404, as on vLLM.
- ``/tokenize``, ``/detokenize`` and the ``/render`` endpoints (shapes in
  ``wire``) are answered at once and touch neither the engine nor its counters.
  A peer router's gRPC probe (an HTTP/2 preface) gets aiohttp's 400 and one log
  line on ``loadtests.simserver.http`` instead of a traceback.
- ``/v1/models`` lists ``model``; with ``strict_model`` a chat or completion
  request naming another model gets vLLM's 404 (``The model `X` does not
  exist.``), so a router that sends it to the wrong pool fails a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from . import responses, wire
from .metrics import EngineCollector
from .model import Engine, KVCache, Plan, Ticket, Timing, filler_pieces

__all__ = [
    "INSTANCE",
    "Generation",
    "SimConfig",
    "SimInstance",
    "SimServer",
    "make_app",
    "serve_fleet",
]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated instance.

    ``capacity_blocks`` 16,384 (262,144 tokens) is deliberately smaller than a
    real node's KV cache (8 x H100 at 0.9 memory utilisation holds about 1.2 M
    tokens of Llama-3.1-70B, at 320 KiB a token): it holds ~32 prefixes of
    8,000 tokens, so a benchmark with a few dozen shared prefixes already sees
    eviction when every instance receives every prefix (random routing).
    """

    name: str = "sim0"
    model: str = "sim-llama-3.1-70b"
    timing: Timing = field(default_factory=Timing)
    block_size: int = 16
    capacity_blocks: int = 16_384
    limits: wire.Limits = field(default_factory=wire.Limits)
    extra_ttft_s: float = 0.0
    extra_token_s: float = 0.0
    # vLLM answers 404 to a request that names another model than the one it
    # serves; off by default, as the workloads send any name.
    strict_model: bool = False
    responses_stored: int = 1024  # the Responses API store's bound (vLLM's has none)
    # False: vLLM without --enable-prefix-caching (model.KVCache's contract).
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.capacity_blocks < 0:
            raise ValueError("block_size must be >= 1 and capacity_blocks >= 0")
        if self.extra_ttft_s < 0 or self.extra_token_s < 0:
            raise ValueError("extra delays must be >= 0")


class SimInstance:
    """One engine, its clock, and the futures of requests queued for a slot."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.name = config.name
        self.engine = Engine(
            config.timing,
            KVCache(config.block_size, config.capacity_blocks, caching=config.prefix_caching),
        )
        self.responses = responses.ResponseStore(config.responses_stored)
        self.healthy = True  # tests may flip it: /health and /ping then answer 503
        self._scale = config.timing.time_scale
        self._epoch = time.monotonic()
        self._admissions: dict[int, asyncio.Future[Plan]] = {}
        self._watchers: list[tuple[Callable[[Engine], bool], asyncio.Future[None]]] = []

    @property
    def cache(self) -> KVCache:
        return self.engine.cache

    def model_now(self) -> float:
        return (time.monotonic() - self._epoch) / self._scale

    def real_time_of(self, model_t: float) -> float:
        return self._epoch + model_t * self._scale

    @contextlib.asynccontextmanager
    async def generate(
        self, tokens: Any, max_tokens: int, salt: bytes = b""
    ) -> AsyncIterator[Generation]:
        """Run one request through the engine; the ticket is retired on exit."""
        ticket = self.engine.submit(tokens, max_tokens, self.model_now(), salt)
        generation = Generation(self, ticket)
        self._changed()
        try:
            yield generation
        finally:
            now = self.model_now()
            if generation.completed:
                admitted = self.engine.finish(ticket, now)
            else:
                admitted = self.engine.abort(ticket, now)
            self._admissions.pop(ticket.id, None)
            for other in admitted:
                future = self._admissions.get(other.id)
                if future is not None and not future.done() and other.plan is not None:
                    future.set_result(other.plan)
            self._changed()

    async def wait_for(self, predicate: Callable[[Engine], bool]) -> None:
        """Return once ``predicate(engine)`` holds; re-checked on every state change.

        The synchronisation point for tests ("one request is waiting", "idle").
        """
        if predicate(self.engine):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.append((predicate, future))
        try:
            await future
        finally:
            self._watchers = [w for w in self._watchers if w[1] is not future]

    async def wait_idle(self) -> None:
        await self.wait_for(lambda e: e.running == 0 and e.waiting == 0)

    def reset(self) -> bool:
        return self.engine.reset()

    async def _wait_admission(self, ticket: Ticket) -> Plan:
        if ticket.plan is not None:
            return ticket.plan
        future: asyncio.Future[Plan] = asyncio.get_running_loop().create_future()
        self._admissions[ticket.id] = future
        return await future

    def _changed(self) -> None:
        for predicate, future in self._watchers:
            if not future.done() and predicate(self.engine):
                future.set_result(None)


class Generation:
    """The timed output of one admitted request: ``await start()``, then ``token(i)``."""

    def __init__(self, instance: SimInstance, ticket: Ticket) -> None:
        self.instance = instance
        self.ticket = ticket
        self.completed = False
        # The instance's requests as this one arrived, itself included (x-sim-in-flight).
        self.arrived_with = instance.engine.running + instance.engine.waiting
        self._pieces: list[str] = []
        self._first_real = 0.0
        self._step_real = 0.0

    async def start(self) -> Plan:
        """Wait for a slot, for the prefill, and for the first token; return the plan."""
        instance = self.instance
        plan = await instance._wait_admission(self.ticket)
        await _sleep_until(instance.real_time_of(plan.first_token_at))
        extra = instance.config.extra_ttft_s
        if extra > 0:
            await asyncio.sleep(extra)
        self._pieces = filler_pieces(plan.output_tokens)
        # Later tokens are paced from when the first one actually went out.
        self._first_real = time.monotonic()
        self._step_real = (
            plan.decode_s_per_token * instance.config.timing.time_scale
            + instance.config.extra_token_s
        )
        return plan

    async def token(self, index: int) -> str:
        """Wait until output token ``index`` is produced; return its text."""
        if index:
            await _sleep_until(self._first_real + index * self._step_real)
        if index == len(self._pieces) - 1:
            self.completed = True
        return self._pieces[index]


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


# ---------------------------------------------------------------- HTTP

INSTANCE = web.AppKey("instance", SimInstance)

_encode = msgspec.json.encode
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(instance: SimInstance | SimConfig) -> web.Application:
    if isinstance(instance, SimConfig):
        instance = SimInstance(instance)
    app = web.Application(middlewares=[_errors])
    app[INSTANCE] = instance
    app.on_response_prepare.append(_stamp_instance)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(instance.engine, instance.config.model, instance.model_now))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/invocations", _invocations)
    app.router.add_post("/v1/responses", _create_response)
    app.router.add_get("/v1/responses/{id}", _get_response)
    app.router.add_delete("/v1/responses/{id}", _delete_response)
    app.router.add_post("/v1/responses/{id}/cancel", _cancel_response)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_post("/v1/chat/completions/render", _render_chat)
    app.router.add_post("/v1/completions/render", _render_completion)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", _reset)
    return app


async def _stamp_instance(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-sim-instance"] = request.app[INSTANCE].name


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=_encode(body), content_type="application/json", headers=headers
    )


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except wire.BadRequest as exc:
        return _json(400, wire.error_body(exc.message, "invalid_request_error", exc.param))
    except _UnknownModel as exc:
        message = f"The model `{exc}` does not exist."
        return _json(404, wire.error_body(message, "NotFoundError", "model"))
    except responses.NotFound as exc:
        return _json(404, responses.not_found_body(exc.response_id))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        message = f"{exc.reason}: {request.method} {request.path}"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _json(exc.status, wire.error_body(message, kind), headers)


async def _body(request: web.Request) -> Any:
    return wire.decode_json(await request.read())


async def _generation_body(request: web.Request) -> Any:
    """The body of a generation request; 404 for another model (``strict_model``)."""
    body = await _body(request)
    config = request.app[INSTANCE].config
    model = body.get("model") if isinstance(body, dict) else None
    if config.strict_model and model is not None and model != config.model:
        raise _UnknownModel(model)
    return body


class _UnknownModel(Exception):
    """A request for another model than the one served (``strict_model``)."""


async def _chat(request: web.Request) -> web.StreamResponse:
    instance = request.app[INSTANCE]
    gen = wire.parse_chat(await _generation_body(request), instance.config.limits)
    return await _serve(request, instance, gen, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    instance = request.app[INSTANCE]
    gen = wire.parse_completion(await _generation_body(request), instance.config.limits)
    return await _serve(request, instance, gen, "text")


async def _invocations(request: web.Request) -> web.StreamResponse:
    instance = request.app[INSTANCE]
    gen = wire.parse_native(await _body(request), instance.config.limits)
    return await _serve(request, instance, gen, "native")


# The Responses API (``responses``): the store is this instance's alone, as vLLM's is.


async def _create_response(request: web.Request) -> web.StreamResponse:
    instance = request.app[INSTANCE]
    store = instance.responses
    parsed = responses.parse_responses(await _body(request), instance.config.limits, store)

    def reply(ticket: Ticket) -> wire.Reply:
        response_id = f"resp_{instance.name}-{ticket.id}"
        return responses.ResponsesReply(response_id, instance.config.model, parsed, store)

    return await _serve(request, instance, parsed.gen, reply)


async def _get_response(request: web.Request) -> web.Response:
    return _json(200, request.app[INSTANCE].responses.get(request.match_info["id"]).body)


async def _delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    request.app[INSTANCE].responses.delete(response_id)
    return _json(200, {"id": response_id, "object": "response.deleted", "deleted": True})


async def _cancel_response(request: web.Request) -> web.Response:
    request.app[INSTANCE].responses.get(request.match_info["id"])
    body = wire.error_body("Cannot cancel a synchronous response.", "invalid_request_error")
    body["error"]["param"] = "response_id"
    return _json(400, body)


# Tokenizer and render endpoints (see ``wire``): answered at once, outside the
# engine, as vLLM's API server answers them without a batch slot or KV block.


async def _tokenize(request: web.Request) -> web.Response:
    limits = request.app[INSTANCE].config.limits
    tokens, token_strs = wire.parse_tokenize(await _body(request))
    return _json(200, wire.tokenize_reply(tokens, limits, token_strs))


async def _detokenize(request: web.Request) -> web.Response:
    tokens = wire.parse_detokenize(await _body(request))
    return _json(200, {"prompt": wire.detokenize(tokens)})


async def _render_chat(request: web.Request) -> web.Response:
    instance = request.app[INSTANCE]
    body = await _body(request)
    gen = wire.parse_chat(body, instance.config.limits)
    request_id = f"chatcmpl-{instance.name}-render-{next(_render_ids)}"
    return _json(200, wire.render_reply(request_id, instance.config.model, gen, body))


async def _render_completion(request: web.Request) -> web.Response:
    instance = request.app[INSTANCE]
    body = await _body(request)
    gen = wire.parse_completion(body, instance.config.limits)
    request_id = f"cmpl-{instance.name}-render-{next(_render_ids)}"
    return _json(200, [wire.render_reply(request_id, instance.config.model, gen, body)])


_render_ids = itertools.count(1)


def _reply(kind: str, instance: SimInstance, ticket: Ticket, include_usage: bool) -> wire.Reply:
    if kind == "native":
        return wire.NativeReply()
    created = int(time.time())
    model = instance.config.model
    if kind == "chat":
        return wire.ChatReply(
            f"chatcmpl-{instance.name}-{ticket.id}", created, model, include_usage
        )
    return wire.TextReply(f"cmpl-{instance.name}-{ticket.id}", created, model, include_usage)


def _plan_headers(plan: Plan) -> dict[str, str]:
    return {
        "x-sim-ttft-ms": f"{plan.ttft * 1000:.3f}",
        "x-sim-queue-ms": f"{plan.queue_s * 1000:.3f}",
        "x-sim-prompt-tokens": str(plan.prompt_tokens),
        "x-sim-cached-tokens": str(plan.cached_tokens),
    }


async def _serve(
    request: web.Request,
    instance: SimInstance,
    gen: wire.GenRequest,
    kind: str | Callable[[Ticket], wire.Reply],
) -> web.StreamResponse:
    async with instance.generate(gen.tokens, gen.max_tokens, gen.cache_salt) as generation:
        plan = await generation.start()
        if isinstance(kind, str):
            reply = _reply(kind, instance, generation.ticket, gen.include_usage)
        else:
            reply = kind(generation.ticket)
        count = plan.output_tokens
        usage = wire.usage(plan.prompt_tokens, count, plan.cached_tokens)
        headers = _plan_headers(plan)
        headers["x-sim-in-flight"] = str(generation.arrived_with)
        if not gen.stream:
            pieces = [await generation.token(i) for i in range(count)]
            return _json(200, reply.whole("".join(pieces), usage), headers)

        response = web.StreamResponse(headers=headers)
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(request)
        try:
            for event in reply.opening():
                await response.write(reply.sse(event))
            pieces = []
            for i in range(count):
                pieces.append(await generation.token(i))
                ending = ("".join(pieces), usage) if i == count - 1 else None
                await response.write(reply.sse(reply.token(i, pieces[-1], ending)))
            for event in reply.closing(usage):
                await response.write(reply.sse(event))
            if reply.sse_done:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The client left between two events and the write noticed before aiohttp
            # cancelled us. Leaving the block aborts the ticket; aiohttp treats a
            # prepared response on a dead connection quietly, an exception as a 500.
            pass
        return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[INSTANCE].healthy else 503)


async def _models(request: web.Request) -> web.Response:
    config = request.app[INSTANCE].config
    model = {
        "id": config.model,
        "object": "model",
        "created": 0,
        "owned_by": "prefix-router-sim",
        "max_model_len": config.limits.max_model_len,
    }
    return _json(200, {"object": "list", "data": [model]})


async def _reset(request: web.Request) -> web.Response:
    """vLLM's ``POST /reset_prefix_cache``; here it also zeroes the counters."""
    instance = request.app[INSTANCE]
    if instance.reset():
        return _json(200, {"reset": True})
    message = f"{instance.cache.pinned_blocks} blocks are in use by running requests"
    return _json(409, wire.error_body(message, "conflict_error"))


# ---------------------------------------------------------------- serving


class _OneLineForHTTP2Preface(logging.Filter):
    """sglang-router probes each worker for gRPC (an HTTP/2 prior-knowledge preface) when
    it registers it; aiohttp answers 400 and logs a traceback each time. One line will do,
    as uvicorn, vLLM's server, logs a one-line warning for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage) and "PRI" in str(exc):
            record.msg = "400 for an HTTP/2 preface (a gRPC probe?) from %s"
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_SERVER_LOG = logging.getLogger("loadtests.simserver.http")
_SERVER_LOG.addFilter(_OneLineForHTTP2Preface())


# Passes of the loop from a connection's accept to its protocol's connection_made
# (asyncio's _accept_connection2 task, then the transport's call_soon), and one more.
_ACCEPT_PASSES = 3


class SimServer:
    """One instance served on ``host:port`` in the running loop; ``url`` once started."""

    def __init__(
        self,
        config: SimConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 1.0,  # a simulator has nothing worth draining for long
    ) -> None:
        self.instance = SimInstance(config)
        self.host = host
        self.port = port
        self.url = ""
        self._closing = False
        self._runner = web.AppRunner(
            make_app(self.instance),
            handler_cancellation=True,
            access_log=None,
            logger=_SERVER_LOG,
            shutdown_timeout=shutdown_timeout,
        )

    @property
    def name(self) -> str:
        return self.instance.name

    async def start(self) -> str:
        await self._runner.setup()
        self._close_late_connections()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}"
        return self.url

    def _close_late_connections(self) -> None:
        """A connection the listening socket accepted just before ``close`` is made
        a pass or two later (asyncio's accept is a task), after aiohttp's shutdown
        looked at its connections: it would stay open, unowned, until garbage
        collected (an "unclosed transport" warning in whatever test runs then).
        Such a connection is closed as it is made."""
        server = self._runner.server
        assert server is not None
        made = server.connection_made

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            if self._closing:
                transport.close()
            made(handler, transport)

        server.connection_made = connection_made  # type: ignore[method-assign]

    async def close(self) -> None:
        self._closing = True
        await self._runner.cleanup()
        # Accepts still in flight reach connection_made within two passes of the loop.
        for _ in range(_ACCEPT_PASSES):
            await asyncio.sleep(0)

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@contextlib.asynccontextmanager
async def serve_fleet(
    configs: Sequence[SimConfig], host: str = "127.0.0.1", ports: Sequence[int] | None = None
) -> AsyncIterator[list[SimServer]]:
    """Start one ``SimServer`` per config (ephemeral ports unless given); close all on exit."""
    ports = list(ports) if ports is not None else [0] * len(configs)
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for config, port in zip(configs, ports, strict=True):
            servers.append(await stack.enter_async_context(SimServer(config, host, port)))
        yield servers
