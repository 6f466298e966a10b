"""A small etcd v3 client over the JSON gateway (aiohttp; no client library).

Contract:
- Speaks etcd's gRPC gateway: ``POST /v3/kv/range``, ``/v3/kv/put``,
  ``/v3/kv/deleterange``, ``/v3/kv/txn``, ``/v3/watch`` (a stream of
  newline-delimited ``{"result": {...}}`` objects), ``/v3/lease/grant``,
  ``/v3/lease/keepalive``, ``/v3/lease/revoke``.  Keys and values are bytes,
  base64 on the wire; int64 fields arrive as JSON strings and are decoded to
  ints.  Checked against etcd 3.5.
- Several endpoints: calls go to the current one; when it cannot be reached
  (connect error, timeout, 5xx, gRPC "unavailable") the next one is tried, each
  at most once per call.  A *write* is passed to another endpoint only when it
  was never sent (no connection, or none within the deadline): after a lost
  answer, a timeout on a sent request or a 5xx, its outcome is unknown and
  ``OutcomeUnknown`` says so, since a put or a transaction sent twice could
  apply twice.
- Every call has a deadline: ``timeout`` seconds per endpoint tried, so at
  most ``timeout * len(endpoints)`` in all.  A watch's deadline covers
  connecting and etcd's "created" answer; after that a quiet stream is normal
  and has no read timeout: liveness is the caller's concern
  (``router.control.etcd`` probes etcd beside its watch).
- Errors form a small tree: ``EtcdError`` <- ``Unavailable`` (no endpoint
  answered) <- ``OutcomeUnknown``; ``EtcdError`` <- ``Rejected`` (etcd
  answered with an error: ``code``, ``message``) <- ``LeaseNotFound``;
  ``EtcdError`` <- ``Compacted`` (``revision``: the oldest revision still kept).
- ``watch(key, start_revision=R)`` is an async context manager: entering it
  returns once etcd has created the watch (or raises ``Unavailable``);
  iterating it yields ``Event``s in revision order, the events of one
  revision together.  The iteration raises ``Compacted`` when
  etcd cancels the watch for compaction and ``Unavailable`` when the stream is
  lost or ``close()``d; it never ends quietly.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import aiohttp
import msgspec

__all__ = [
    "Compacted",
    "Compare",
    "Delete",
    "EtcdClient",
    "EtcdError",
    "Event",
    "KeyValue",
    "LeaseNotFound",
    "OutcomeUnknown",
    "Put",
    "Rejected",
    "TxnResult",
    "Unavailable",
    "Watch",
    "prefix_end",
]

# gRPC status codes the gateway puts in its error bodies.
_NOT_FOUND = 5
_OUT_OF_RANGE = 11  # "mvcc: required revision has been compacted" (and future revisions)
_UNAVAILABLE = 14
_COMPACTED_MESSAGE = "required revision has been compacted"
# A watch response is one line; etcd caps a request at 1.5 MiB by default
# (--max-request-bytes), and a watch batch stays near that.  16 MiB bounds a
# stream that never sends a newline without ever cutting a real one.
_MAX_LINE = 16 << 20
_STREAM = aiohttp.ClientTimeout(total=None)


class EtcdError(Exception):
    """Base of every error this client raises."""


class Unavailable(EtcdError):
    """No endpoint answered within the deadline (the request was not applied)."""


class OutcomeUnknown(Unavailable):
    """A write was sent but its answer never came: it may or may not be applied."""


class Rejected(EtcdError):
    """etcd answered with an error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd: {message} (code {code})")
        self.code = code
        self.message = message


class LeaseNotFound(Rejected):
    """The lease expired or was revoked."""


