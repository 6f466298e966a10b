"""Kubernetes discovery: list and watch ``discovery.k8s.io/v1`` EndpointSlices.

Contract:
- Talks to the API server over aiohttp, no client library: ``GET
  /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=S``
  (an ``EndpointSliceList``, paged with ``limit``/``continue``), then the same
  path with ``watch=1&resourceVersion=RV&allowWatchBookmarks=true
  &timeoutSeconds=T``: a stream of JSON lines ``{"type": "ADDED" | "MODIFIED"
  | "DELETED" | "BOOKMARK" | "ERROR", "object": {...}}``.  The selector is
  ``kubernetes.io/service-name=<service>`` for ``--k8s-service``, or the one
  given.  Every slice of the Service is merged into one snapshot.
- An endpoint is one address of ``endpoints[].addresses`` at the slice's port
  named ``port_name`` (any single port when none is named; a slice without
  that port is skipped, logged).  It is serving iff ``conditions.serving``
  (absent: ``ready``; both absent: true) and not ``conditions.terminating``.
  Names are ``<ip>:<port>`` (``router.discovery.endpoint``).  Its models:
  the value of the slice's ``model_label`` label when it has one (the
  EndpointSlice controller copies a Service's labels to its slices), else
  ``models``.
- Bounds: a list page is read up to 64 MiB, a watch event up to 16 MiB, an
  error answer up to 64 KiB; past the first two the source fails (retried
  with backoff, membership kept).
- resourceVersion: the list's starts the watch; every event and BOOKMARK
  moves it on, so a watch that ends (``timeoutSeconds``, a closed stream) is
  re-opened from where it stopped without a re-list.  ``410 Gone`` (an HTTP
  410, or an ERROR event whose Status has code 410) means that version is
  compacted: re-list.  Any other failure (connect error, 5xx, 401/403, a
  stream cut) is reported to the sink (membership kept) and retried with
  backoff (0.2 s doubling to 10 s, jittered).  A watch that failed resumes
  from its resourceVersion, as client-go's reflector does: the server replays
  every event after it, or answers 410 (re-list), so nothing is lost; only an
  event that could not be read (malformed, over 16 MiB: ``Unreadable``) or a
  list that failed means a re-list.  Before, every failure re-listed: a
  server (or a load balancer) that cut each watch after an event cost a
  full LIST per event, every ~0.15 s.
- Backoff and progress: the backoff is reset only by a watch event (ADDED,
  MODIFIED, DELETED, BOOKMARK), not by a list or a watch opened.  A watch
  that ends without one is re-opened after the backoff; a 410 before any
  event since the last list (the list's own version already expired: a
  broken or overloaded server) re-lists after the backoff, not at once.
- Credentials: ``in_cluster`` (``KUBERNETES_SERVICE_HOST``/``_PORT``, the
  service account's ``token``, ``ca.crt`` and ``namespace`` under ``root``)
  or ``from_kubeconfig`` (the current context, or the one named: cluster
  ``server``, ``certificate-authority[-data]``, ``insecure-skip-tls-verify``;
  user ``token``, ``tokenFile``, ``client-certificate[-data]`` +
  ``client-key[-data]``; exec plugins, auth providers and basic auth are
  refused with a ConfigError).  A token file is read again for every request
  (the kubelet rotates projected tokens).  A kubeconfig is YAML: JSON
  (``kubectl config view --raw -o json``) is read as is, YAML needs PyYAML.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from ..config import ConfigError
from ..log import get_logger
from . import Backoff, Endpoint, Sink, endpoint

__all__ = [
    "ApiError",
    "Expired",
    "K8sSource",
    "KubeAuth",
    "Unreadable",
    "from_kubeconfig",
    "in_cluster",
]

log = get_logger("discovery")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_MAX_LINE = 16 << 20  # one watch event; an EndpointSlice holds at most 1,000 endpoints
_MAX_ERROR = 64 << 10  # of an error answer's body (a Status), read at most
# One page of the list, at most: 500 slices of 100 endpoints (the EndpointSlice
# controller's default) are ~20 MB.  Before, a page was read whole whatever its
# size: an endless answer grew memory for the request's 10 s.
_MAX_PAGE = 64 << 20


class ApiError(Exception):
    """The API server could not be reached or refused the request."""


class Expired(ApiError):
    """410 Gone: the resourceVersion (or continue token) is compacted: re-list."""


class Unreadable(ApiError):
    """An event that could not be taken: what it said is not known: re-list."""


@dataclass(frozen=True)
class KubeAuth:
    server: str  # https://host:port
    ssl: ssl.SSLContext | bool  # False: no verification (insecure-skip-tls-verify)
    token: str | None = None
    token_file: str | None = None
    namespace: str | None = None  # the context's (kubeconfig) or the pod's (in-cluster)

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise ApiError(f"cannot read token {self.token_file}: {exc.strerror}") from None
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers


def in_cluster(env: Mapping[str, str] = os.environ, root: Path = SERVICE_ACCOUNT) -> KubeAuth:
    """The pod's service account (ConfigError when not in a cluster)."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError(
            "--discover k8s: not in a cluster (KUBERNETES_SERVICE_HOST/PORT unset);"
            " give --kubeconfig"
        )
    token, ca = root / "token", root / "ca.crt"
    if not token.is_file() or not ca.is_file():
        raise ConfigError(f"--discover k8s: no service account token and ca.crt in {root}")
    try:
        context = ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--discover k8s: cannot load {ca}: {exc}") from None
    namespace_file = root / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    host = f"[{host}]" if ":" in host else host
    return KubeAuth(f"https://{host}:{port}", context, token_file=str(token), namespace=namespace)


