"""Kubernetes discovery against a fake API server speaking the real list/watch protocol.

The real ``Router`` runs in the test's loop with ``RouterControl`` (the admin API's
control) and the ``Reconciler`` fed by ``K8sSource``, which talks TLS with a bearer
token to ``tests/harness/fakek8s.FakeKube`` on 127.0.0.1.  Backends are the
harness's recording servers; each has its own port, so each is one EndpointSlice of
the Service (the slices of one Service are merged).  The ``--workers 2`` process run
and the admin API's 409 are in ``test_discovery_serve.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web

from router.app import Router
from router.config import ConfigError
from router.control.live import RouterControl
from router.discovery import Backoff, DiscoveredControl, Reconciler
from router.discovery.k8s import K8sSource, KubeAuth, from_kubeconfig, in_cluster
from tests.harness.backends import Backend, StartBackend, echo, hold
from tests.harness.discovery import converged, post, states
from tests.harness.fakek8s import FakeKube, endpoint_entry, slice_object
from tests.harness.http import WAIT
from tests.harness.routers import StartRouter

PORTS = [{"name": "http", "protocol": "TCP", "port": 0}, {"name": "metrics", "port": 9090}]


def port_of(backend: Backend) -> int:
    return int(backend.url.rpartition(":")[2])


def name_of(backend: Backend) -> str:
    return f"127.0.0.1:{port_of(backend)}"


def slice_for(
    slice_name: str,
    backend: Backend,
    service: str = "vllm",
    labels: dict[str, str] | None = None,
    **conditions: Any,
) -> dict[str, Any]:
    ports = [dict(PORTS[0], port=port_of(backend)), PORTS[1]]
    entries = [endpoint_entry("127.0.0.1", **conditions)]
    return slice_object(slice_name, service, entries, ports, labels=labels)


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def kube(ca: trustme.CA) -> AsyncIterator[FakeKube]:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    fake = FakeKube(tls=server_ctx)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


def auth_for(fake: FakeKube, ca: trustme.CA) -> KubeAuth:
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    return KubeAuth(fake.server, client_ctx, token=fake.token, namespace="default")


Watch = Callable[..., Awaitable[tuple[Reconciler, K8sSource, RouterControl]]]


@pytest.fixture
async def watch(kube: FakeKube, ca: trustme.CA) -> AsyncIterator[Watch]:
    """``reconciler, source, control = await watch(router)``: discovery running, synced."""
    started: list[tuple[Reconciler, K8sSource, RouterControl]] = []

    async def start(
        router: Router, source_options: dict[str, Any] | None = None, **options: Any
    ) -> tuple[Reconciler, K8sSource, RouterControl]:
        control = RouterControl(router)
        source = K8sSource(
            auth_for(kube, ca),
            "default",
            service="vllm",
            port_name="http",
            backoff=Backoff(0.02, 0.2),
            **(source_options or {}),
        )
        reconciler = Reconciler(control, drain_timeout=WAIT, **options)
        started.append((reconciler, source, control))
        reconciler.start(source)
        assert await reconciler.wait_synced(WAIT)
        return reconciler, source, control

    try:
        yield start
    finally:
        for reconciler, source, control in started:
            await reconciler.close()
            await source.close()
            await control.close()


async def removed(control: RouterControl, router: Router, name: str) -> None:
    """Until the drain of ``name`` (started by discovery) has removed it."""
    if name in router.fleet.backends:
        async with asyncio.timeout(WAIT):
            view = await control.remove_backend(name, timeout=WAIT, wait=True)
        assert view.state == "removed"
    assert name not in router.fleet.backends


ROUTER = {"health": {"active": False}}


async def test_ready_endpoints_join_terminating_ones_drain_and_removed_ones_leave(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a, b = await backends(hold), await backends(echo)
    kube.put_slice(slice_for("vllm-a1b2c", a))
    kube.put_slice(slice_for("other-x9y8z", b, service="other"))  # another Service's
    router = await start_router([], **ROUTER)
    reconciler, source, control = await watch(router)

    assert states(router) == {name_of(a): "active"}
    listed, watched = kube.requests[0], kube.requests[1]
    assert listed == {"labelSelector": "kubernetes.io/service-name=vllm", "limit": "500"}
    assert watched["watch"] == "1"
    assert watched["allowWatchBookmarks"] == "true"
    assert watched["resourceVersion"] == str(kube.version)
    assert kube.open_watches == 1

    # A request held in flight on a, then a terminates and b becomes ready.
    held = asyncio.create_task(post(router, b"first"))
    await a.wait_for(lambda: len(a.requests) == 1)
    kube.put_slice(slice_for("vllm-d3e4f", b))
    kube.put_slice(slice_for("vllm-a1b2c", a, ready=False, serving=True, terminating=True))
    await converged(
        reconciler, lambda: states(router) == {name_of(a): "draining", name_of(b): "active"}
    )
    for key in (b"k1", b"k2", b"k3"):
        assert await post(router, key) == 200
    assert len(b.requests) == 3
    assert len(a.requests) == 1  # no new request on the draining one
    a.release.set()
    assert await held == 200  # the in-flight one finished on the draining backend

    # a's endpoint goes: drained (nothing in flight) then removed.
    kube.delete_slice("vllm-a1b2c")
    await converged(
        reconciler,
        lambda: (
            router.fleet.backends[name_of(a)].state.value == "draining"
            or name_of(a) not in router.fleet.backends
        ),
    )
    await removed(control, router, name_of(a))
    assert states(router) == {name_of(b): "active"}
    assert source.lists == 1  # everything came by the one watch


async def test_a_not_ready_endpoint_waits_and_joins_when_ready(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a, b = await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    kube.put_slice(slice_for("vllm-b", b, ready=False))  # starting: readiness probe not yet
    router = await start_router([], **ROUTER)
    reconciler, _, _ = await watch(router)
    assert states(router) == {name_of(a): "active"}
    kube.put_slice(slice_for("vllm-b", b, ready=True))
    await converged(reconciler, lambda: states(router).get(name_of(b)) == "active")


async def test_several_slices_merge_and_an_address_in_two_serves_if_either_says_so(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a, b = await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-1", a))
    kube.put_slice(slice_for("vllm-2", b))
    # During a slice rebalance an address can be listed twice; one copy not serving.
    kube.put_slice(slice_for("vllm-3", a, ready=False, terminating=True))
    router = await start_router([], **ROUTER)
    await watch(router)
    assert states(router) == {name_of(a): "active", name_of(b): "active"}


async def test_a_slice_label_names_its_backends_model_and_a_relabel_replaces_them(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a, b, c = await backends(echo), await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-a", a, labels={"model": "model-a"}))
    kube.put_slice(slice_for("vllm-b", b, labels={"model": "model-b"}))
    kube.put_slice(slice_for("vllm-c", c))  # no label: the source's models
    router = await start_router([], **ROUTER)
    source_options = {"model_label": "model", "models": ("model-z",)}
    reconciler, _, control = await watch(router, source_options)

    def pools() -> dict[str, tuple[str, ...]]:
        return {model: pool.members for model, pool in router.fleet.pools.items()}

    assert pools() == {
        "model-a": (name_of(a),),
        "model-b": (name_of(b),),
        "model-z": (name_of(c),),
    }
    assert {v.name: v.models for v in await control.backends()} == {
        name_of(a): ["model-a"],
        name_of(b): ["model-b"],
        name_of(c): ["model-z"],
    }
    # The Service of b now serves model-a: b is drained out and joins again with it.
    kube.put_slice(slice_for("vllm-b", b, labels={"model": "model-a"}))
    await converged(
        reconciler,
        lambda: (
            pools()
            == {"model-a": tuple(sorted((name_of(a), name_of(b)))), "model-z": (name_of(c),)}
        ),
    )


async def test_a_list_in_pages_follows_the_continue_token(
    kube: FakeKube, ca: trustme.CA, backends: StartBackend
) -> None:
    fleet = [await backends(echo) for _ in range(3)]
    for i, backend in enumerate(fleet):
        kube.put_slice(slice_for(f"vllm-{i}", backend))
    source = K8sSource(auth_for(kube, ca), "default", service="vllm", port_name="http", page_size=1)
    try:
        await source._list()
    finally:
        await source.close()
    assert source.snapshot().keys() == {name_of(b) for b in fleet}
    assert [r.get("continue") is not None for r in kube.requests] == [False, True, True]
    assert source.resource_version == str(kube.version)


@pytest.mark.parametrize("how", ["error event", "http 410"])
async def test_a_watch_that_ends_resumes_and_410_gone_relists_without_losing_a_backend(
    how: str, kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a, b, c = await backends(echo), await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    kube.put_slice(slice_for("vllm-b", b))
    router = await start_router([], **ROUTER)
    reconciler, source, _ = await watch(router)
    kept = router.fleet.backends[name_of(b)]

    # The server ends the watch (timeoutSeconds): resumed from its version, no list.
    kube.end_watches()
    await kube.wait_for(lambda: kube.watches == 2 and kube.open_watches == 1)
    assert source.lists == 1

    # A bookmark moves the version on without an event; the next watch starts there.
    kube.other_change()
    kube.other_change()
    kube.bookmark()
    marked = kube.version
    kube.end_watches()
    await kube.wait_for(lambda: kube.watches == 3 and kube.open_watches == 1)
    assert kube.requests[-1]["resourceVersion"] == str(marked)

    # Changes the stream never delivered, then compaction: resuming gets 410 Gone.
    kube.put_slice(slice_for("vllm-c", c), deliver=False)
    kube.delete_slice("vllm-a", deliver=False)
    kube.compact()
    kube.gone_as_http = how == "http 410"
    kube.end_watches()
    await kube.wait_for(lambda: source.lists == 2 and kube.open_watches == 1)
    await converged(reconciler, lambda: states(router).get(name_of(c)) == "active")
    assert router.fleet.backends[name_of(b)] is kept  # never removed and re-added
    assert set(router.fleet.backends) <= {name_of(a), name_of(b), name_of(c)}
    assert states(router).get(name_of(a)) in (None, "draining")  # gone: drained out


class CountingBackoff(Backoff):
    """The source's backoff, recording the attempt each delay was asked for."""

    def __init__(self) -> None:
        super().__init__(0.001, 0.004)  # short real sleeps: the test asserts the sequence
        self.asked: list[int] = []

    def next(self) -> float:
        self.asked.append(self.attempt)
        return super().next()


