"""The admin aiohttp application and the server that runs it in the router's loop.

Contract:
- ``make_app(control, token=...)`` builds the app: the routes of ``routes.ROUTES``
  behind two middlewares.  The outer one turns every error into the JSON error
  shape with its status (``RequestError``, ``ControlError``, aiohttp's 404/405/413;
  ``NotSaved`` is a 500 whose message names the state file and the reason)
  and any other exception into a bare 500, logged with its traceback here and
  never sent to the client.  The inner one checks the bearer token, when there is
  one, on every path but the probes, unknown paths included (their 404 is raised
  by the handler it wraps), so an unauthenticated client cannot learn which paths
  exist.
- ``AdminServer`` runs the app with ``AppRunner`` + ``TCPSite`` on the running loop
  (no thread, no loop of its own).  It refuses to listen off loopback without a
  token.  Its access log is off: aiohttp's would be a second log of every request,
  and a format change could put the Authorization header in it.  aiohttp's HTTP
  parser errors (a malformed request, answered 400 before any middleware runs)
  quote the offending line, which can be the Authorization header: they are logged
  on ``prefix_router.admin.http`` with their type and status only, and answered
  with a fixed JSON error (``_QuietHandler``), never with the line.
"""

from __future__ import annotations

import json
import logging
import socket

import msgspec
from aiohttp import HttpVersion11, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse
from aiohttp.web_server import Server

from router.config import ConfigError
from router.control import (
    Conflict,
    Control,
    ControlError,
    Invalid,
    NotFound,
    NotSaved,
    Rejected,
    Unavailable,
)
from router.selfaddr import Listener
from router.sockets import listen

from . import auth, openapi
from .bodies import MAX_BODY
from .errors import STATUS_TYPES, ErrorBody, ErrorDetail, FieldError, RequestError
from .routes import CONTROL, OPENAPI, ROUTES, Handler, json_response

__all__ = ["AdminServer", "make_app"]

log = logging.getLogger("prefix_router.admin")

# Seconds requests still running at close() may take (a ``?wait=true`` drain can be
# long): the router is shutting down, and the drain goes on without the answer.
CLOSE_GRACE = 5.0
ADMIN_BACKLOG = 128  # aiohttp's own for a TCPSite


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = STATUS_TYPES.get(status, "bad_request" if status < 500 else "internal_error")
    return json_response(ErrorBody(ErrorDetail(message, kind)), status=status, headers=headers)


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """aiohttp's handling of ``Expect`` (``100 Continue`` for ``100-continue``),
    with any other expectation refused by our JSON 417, not its plain-text one;
    the client's value is not quoted back."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11 or not expect:
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's body has not begun
        return None
    return _error(417, "the only Expect the admin API takes is 100-continue")


def _from_control(exc: ControlError) -> web.Response:
    message = str(exc) or type(exc).__name__
    if isinstance(exc, NotFound):
        return _error(404, message)
    if isinstance(exc, Conflict):
        return _error(409, message)
    if isinstance(exc, Invalid):
        path = "$" if exc.field is None else f"$.{exc.field}"
        detail = ErrorDetail(message, "validation_error", [FieldError(path, message)])
        return json_response(ErrorBody(detail), status=422)
    if isinstance(exc, NotSaved):
        # The router's own storage failed (it logged that): a 500 that says what to fix.
        return _error(500, message)
    if isinstance(exc, Unavailable):
        return _error(503, message, {"Retry-After": "1"})
    if isinstance(exc, Rejected):  # the dry run of a request the data port refuses
        return _error(400, message)
    raise exc  # a ControlError outside the tree is a bug: the 500 path logs it


_HTTP_MESSAGES = {
    404: "no such path",
    413: f"request body is larger than {MAX_BODY} bytes",
}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        try:
            return await handler(request)
        except ControlError as exc:
            return _from_control(exc)
    except RequestError as exc:
        return json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:  # aiohttp's: unknown path, bad method, body too big
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers[hdrs.ALLOW]} if hdrs.ALLOW in exc.headers else None
        message = _HTTP_MESSAGES.get(exc.status, exc.reason)
        if exc.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        return _error(exc.status, message, headers)
    except Exception:
        # The traceback goes to the log, never to the client: it can hold internals.
        log.exception("admin request failed: %s %s", request.method, request.path)
        return _error(500, "internal error; see the router's log")


def _auth(token: str) -> Middleware:
    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in auth.OPEN_PATHS:
            auth.check(request.headers.get(hdrs.AUTHORIZATION), token)
        return await handler(request)

    return check_token


def make_app(control: Control, *, token: str | None) -> web.Application:
    """The admin API over ``control``; with ``token``, all but the probes need it."""
    if token is not None:
        auth.checked(token, "the admin token")
    middlewares = [_errors] if token is None else [_errors, _auth(token)]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
    app[CONTROL] = control
    app[OPENAPI] = msgspec.json.encode(openapi.document())
    for method, path, handler in ROUTES:
        if method == "GET":
            # No implicit HEAD: the API is exactly what /openapi.json says.
            app.router.add_get(path, handler, allow_head=False, expect_handler=_expect)
        else:
            app.router.add_route(method, path, handler, expect_handler=_expect)
    return app


class _WithoutRequestText(logging.Filter):
    """Drop the quoted request text (and traceback) of aiohttp's HTTP parser errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.msg}: {type(exc).__name__} {exc.code} (request text withheld)"
            record.exc_info = None
            record.exc_text = None
        return True