def _load_document(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read kubeconfig {path}: {exc.strerror}") from None
    try:
        document = msgspec.json.decode(text)
    except msgspec.DecodeError:
        try:
            import yaml  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            raise ConfigError(
                f"kubeconfig {path} is YAML: install PyYAML, or give the JSON of"
                " `kubectl config view --raw --flatten -o json`"
            ) from None
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"kubeconfig {path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"kubeconfig {path} is not a mapping")
    return document


def _named(document: dict[str, Any], kind: str, name: str, path: Path) -> dict[str, Any]:
    for entry in document.get(f"{kind}s") or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(kind)
            if isinstance(value, dict):
                return value
    raise ConfigError(f"kubeconfig {path}: no {kind} named {name!r}")


def _file_or_data(
    section: dict[str, Any], key: str, base: Path, stack: contextlib.ExitStack
) -> str | None:
    """A path for ``key`` or ``key-data`` (base64, written to a temporary file)."""
    data = section.get(f"{key}-data")
    if data:
        file = stack.enter_context(tempfile.NamedTemporaryFile(suffix=".pem"))  # noqa: SIM115
        file.write(base64.b64decode(data))
        file.flush()
        return file.name
    value = section.get(key)
    return str(base / value) if value else None


def from_kubeconfig(path: str | Path, context: str | None = None) -> KubeAuth:
    """The credentials of a kubeconfig's current context (see the contract)."""
    path = Path(path)
    document = _load_document(path)
    name = context or document.get("current-context")
    if not name:
        raise ConfigError(f"kubeconfig {path}: no current-context")
    ctx = _named(document, "context", name, path)
    cluster = _named(document, "cluster", ctx.get("cluster", ""), path)
    user = _named(document, "user", ctx.get("user", ""), path) if ctx.get("user") else {}
    for unsupported in ("exec", "auth-provider", "username", "password"):
        if user.get(unsupported):
            raise ConfigError(
                f"kubeconfig {path}: user {ctx.get('user')!r} uses {unsupported!r}, which"
                " prefix-router does not support (use a token, tokenFile or a client"
                " certificate)"
            )
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise ConfigError(f"kubeconfig {path}: cluster server {server!r} is not an http(s) URL")
    base = path.parent
    verify: ssl.SSLContext | bool
    with contextlib.ExitStack() as stack:
        try:
            if cluster.get("insecure-skip-tls-verify"):
                verify = False
            else:
                ca = _file_or_data(cluster, "certificate-authority", base, stack)
                verify = ssl.create_default_context(cafile=ca)
            cert = _file_or_data(user, "client-certificate", base, stack)
            key = _file_or_data(user, "client-key", base, stack)
            if cert is not None:
                if verify is False:
                    verify = ssl.create_default_context()
                    verify.check_hostname = False
                    verify.verify_mode = ssl.CERT_NONE
                assert isinstance(verify, ssl.SSLContext)
                verify.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"kubeconfig {path}: cannot load its certificates: {exc}") from None
    token_file = user.get("tokenFile")
    return KubeAuth(
        server.rstrip("/"),
        verify,
        token=user.get("token"),
        token_file=str(base / token_file) if token_file else None,
        namespace=ctx.get("namespace"),
    )


# -- the wire format (only the fields we read) ------------------------------------


class _Conditions(msgspec.Struct):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class _Endpoint(msgspec.Struct):
    addresses: list[str]
    conditions: _Conditions = msgspec.field(default_factory=_Conditions)


class _Port(msgspec.Struct):
    name: str | None = None
    port: int | None = None
    protocol: str | None = None


class _Meta(msgspec.Struct, rename="camel"):
    name: str = ""
    resource_version: str = ""
    labels: dict[str, str] | None = None