class RecordingSink:
    def __init__(self) -> None:
        self.published: list[dict[str, Any]] = []
        self.failures: list[str] = []

    def publish(self, endpoints: Any) -> None:
        self.published.append(dict(endpoints))

    def failed(self, reason: str) -> None:
        self.failures.append(reason)


@pytest.mark.parametrize("how", ["error event", "http 410"])
async def test_a_server_that_expires_every_watch_is_relisted_with_backoff_not_in_a_loop(
    how: str, kube: FakeKube, ca: trustme.CA, backends: StartBackend
) -> None:
    a, b = await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    kube.expire_watches = True  # even the version the list just gave is "too old"
    kube.gone_as_http = how == "http 410"
    backoff = CountingBackoff()
    source = K8sSource(auth_for(kube, ca), "default", service="vllm", port_name="http")
    source.backoff = backoff
    sink = RecordingSink()
    task = asyncio.create_task(source.run(sink))
    try:
        await kube.wait_for(lambda: kube.lists >= 6)
        # Every re-list came after a delay of the backoff, each one step longer:
        # never reset, since no watch delivered anything.
        relists = kube.lists - 1  # as the server saw them (the source may still be reading)
        assert relists >= 5
        assert backoff.asked == list(range(len(backoff.asked)))
        assert relists <= len(backoff.asked) <= relists + 1
        assert source.events == 0
        assert not sink.failures  # a 410 is not a failure: membership came by the lists
        assert sink.published[0].keys() == {name_of(a)}

        # The server mends: the next watch stays open, an event resets the backoff.
        kube.expire_watches = False
        await kube.wait_for(lambda: kube.open_watches == 1)
        watched, listed = kube.watches, kube.lists
        kube.put_slice(slice_for("vllm-b", b))
        kube.end_watches()  # after the event: the next watch opens once it is taken
        await kube.wait_for(lambda: kube.watches == watched + 1 and kube.open_watches == 1)
        assert kube.lists == listed  # resumed from the event's version, no list
        assert source.events >= 1
        assert backoff.attempt == 0
        assert sink.published[-1].keys() == {name_of(a), name_of(b)}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await source.close()