http_log = logging.getLogger("prefix_router.admin.http")
http_log.addFilter(_WithoutRequestText())


class _QuietHandler(RequestHandler):
    """aiohttp answers a malformed request head itself, quoting the offending line
    (an Authorization header included) back in its body: answer without it."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> StreamResponse:
        body = json.dumps({"error": {"message": "malformed HTTP request", "type": "bad_request"}})
        response = super().handle_error(request, status, exc, body)
        if status != 500:
            response.content_type = "application/json"
        return response


class _QuietServer(Server):
    def __call__(self) -> RequestHandler:
        return _QuietHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # The same server, answering bad heads through _QuietHandler.
        server.__class__ = _QuietServer
        return server


class AdminServer:
    """The admin API listening on one address, inside the running event loop."""

    def __init__(self, control: Control, *, token: str | None) -> None:
        self._token = token
        self._runner = _Runner(
            make_app(control, token=token),
            access_log=None,
            handle_signals=False,  # the router owns the signals
            shutdown_timeout=CLOSE_GRACE,
            logger=http_log,
        )
        self._port: int | None = None
        self.sockets: list[socket.socket] = []

    async def start(self, host: str, port: int, sockets: list[socket.socket] | None = None) -> None:
        """Listen on ``host:port`` (port 0: any free port, see ``.port``), or on
        ``sockets``, listening already (handed over: ``router.handover``)."""
        if self._token is None and auth.requires_token(host):
            raise ConfigError(
                f"the admin API on {host!r} is reachable from other hosts and needs a token: "
                f"give a token file or set {auth.ENV_VAR}, or bind it to 127.0.0.1"
            )
        await self._runner.setup()
        try:
            # Sockets of our own (not aiohttp's TCPSite) so that a handover can pass them on.
            self.sockets = sockets or listen(host, port, backlog=ADMIN_BACKLOG)
            for sock in self.sockets:
                await web.SockSite(self._runner, sock).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self._port = int(self._runner.addresses[0][1])

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the admin server is not started")
        return self._port

    @property
    def listeners(self) -> list[Listener]:
        """Its bound sockets (a host name can bind several)."""
        return [
            Listener("admin listener", str(name[0]), int(name[1]))
            for name in self._runner.addresses
        ]

    async def stop_accepting(self) -> None:
        """Accept no more connections (those open are answered until ``close``): a
        handover's new process holds the same listening sockets and answers alone."""
        for site in list(self._runner.sites):
            await site.stop()

    async def close(self) -> None:
        await self._runner.cleanup()
        self._port = None