class Compacted(EtcdError):
    """The revision asked for was compacted away; ``revision`` is the oldest kept
    (0 when etcd did not say)."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd: revision compacted (oldest kept: {revision})")
        self.revision = revision


# Wire structs: the gateway omits zero values, so everything has a default.
class _Header(msgspec.Struct):
    revision: int = 0


class KeyValue(msgspec.Struct, frozen=True):
    key: bytes = b""
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0


class _RangeResponse(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    kvs: list[KeyValue] = msgspec.field(default_factory=list)


class _WriteResponse(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    succeeded: bool = False


class _WireEvent(msgspec.Struct):
    type: Literal["PUT", "DELETE"] = "PUT"
    kv: KeyValue = msgspec.field(default_factory=KeyValue)


class _WatchResult(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[_WireEvent] = msgspec.field(default_factory=list)


class _StreamError(msgspec.Struct):
    """The error of a streamed answer (a watch line, a keepalive): the gateway's
    ``{"grpc_code", "http_code", "message", "http_status"}``; ``code`` in older ones."""

    grpc_code: int = 0
    code: int = 0
    message: str = ""

    def rejected(self) -> EtcdError:
        code = self.grpc_code or self.code
        return _rejected(code, self.message or f"error (code {code})")


class _WatchLine(msgspec.Struct):
    result: _WatchResult | None = None
    error: _StreamError | None = None


class _Lease(msgspec.Struct):
    ID: int = 0
    TTL: int = 0
    error: str = ""


class _KeepAlive(msgspec.Struct):
    result: _Lease | None = None
    error: _StreamError | None = None


class _Error(msgspec.Struct):
    code: int = 0
    message: str = ""
    error: str = ""


_T = TypeVar("_T")
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _decode(raw: bytes, kind: type[_T]) -> _T:
    decoder = _DECODERS.get(kind)
    if decoder is None:
        # strict=False: the gateway writes int64 as strings ("revision": "12").
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind, strict=False)
    try:
        return decoder.decode(raw)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Rejected(0, f"unreadable answer ({exc})") from None
    except RecursionError:  # msgspec's depth bound, even in a field it skips
        raise Rejected(0, "unreadable answer (nested too deep)") from None


class Event(msgspec.Struct, frozen=True):
    type: Literal["PUT", "DELETE"]
    key: bytes
    value: bytes  # b"" for DELETE
    mod_revision: int


class TxnResult(msgspec.Struct, frozen=True):
    succeeded: bool
    revision: int


class Compare(msgspec.Struct, frozen=True):
    """One condition of a transaction: ``target`` of ``key`` EQUAL (or other) ``value``."""

    key: bytes
    target: Literal["MOD", "CREATE", "VERSION"]
    value: int
    result: Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"] = "EQUAL"

    @classmethod
    def mod_revision(cls, key: bytes | str, revision: int) -> Compare:
        return cls(_bytes(key), "MOD", revision)

    @classmethod
    def create_revision(cls, key: bytes | str, revision: int) -> Compare:
        """``create_revision(key, 0)``: the key does not exist."""
        return cls(_bytes(key), "CREATE", revision)

    @classmethod
    def exists(cls, key: bytes | str) -> Compare:
        return cls(_bytes(key), "CREATE", 0, "GREATER")

    def wire(self) -> dict[str, Any]:
        field = {"MOD": "mod_revision", "CREATE": "create_revision", "VERSION": "version"}
        return {
            "key": _b64(self.key),
            "target": self.target,
            "result": self.result,
            field[self.target]: self.value,
        }


class Put(msgspec.Struct, frozen=True):
    key: bytes
    value: bytes
    lease: int = 0

    def wire(self) -> dict[str, Any]:
        body = {"key": _b64(self.key), "value": _b64(self.value)}
        return {"request_put": body | ({"lease": self.lease} if self.lease else {})}


class Delete(msgspec.Struct, frozen=True):
    key: bytes
    prefix: bool = False

    def wire(self) -> dict[str, Any]:
        return {"request_delete_range": _key_range(self.key, self.prefix)}


def _bytes(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that covers every key starting with ``prefix``."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"  # all 0xff (or empty): every key from prefix on


def _key_range(key: bytes, prefix: bool) -> dict[str, str]:
    body = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key))
    return body


def _error(raw: bytes, status: int) -> EtcdError:
    try:
        err = msgspec.json.decode(raw, type=_Error, strict=False)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        err = _Error(0, raw[:200].decode("utf-8", "replace") or f"HTTP {status}")
    return _rejected(err.code, err.message or err.error)


def _rejected(code: int, message: str) -> EtcdError:
    if code == _OUT_OF_RANGE and _COMPACTED_MESSAGE in message:
        return Compacted(0)
    if code == _NOT_FOUND and "lease not found" in message:
        return LeaseNotFound(code, message)
    if code == _UNAVAILABLE:
        return Unavailable(f"etcd: {message}")
    return Rejected(code, message)


class EtcdClient:
    """Calls to one etcd cluster through any of its endpoints (``http://host:port``)."""

    __slots__ = ("_current", "_own_session", "_session", "endpoints", "timeout")

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 2.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [url.rstrip("/") for url in endpoints]
        self.timeout = timeout
        self._current = 0
        self._session = session
        self._own_session = session is None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pooled keep-alive connection outlives an etcd restart unnoticed:
            # aiohttp retries nothing, so a stale one would fail one call.
            connector = aiohttp.TCPConnector(force_close=True)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, path: str, body: dict[str, Any], *, write: bool = False) -> bytes:
        """POST ``body`` to ``path`` on the current endpoint, failing over; the raw answer."""
        failures: list[str] = []
        for _ in range(len(self.endpoints)):
            url = self.endpoints[self._current] + path
            sent = False
            try:
                async with (
                    asyncio.timeout(self.timeout),
                    self._http().post(url, json=body) as resp,
                ):
                    sent = True
                    raw = await resp.read()
                    if resp.status == 200:
                        return raw
                    error = _error(raw, resp.status)
                    if resp.status < 500 and not isinstance(error, Unavailable):
                        raise error
                    if write:
                        raise OutcomeUnknown(f"etcd {url}: {error}; outcome unknown")
                    failures.append(f"{url}: {error}")
            except aiohttp.ClientConnectorError as exc:
                failures.append(f"{url}: {exc.os_error or exc}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = (
                    f"no answer within {self.timeout} s"
                    if isinstance(exc, TimeoutError)
                    else repr(exc)
                )
                if write and sent:
                    raise OutcomeUnknown(f"etcd {url}: {reason}; outcome unknown") from None
                failures.append(f"{url}: {reason}")
            self._current = (self._current + 1) % len(self.endpoints)
        raise Unavailable("etcd unavailable: " + "; ".join(failures))

    # -- KV ------------------------------------------------------------------

    async def range(
        self, key: bytes | str, *, prefix: bool = True, serializable: bool = False
    ) -> tuple[list[KeyValue], int]:
        """Every key under ``key`` (or the key alone); with the header revision."""
        body: dict[str, Any] = _key_range(_bytes(key), prefix)
        if serializable:
            body["serializable"] = True
        answer = _decode(await self._call("/v3/kv/range", body), _RangeResponse)
        return answer.kvs, answer.header.revision

    async def put(self, key: bytes | str, value: bytes | str, *, lease: int = 0) -> int:
        """Set ``key``; the revision that made the change."""
        body = Put(_bytes(key), _bytes(value), lease).wire()["request_put"]
        answer = _decode(await self._call("/v3/kv/put", body, write=True), _WriteResponse)
        return answer.header.revision

    async def delete(self, key: bytes | str, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); the header revision."""
        body = _key_range(_bytes(key), prefix)
        answer = _decode(await self._call("/v3/kv/deleterange", body, write=True), _WriteResponse)
        return answer.header.revision

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        """If every ``compare`` holds, apply ``success``, else ``failure``; atomically."""
        body = {
            "compare": [c.wire() for c in compare],
            "success": [op.wire() for op in success],
            "failure": [op.wire() for op in failure],
        }
        answer = _decode(await self._call("/v3/kv/txn", body, write=True), _WriteResponse)
        return TxnResult(answer.succeeded, answer.header.revision)

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (tests and operators; the router never does)."""
        await self._call("/v3/kv/compaction", {"revision": revision, "physical": True}, write=True)

    # -- leases --------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its ID."""
        answer = _decode(await self._call("/v3/lease/grant", {"TTL": ttl}, write=True), _Lease)
        if answer.error:
            raise Rejected(0, answer.error)
        return answer.ID

    async def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease`` once; its TTL now.  ``LeaseNotFound`` once it expired."""
        answer = _decode(await self._call("/v3/lease/keepalive", {"ID": lease}), _KeepAlive)
        if answer.error is not None:
            raise answer.error.rejected()
        if answer.result is None or answer.result.TTL <= 0:
            raise LeaseNotFound(_NOT_FOUND, f"lease {lease} not found (expired)")
        return answer.result.TTL

    async def lease_revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys go with it); ``LeaseNotFound`` if already gone."""
        await self._call("/v3/lease/revoke", {"ID": lease}, write=True)

    # -- watch ---------------------------------------------------------------

    def watch(self, key: bytes | str, *, start_revision: int, prefix: bool = True) -> Watch:
        """Events on ``key`` (or under it) from ``start_revision`` on; see ``Watch``."""
        return Watch(self, _bytes(key), start_revision, prefix)