async def test_api_server_outage_keeps_the_fleet_routing_and_a_restart_catches_up(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a, b, c = await backends(echo), await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    kube.put_slice(slice_for("vllm-b", b))
    router = await start_router([], **ROUTER)
    reconciler, source, control = await watch(router, unhealthy_after=0.2)
    assert reconciler.healthy

    await kube.stop()
    async with asyncio.timeout(WAIT):
        await reconciler.wait_health(False)  # the bound passed without the API
    assert not DiscoveredControl(control, reconciler, source.description).ready()  # /readyz 503
    assert states(router) == {name_of(a): "active", name_of(b): "active"}
    for i in range(6):
        assert await post(router, b"during the outage %d" % i) == 200
    assert len(a.requests) + len(b.requests) == 6

    # What happened meanwhile: c is new, a went away.
    kube.put_slice(slice_for("vllm-c", c))
    kube.delete_slice("vllm-a")
    await kube.start()  # the same port
    async with asyncio.timeout(WAIT):
        await reconciler.wait_health(True)
    await converged(reconciler, lambda: states(router).get(name_of(c)) == "active")
    await removed(control, router, name_of(a))
    assert states(router) == {name_of(b): "active", name_of(c): "active"}


async def test_change_to_routing_latency_is_printed(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    """Figure for the README (run with -s): EndpointSlice write -> first request on
    the new endpoint, the old ones terminating in the same write.  Not asserted."""
    fleet = [await backends(echo) for _ in range(11)]
    kube.put_slice(slice_for("vllm-0", fleet[0]))
    router = await start_router([], **ROUTER)
    await watch(router)
    samples = []
    for i in range(1, len(fleet)):
        new, old = fleet[i], fleet[i - 1]
        began = time.perf_counter()
        kube.put_slice(slice_for(f"vllm-{i}", new))
        kube.put_slice(slice_for(f"vllm-{i - 1}", old, ready=False, terminating=True))
        async with asyncio.timeout(WAIT):
            while not new.requests:
                assert await post(router, b"probe") == 200
        samples.append((time.perf_counter() - began) * 1000)
        kube.delete_slice(f"vllm-{i - 1}")
    print(
        f"\nEndpointSlice change -> routed to the new endpoint: median"
        f" {statistics.median(samples):.1f} ms, max {max(samples):.1f} ms over {len(samples)}"
    )


# -- credentials -------------------------------------------------------------------


async def test_in_cluster_credentials_from_the_service_account_and_a_rotated_token(
    kube: FakeKube, ca: trustme.CA, tmp_path: Path, backends: StartBackend
) -> None:
    a = await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    (tmp_path / "token").write_text("first-token\n")
    (tmp_path / "namespace").write_text("default\n")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube.port)}
    auth = in_cluster(env, root=tmp_path)
    assert auth.namespace == "default"
    kube.token = "first-token"
    seen: list[dict[str, Any]] = []

    class Sink:
        def publish(self, endpoints: Any) -> None:
            seen.append(dict(endpoints))

        def failed(self, reason: str) -> None:
            seen.append({"failed": reason})

    # Two TCP ports in the slice: without a port name it would be skipped.
    source = K8sSource(
        auth, "default", service="vllm", port_name="http", backoff=Backoff(0.02, 0.2)
    )
    task = asyncio.create_task(source.run(Sink()))
    try:
        await kube.wait_for(lambda: kube.open_watches == 1)
        assert list(seen[0]) == [name_of(a)]
        # The kubelet rotates the projected token: the next request reads the new one.
        (tmp_path / "token").write_text("second-token\n")
        kube.token = "second-token"
        kube.end_watches()
        await kube.wait_for(lambda: kube.watches == 2 and kube.open_watches == 1)
        assert not [s for s in seen if "failed" in s]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await source.close()


