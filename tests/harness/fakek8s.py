"""A fake Kubernetes API server on 127.0.0.1 that serves EndpointSlices by list and watch.

``FakeKube`` speaks the real protocol of ``/apis/discovery.k8s.io/v1/namespaces/NS/
endpointslices`` (aiohttp, TLS from a trustme CA when given):

- list: ``{"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
  "metadata": {"resourceVersion", "continue"?}, "items": [...]}`` filtered by
  ``labelSelector`` (equality terms ``k=v,k2=v2``), paged by ``limit``/``continue``;
- watch (``?watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=T``):
  a chunked stream of JSON lines ``{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|
  "ERROR", "object": {...}}`` replaying every event after RV, then live ones;
- resourceVersion: one counter for every change, as etcd's revision; ``compact()``
  forgets the history, after which a watch from an older version gets an ERROR
  event with a 410 ``Expired`` Status inside a 200 stream (the watch cache's way) or,
  with ``gone_as_http``, an HTTP 410 with the Status as the body (etcd's);
  ``expire_watches``: every watch is answered so, whatever its version (a
  broken or overloaded server);
- a bearer token is required (401 Status otherwise).

Payloads have the shape of the API's (``slice_object``): metadata with labels,
ownerReferences, generateName; ``addressType``; ``endpoints[]`` with ``addresses``,
``conditions`` (ready/serving/terminating), ``targetRef``, ``nodeName``, ``zone``;
``ports[]`` with ``name``, ``protocol``, ``port``.  List items carry no kind and
apiVersion; watch objects do.

Control from the test: ``put_slice``/``delete_slice`` (each one event),
``bookmark()``, ``send_raw(data, piece)`` (bytes on the watch streams as they
are), ``end_watches()`` (the server ends every open watch, as at
``timeoutSeconds``), ``cut_watches()`` (every stream reset), ``compact()``,
``stop()``/``start()`` (an outage: streams cut, the port closed, then served
again on the same port).  ``requests`` records every
query; ``open_watches`` counts the streams open now, ``wait_for(predicate)``
waits (bounded) for a state of the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tests.harness.http import WAIT

__all__ = ["FakeKube", "endpoint_entry", "slice_object"]

GROUP = "discovery.k8s.io/v1"


def endpoint_entry(
    address: str,
    *,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    pod: str | None = None,
) -> dict[str, Any]:
    """One ``endpoints[]`` item as the EndpointSlice controller writes it."""
    if serving is None and ready is not None:
        serving = ready
    conditions: dict[str, Any] = {}
    if ready is not None:
        conditions["ready"] = ready
    if serving is not None:
        conditions["serving"] = serving
    if terminating is not None:
        conditions["terminating"] = terminating
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {
            "kind": "Pod",
            "namespace": "default",
            "name": pod or f"vllm-{address.replace('.', '-').replace(':', '-')}",
            "uid": str(uuid.uuid4()),
        },
        "nodeName": "node-a",
        "zone": "zone-a",
    }


def slice_object(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    *,
    namespace: str = "default",
    address_type: str = "IPv4",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice as ``kubectl get endpointslice -o json`` shows one (no version
    yet); ``labels``: more labels, as its Service's are copied to it."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": GROUP,
        "metadata": {
            "name": name,
            "generateName": f"{service}-",
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "generation": 1,
            "creationTimestamp": "2026-11-30T00:00:00Z",
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                **(labels or {}),
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": service,
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports,
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip().lstrip("="):
            return False
    return True


class _Watch:
    def __init__(self, namespace: str, selector: str) -> None:
        self.namespace = namespace
        self.selector = selector
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]] | str | bytes] = asyncio.Queue()


class FakeKube:
    def __init__(self, *, token: str = "fake-token", tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.tls = tls
        self.version = 1000
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}  # (ns, name) -> object
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, object)
        self.oldest = 0  # the oldest version a watch may resume from
        self.gone_as_http = False
        self.expire_watches = False  # every watch gets 410 Gone, even from the list's version
        self.requests: list[dict[str, str]] = []
        self.lists = 0
        self.watches = 0
        self._event = asyncio.Event()
        self._watches: set[_Watch] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def server(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(
            "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", self._handle
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """An outage: open watch streams are cut, the port stops answering."""
        for watch in list(self._watches):
            watch.queue.put_nowait("cut")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds; re-checked at every request and watch change."""
        async with asyncio.timeout(WAIT):
            while not predicate():
                self._event.clear()
                await self._event.wait()

    def _changed(self) -> None:
        self._event.set()

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    # -- changes ---------------------------------------------------------------

    def _record(self, kind: str, obj: dict[str, Any], deliver: bool) -> dict[str, Any]:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, kind, obj))
        if deliver:
            for watch in self._watches:
                watch.queue.put_nowait((kind, obj))
        return obj

    def put_slice(self, obj: dict[str, Any], *, deliver: bool = True) -> None:
        """Create or replace a slice; ``deliver=False``: open watches miss the event
        (as a stream that is about to break would), later watches replay it."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        kind = "MODIFIED" if key in self.slices else "ADDED"
        self.slices[key] = self._record(kind, obj, deliver)

    def delete_slice(self, name: str, namespace: str = "default", *, deliver: bool = True) -> None:
        obj = self.slices.pop((namespace, name))
        self._record("DELETED", obj, deliver)

    def other_change(self) -> None:
        """A change elsewhere in the cluster: the version moves, no slice event."""
        self.version += 1

    def bookmark(self) -> None:
        for watch in self._watches:
            watch.queue.put_nowait("bookmark")

    def send_raw(self, data: bytes, piece: int) -> None:
        """``data`` as it is on every open watch, ``piece`` bytes a write, the loop
        let run between writes (a slow server: the client reads it in small pieces)."""
        for watch in self._watches:
            for start in range(0, len(data), piece):
                watch.queue.put_nowait(data[start : start + piece])

    def cut_watches(self) -> None:
        """Every open watch stream cut (a reset), the server still serving."""
        for watch in list(self._watches):
            watch.queue.put_nowait("cut")

    def end_watches(self) -> None:
        for watch in list(self._watches):
            watch.queue.put_nowait("end")

    def compact(self) -> None:
        """Forget the history: a watch from a version before now gets 410 Gone."""
        self.history.clear()
        self.oldest = self.version

    # -- the API ---------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.query))
        self._changed()
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        namespace = request.match_info["namespace"]
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, namespace)
        return self._list(request, namespace)

    def _selected(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [
            obj
            for (ns, _), obj in sorted(self.slices.items())
            if ns == namespace and _matches(obj["metadata"].get("labels", {}), selector)
        ]

    def _list(self, request: web.Request, namespace: str) -> web.Response:
        self.lists += 1
        items = self._selected(namespace, request.query.get("labelSelector", ""))
        start, version = 0, self.version
        token = request.query.get("continue")
        if token:
            state = json.loads(base64.b64decode(token))
            start, version = state["start"], state["rv"]
            if version < self.oldest:
                message = (
                    "The provided continue parameter is too old to display a consistent"
                    " list result."
                )
                return web.json_response(_status(410, "Expired", message), status=410)
        limit = int(request.query.get("limit", "0")) or len(items) or 1
        page = items[start : start + limit]
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        if start + limit < len(items):
            metadata["continue"] = base64.b64encode(
                json.dumps({"start": start + limit, "rv": version}).encode()
            ).decode()
            metadata["remainingItemCount"] = len(items) - start - limit
        body = {
            "kind": "EndpointSliceList",
            "apiVersion": GROUP,
            "metadata": metadata,
            # List items carry no kind/apiVersion: the list says them once.
            "items": [
                {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")} for obj in page
            ],
        }
        return web.json_response(body)

    async def _watch(self, request: web.Request, namespace: str) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        since = int(request.query.get("resourceVersion") or 0)
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        timeout = int(request.query.get("timeoutSeconds") or 1800)
        gone = since < self.oldest or self.expire_watches
        too_old = f"too old resource version: {since} ({self.oldest})"
        if gone and self.gone_as_http:
            return web.json_response(_status(410, "Expired", too_old), status=410)
        self.watches += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if gone:
            await send("ERROR", _status(410, "Expired", too_old))
            await response.write_eof()
            return response
        watch = _Watch(namespace, selector)
        self._watches.add(watch)
        self._changed()
        try:
            for version, kind, obj in list(self.history):
                if version > since and self._wanted(watch, obj):
                    await send(kind, obj)
            async with asyncio.timeout(timeout):
                while True:
                    item = await watch.queue.get()
                    if isinstance(item, bytes):
                        await response.write(item)
                        await asyncio.sleep(0)
                        continue
                    if item == "end":
                        break
                    if item == "cut":
                        if request.transport is not None:
                            request.transport.abort()
                        return response
                    if item == "bookmark":
                        if bookmarks:
                            marker = {
                                "kind": "EndpointSlice",
                                "apiVersion": GROUP,
                                "metadata": {"resourceVersion": str(self.version)},
                            }
                            await send("BOOKMARK", marker)
                        continue
                    assert not isinstance(item, str)
                    kind, obj = item
                    if self._wanted(watch, obj):
                        await send(kind, obj)
        except TimeoutError:
            pass
        finally:
            self._watches.discard(watch)
            self._changed()
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    @staticmethod
    def _wanted(watch: _Watch, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return meta["namespace"] == watch.namespace and _matches(
            meta.get("labels", {}), watch.selector
        )