class _Slice(msgspec.Struct, rename="camel"):
    metadata: _Meta
    address_type: str = "IPv4"
    endpoints: list[_Endpoint] | None = None
    ports: list[_Port] | None = None


class _ListMeta(msgspec.Struct, rename="camel"):
    resource_version: str = ""
    continue_: str | None = msgspec.field(default=None, name="continue")


class _SliceList(msgspec.Struct):
    metadata: _ListMeta
    items: list[_Slice] | None = None


class _Status(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class _Event(msgspec.Struct):
    type: str
    object: msgspec.Raw


_list_decoder = msgspec.json.Decoder(_SliceList)
_event_decoder = msgspec.json.Decoder(_Event)
_slice_decoder = msgspec.json.Decoder(_Slice)
_status_decoder = msgspec.json.Decoder(_Status)


async def _read_page(resp: aiohttp.ClientResponse) -> bytes:
    """A list page's body, ApiError past ``_MAX_PAGE`` (counted as it arrives)."""
    if (resp.content_length or 0) > _MAX_PAGE:
        raise ApiError(f"a list page of {resp.content_length:,} bytes: over {_MAX_PAGE >> 20} MiB")
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > _MAX_PAGE:
            raise ApiError(f"a list page over {_MAX_PAGE >> 20} MiB")
    return bytes(body)


class K8sSource:
    def __init__(
        self,
        auth: KubeAuth,
        namespace: str,
        *,
        service: str | None = None,
        selector: str | None = None,
        port_name: str | None = None,
        models: tuple[str, ...] = (),
        model_label: str | None = None,
        watch_timeout: int = 290,
        request_timeout: float = 10.0,
        page_size: int = 500,
        backoff: Backoff | None = None,
    ) -> None:
        if (service is None) == (selector is None):
            raise ConfigError("--discover k8s needs one of --k8s-service and --k8s-selector")
        self.auth = auth
        self.namespace = namespace
        self.selector = f"{SERVICE_NAME_LABEL}={service}" if service is not None else selector
        self.port_name = port_name
        self.models = models
        self.model_label = model_label
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.page_size = page_size
        self.backoff = backoff or Backoff(0.2, 10.0)
        self.description = f"k8s {namespace}/{self.selector}"
        self.path = (
            f"/apis/discovery.k8s.io/v1/namespaces/{quote(namespace, safe='')}/endpointslices"
        )
        self.resource_version = ""
        self.slices: dict[str, dict[str, Endpoint]] = {}  # slice name -> its endpoints
        self.lists = 0  # full lists made (tests and logs)
        self.watches = 0  # watches opened
        self.events = 0  # watch events taken: ADDED, MODIFIED, DELETED, BOOKMARK
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.auth.ssl, limit=4)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def snapshot(self) -> dict[str, Endpoint]:
        """Every slice's endpoints together; an address in two slices serves if either says so."""
        merged: dict[str, Endpoint] = {}
        for endpoints in self.slices.values():
            for name, found in endpoints.items():
                if name not in merged or found.serving:
                    merged[name] = found
        return merged

    # -- the loop ------------------------------------------------------------

    async def run(self, sink: Sink) -> None:
        relist = True
        listed_at = 0  # self.events when the last list was made
        while True:
            try:
                if relist:
                    await self._list()
                    sink.publish(self.snapshot())
                    relist = False
                    listed_at = self.events
                opened_at = self.events
                await self._watch(sink)
                if self.events == opened_at:
                    # Ended without an event: do not spin on a server that does so.
                    await asyncio.sleep(self.backoff.next())
            except Expired as exc:
                log.info("k8s resourceVersion expired: re-listing", reason=str(exc))
                relist = True
                if self.events == listed_at:
                    # Even the list's own version expired before an event came: a server
                    # that answers every watch so would be listed ~1,000 times a second.
                    await asyncio.sleep(self.backoff.next())
            except (ApiError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
                sink.failed(f"{self.description}: {reason}")
                if isinstance(exc, (Unreadable, ValueError)):
                    relist = True  # an event was skipped: its change is not known
                # Else a failed list lists again (relist is still set) and a failed
                # watch resumes from its version: the server replays what came since.
                await asyncio.sleep(self.backoff.next())

    def _get(self, params: dict[str, str], timeout: aiohttp.ClientTimeout) -> Any:
        return self._http().get(
            self.auth.server + self.path,
            params=params,
            headers=self.auth.headers(),
            timeout=timeout,
            allow_redirects=False,
        )

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status == 200:
            return
        # A Status is small: read no more than _MAX_ERROR of it.  Before, all of it:
        # a watch answered 503 with an endless body was read for its 320 s timeout,
        # the router's memory growing by all of it.
        body = await resp.content.read(_MAX_ERROR)
        while len(body) < _MAX_ERROR and (more := await resp.content.read(_MAX_ERROR - len(body))):
            body += more
        try:
            status = _status_decoder.decode(body)
            message = f"{status.reason}: {status.message}" if status.reason else status.message
        except msgspec.DecodeError:
            message = body[:200].decode("utf-8", "replace")
        if resp.status == 410:
            raise Expired(message)
        hint = {
            401: " (the token is missing, expired or not this cluster's)",
            403: " (RBAC: the account needs get, list and watch on"
            " endpointslices.discovery.k8s.io in this namespace)",
        }.get(resp.status, "")
        raise ApiError(f"HTTP {resp.status} from the API server: {message}{hint}")

    async def _list(self) -> None:
        slices: dict[str, dict[str, Endpoint]] = {}
        token: str | None = None
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        while True:
            params = {"labelSelector": self.selector or "", "limit": str(self.page_size)}
            if token:
                params["continue"] = token
            async with self._get(params, timeout) as resp:
                await self._check(resp)
                page = _list_decoder.decode(await _read_page(resp))
            for item in page.items or ():
                slices[item.metadata.name] = self._endpoints(item)
            token = page.metadata.continue_
            if not token:
                break
        self.slices = slices
        self.resource_version = page.metadata.resource_version
        self.lists += 1
        log.info(
            "k8s endpointslices listed",
            source=self.description,
            slices=len(slices),
            resource_version=self.resource_version,
        )

    async def _watch(self, sink: Sink) -> None:
        """Follow one watch until it ends (``events`` counts what it delivered)."""
        params = {
            "labelSelector": self.selector or "",
            "watch": "1",
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout),
        }
        # The server ends the watch after timeoutSeconds; past that plus a margin,
        # a silent stream is a partition and is dropped.
        timeout = aiohttp.ClientTimeout(total=self.watch_timeout + 30, connect=self.request_timeout)
        async with self._get(params, timeout) as resp:
            await self._check(resp)
            self.watches += 1
            sink.publish(self.snapshot())  # the source answers again: healthy
            buffer = bytearray()
            # Only the bytes that came since the last search are searched: an event
            # that arrives in many small reads (a slow server, a large slice) would
            # otherwise be searched again from its start at each one, quadratic.
            scanned = 0
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while (end := buffer.find(b"\n", scanned)) >= 0:
                    line = bytes(buffer[:end])
                    del buffer[: end + 1]
                    scanned = 0
                    if line.strip():
                        self._event(line, sink)
                scanned = len(buffer)
                if scanned > _MAX_LINE:
                    raise Unreadable("a watch event over 16 MiB")

    def _event(self, line: bytes, sink: Sink) -> None:
        event = _event_decoder.decode(line)
        if event.type == "ERROR":
            status = _status_decoder.decode(event.object)
            if status.code == 410:
                raise Expired(status.message or status.reason)
            raise ApiError(f"watch error {status.code} {status.reason}: {status.message}")
        item = _slice_decoder.decode(event.object)
        if item.metadata.resource_version:
            self.resource_version = item.metadata.resource_version
        if event.type not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            log.warning("k8s watch event ignored", type=event.type)
            return
        # Progress: only now is the source known to work, so only now is the backoff reset.
        self.events += 1
        self.backoff.reset()
        if event.type == "BOOKMARK":
            return
        if event.type == "DELETED":
            self.slices.pop(item.metadata.name, None)
        else:
            self.slices[item.metadata.name] = self._endpoints(item)
        sink.publish(self.snapshot())

    def _endpoints(self, item: _Slice) -> dict[str, Endpoint]:
        port = self._port(item)
        if port is None:
            return {}
        models = self.models
        labels = item.metadata.labels or {}
        if self.model_label is not None and labels.get(self.model_label):
            models = (labels[self.model_label],)
        found: dict[str, Endpoint] = {}
        for entry in item.endpoints or ():
            conditions = entry.conditions
            serving = conditions.serving
            if serving is None:
                serving = conditions.ready is not False
            serving = serving and not conditions.terminating
            for address in entry.addresses:
                discovered = endpoint(address, port, serving, models)
                if discovered.name not in found or serving:
                    found[discovered.name] = discovered
        return found

    def _port(self, item: _Slice) -> int | None:
        ports = [p for p in item.ports or () if p.port is not None and p.protocol in (None, "TCP")]
        if self.port_name is not None:
            ports = [p for p in ports if p.name == self.port_name]
        if len(ports) == 1:
            return ports[0].port
        wanted = f"named {self.port_name!r}" if self.port_name is not None else "(one TCP port)"
        log.warning(
            "k8s endpointslice skipped: no single port " + wanted,
            slice=item.metadata.name,
            ports=[p.name for p in item.ports or ()],
        )
        return None