async def test_a_wrong_token_is_reported_and_the_fleet_kept(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    a = await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    router = await start_router([], **ROUTER)
    reconciler, _, _ = await watch(router, unhealthy_after=0.1)
    kube.token = "rotated-elsewhere"
    kube.end_watches()
    async with asyncio.timeout(WAIT):
        await reconciler.wait_health(False)
    assert states(router) == {name_of(a): "active"}


def test_in_cluster_outside_a_cluster_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not in a cluster.*--kubeconfig"):
        in_cluster({}, root=tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError, match="no service account token"):
        in_cluster(env, root=tmp_path)


async def test_a_yaml_kubeconfig_with_embedded_ca_and_token_lists_from_the_server(
    kube: FakeKube, ca: trustme.CA, tmp_path: Path, backends: StartBackend
) -> None:
    pytest.importorskip("yaml", reason="a YAML kubeconfig needs PyYAML")
    import base64

    a = await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    ca_data = base64.b64encode(ca.cert_pem.bytes()).decode()
    (tmp_path / "config").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {kube.server}\n"
        f"    certificate-authority-data: {ca_data}\n"
        "contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: me\n"
        "    namespace: default\n"
        f"users:\n- name: me\n  user:\n    token: {kube.token}\n"
    )
    auth = from_kubeconfig(tmp_path / "config")
    assert auth.namespace == "default"
    source = K8sSource(auth, "default", service="vllm", port_name="http")
    try:
        await source._list()
    finally:
        await source.close()
    assert source.snapshot().keys() == {name_of(a)}