class Watch:
    """``async with client.watch(...) as watch: async for event in watch: ...``."""

    __slots__ = ("_buffer", "_client", "_closed", "_pending", "_request", "_resp", "revision")

    def __init__(self, client: EtcdClient, key: bytes, start_revision: int, prefix: bool) -> None:
        self._client = client
        self._request = _key_range(key, prefix) | {"start_revision": start_revision}
        self._resp: aiohttp.ClientResponse | None = None
        self._buffer = bytearray()
        self._pending: list[Event] = []
        self._closed = False
        self.revision = 0  # the store's revision when etcd created the watch

    async def __aenter__(self) -> Self:
        client = self._client
        failures: list[str] = []
        for _ in range(len(client.endpoints)):
            url = client.endpoints[client._current] + "/v3/watch"
            try:
                async with asyncio.timeout(client.timeout):
                    return await self._open(url)
            except Unavailable as exc:
                failures.append(str(exc))
            except aiohttp.ClientError as exc:
                failures.append(f"{url}: {exc!r}")
            except TimeoutError:
                failures.append(f"{url}: no answer within {client.timeout} s")
            except BaseException:
                self._release()
                raise
            self._release()
            client._current = (client._current + 1) % len(client.endpoints)
        raise Unavailable("etcd watch unavailable: " + "; ".join(failures))

    async def _open(self, url: str) -> Self:
        # aiohttp's default 300 s total timeout would cut a long-lived stream.
        self._resp = resp = await self._client._http().post(
            url, json={"create_request": self._request}, timeout=_STREAM
        )
        if resp.status != 200:
            error = _error(await resp.read(), resp.status)
            if resp.status >= 500 and not isinstance(error, Unavailable):
                error = Unavailable(f"{url}: {error}")
            raise error
        result = await self._next_result()
        if not result.created:
            raise Unavailable(f"{url}: watch not created")
        self.revision = result.header.revision
        self._take(result)  # etcd sends events apart from "created", but be lenient
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()

    def _release(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None

    def close(self) -> None:
        """End the stream: a running iteration raises ``Unavailable`` at once."""
        self._closed = True
        self._release()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while True:
            while self._pending:
                yield self._pending.pop(0)
            self._take(await self._next_result())

    def _take(self, result: _WatchResult) -> None:
        if result.canceled:
            if result.compact_revision:
                raise Compacted(result.compact_revision)
            raise Unavailable(f"etcd canceled the watch: {result.cancel_reason or 'no reason'}")
        self._pending.extend(
            Event(e.type, e.kv.key, e.kv.value, e.kv.mod_revision) for e in result.events
        )

    async def _next_result(self) -> _WatchResult:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                if not line.strip():
                    continue
                parsed = _decode(line, _WatchLine)
                if parsed.error is not None:
                    raise parsed.error.rejected()
                if parsed.result is None:
                    raise Rejected(0, f"unreadable watch answer {line[:200]!r}")
                return parsed.result
            if self._closed or self._resp is None:
                raise Unavailable("etcd watch closed")
            if len(self._buffer) > _MAX_LINE:
                raise Rejected(0, f"watch answer longer than {_MAX_LINE} bytes")
            try:
                chunk = await self._resp.content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                raise Unavailable(f"etcd watch lost: {exc!r}") from None
            if not chunk:
                raise Unavailable("etcd watch lost: the stream ended")
            self._buffer += chunk