def test_a_kubeconfig_with_an_exec_plugin_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config").write_text(
        '{"current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k",'
        ' "user": "u"}}], "clusters": [{"name": "k", "cluster": {"server": "https://k:6443"}}],'
        ' "users": [{"name": "u", "user": {"exec": {"command": "aws"}}}]}'
    )
    with pytest.raises(ConfigError, match=r"'exec'.*does not support"):
        from_kubeconfig(tmp_path / "config")


class _Counted(bytearray):
    """The watch's line buffer, counting the bytes its newline searches cover."""

    searched = 0

    def find(self, sub: Any, start: Any = 0, *rest: Any) -> int:
        _Counted.searched += len(self) - (start or 0)
        return super().find(sub, start, *rest)


async def test_a_large_event_from_a_slow_server_is_searched_for_its_end_once(
    kube: FakeKube,
    watch: Watch,
    backends: StartBackend,
    start_router: StartRouter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A server that sends a 2 MiB event 1 KiB at a time (an overloaded API server, a
    # large slice): before, each read searched the whole buffer for the line's end
    # again, 2,048 reads x ~1 MiB; at the 16 MiB a line may have, 256 GB of search
    # (a slow server making the router's loop do seconds of work for one event).
    a, b = await backends(echo), await backends(echo)
    kube.put_slice(slice_for("vllm-a", a))
    router = await start_router([], **ROUTER)
    reconciler, _, _ = await watch(router)
    monkeypatch.setattr("router.discovery.k8s.bytearray", _Counted, raising=False)
    kube.end_watches()  # the next watch's buffer is counted
    await kube.wait_for(lambda: kube.watches == 2 and kube.open_watches == 1)
    _Counted.searched = 0
    event = slice_for("vllm-b", b)
    event["metadata"].update(resourceVersion=str(kube.version + 1), namespace="default")
    event["metadata"]["annotations"] = {"padding": "x" * (2 << 20)}  # read and ignored
    line = json.dumps({"type": "ADDED", "object": event}).encode() + b"\n"
    kube.send_raw(line, 1024)
    await converged(reconciler, lambda: states(router).get(name_of(b)) == "active")
    assert states(router).get(name_of(a)) == "active"
    assert _Counted.searched <= 2 * len(line), f"{_Counted.searched:,} bytes searched"


async def test_a_watch_cut_after_each_event_resumes_from_its_version_without_a_list(
    kube: FakeKube, watch: Watch, backends: StartBackend, start_router: StartRouter
) -> None:
    # A server, or a load balancer in front of it, that resets each watch stream after
    # an event. Before, each cut re-listed: a full LIST per event (the event reset the
    # backoff), ~7 a second against an API server already in trouble.
    fleet = [await backends(echo) for _ in range(6)]
    kube.put_slice(slice_for("vllm-0", fleet[0]))
    router = await start_router([], **ROUTER)
    reconciler, source, _ = await watch(router)
    for i in range(1, 6):
        opened, joined = kube.watches, name_of(fleet[i])
        kube.put_slice(slice_for(f"vllm-{i}", fleet[i]))
        await converged(reconciler, lambda: states(router).get(joined) == "active")  # noqa: B023
        if i == 5:  # a change the cut stream never delivers: the resumed watch replays it
            kube.delete_slice("vllm-0", deliver=False)
        kube.cut_watches()
        await kube.wait_for(lambda: kube.watches == opened + 1 and kube.open_watches == 1)  # noqa: B023
    await converged(reconciler, lambda: states(router).get(name_of(fleet[0])) in (None, "draining"))
    assert source.lists == kube.lists == 1  # every change came by the watches
    assert {name for name, state in states(router).items() if state == "active"} == {
        name_of(backend) for backend in fleet[1:]
    }


@contextlib.asynccontextmanager
async def first_failure(
    endpointslices: Callable[[web.Request], Awaitable[web.StreamResponse]],
    over: asyncio.Event,
) -> AsyncIterator[tuple[K8sSource, RecordingSink]]:
    """A source against an API server that answers with ``endpointslices``, once it
    has reported its first failure (within WAIT); ``over`` set when it is done."""
    app = web.Application()
    app.router.add_get(
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", endpointslices
    )
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server = f"http://127.0.0.1:{runner.addresses[0][1]}"
    source = K8sSource(KubeAuth(server, False, token="t"), "default", service="vllm")
    sink = RecordingSink()
    task = asyncio.create_task(source.run(sink))
    try:
        async with asyncio.timeout(WAIT):
            while True:  # each turn of the loop moves the source on
                if sink.failures:
                    break
                await asyncio.sleep(0.01)
        yield source, sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await source.close()
        over.set()
        await runner.cleanup()


async def test_an_error_answer_with_an_endless_body_is_reported_at_once() -> None:
    # The API server (or what answers at its address) refuses each watch with a 503
    # and a body with no end. Before, the whole body was read, until the watch's
    # client timeout (320 s): the router's memory grew by everything that came, and
    # the failure was reported only then.
    over = asyncio.Event()

    async def endpointslices(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "1":
            return web.json_response({"metadata": {"resourceVersion": "7"}, "items": []})
        response = web.StreamResponse(status=503)
        await response.prepare(request)
        piece = b"x" * 65536
        for _ in range(1024):  # 64 MiB, then no end while the test runs
            await response.write(piece)
        await over.wait()
        return response

    async with first_failure(endpointslices, over) as (source, sink):
        failure = sink.failures[0]
        assert failure.startswith(f"{source.description}: HTTP 503 from the API server")
        assert len(failure) < 400  # the body's first 200 bytes at most


async def test_a_list_answer_with_no_end_is_refused_at_64_mib() -> None:
    # The list answered 200 and a body with no end. Before, it was read whole until
    # the request's 10 s timeout, memory growing by all of it (loopback: gigabytes).
    over = asyncio.Event()
    sent = 0

    async def endpointslices(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"metadata": {"resourceVersion": "7"}, "items": [')
        piece = b" " * (1 << 20)
        while not over.is_set() and sent < 256 << 20:
            await response.write(piece)
            sent += len(piece)
        await over.wait()
        return response

    async with first_failure(endpointslices, over) as (source, sink):
        assert sink.failures[0] == f"{source.description}: a list page over 64 MiB"
        assert sent < 256 << 20  # the rest was never sent: the connection dropped
        assert not sink.published  # nothing was taken from it
