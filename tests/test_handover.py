"""A restart that refuses no connection: ``serve --handover-socket`` (``router.handover``).

Each test runs ``prefix-router serve`` as real processes over loopback, in front
of simulated instances: a second process started with the first one's handover
socket takes its listeners and membership, the first drains and exits 0.  The
load runs through it all, half of the clients on a fresh connection per request
(``Connection: close``), half on keep-alive connections sending their next
request as soon as an answer ends (the clients a graceful stop must not fail:
an answer begun before the stop offered keep-alive).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from loadtests.simserver import Timing
from router.config import BackendSpec
from router.control import Unavailable
from router.control.live import RouterControl
from router.etcd import EtcdClient
from router.handover import Handover, HandoverError, Snapshot, take_over
from tests.harness.backends import Backend, Seen, StartBackend
from tests.harness.etcd import EtcdServer
from tests.harness.http import response, until
from tests.harness.processes import admin_call, serve_exit, serving, spawn_router, stop
from tests.harness.routers import SimFleet, StartRouter

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-llama-3.1-70b"
WAIT = 20.0


async def read(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, path: str) -> Any:
    """A GET of the admin API of ``proc``: its JSON, any shape."""
    status, body = await admin_call(http, proc, "GET", path)
    assert status == 200
    return body


def listens(path: str) -> bool:
    """Whether a socket file is at ``path``."""
    return Path(path).exists()


async def exited(proc: asyncio.subprocess.Process) -> tuple[int, list[dict[str, Any]]]:
    """Wait for ``proc`` to exit by itself: its code and the events it logged."""
    assert proc.stderr is not None
    async with asyncio.timeout(WAIT):
        rest = await proc.stderr.read()
        code = await proc.wait()
    return code, [json.loads(line) for line in rest.splitlines() if line.startswith(b"{")]


class Load:
    """Clients sending completions until told to stop: the even ones on a fresh
    connection each, the odd ones on keep-alive connections."""

    def __init__(self, port: int, clients: int = 6):
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.ok = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._progress = asyncio.Event()  # set at each success
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(clients)]

    async def _client(self, i: int) -> None:
        connector = aiohttp.TCPConnector(force_close=i % 2 == 0)
        async with aiohttp.ClientSession(connector=connector) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"client {i} turn {n % 5}"}],
                    "max_tokens": 4,
                    "stream": n % 2 == 0,
                }
                try:
                    async with http.post(self.url, json=body) as resp:
                        payload = await resp.read()
                        if resp.status != 200:
                            self.failures.append(f"{resp.status}: {payload[:200]!r}")
                        elif body["stream"] and not payload.rstrip().endswith(b"data: [DONE]"):
                            self.failures.append(f"a stream cut short: {payload[-80:]!r}")
                        else:
                            self.ok += 1
                            self._progress.set()
                except aiohttp.ClientError as exc:
                    self.failures.append(repr(exc))

    async def until(self, count: int) -> None:
        """Return once ``count`` more requests have succeeded."""
        target = self.ok + count
        async with asyncio.timeout(WAIT):
            while self.ok < target:
                self._progress.clear()
                await self._progress.wait()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_a_new_process_takes_over_under_load_without_a_failed_request(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(3)
    path = str(tmp_path / "handover.sock")
    first = [f"--backend={s.name}={s.url}" for s in sims[:2]]
    saved = ["--state-file", str(tmp_path / "state.json")]
    async with (
        serving(*first, *saved, "--handover-socket", path) as (old, port),
        aiohttp.ClientSession() as http,
    ):
        # Changes made through the admin API, kept in the state file: the new process
        # has them as a restart would, as of the old one's last change.
        added = {"name": sims[2].name, "url": sims[2].url, "weight": 2}
        status, _ = await admin_call(http, old, "POST", "/admin/backends", added)
        assert status == 201
        routing = {
            "RoutingConfig": {
                "RoutingStrategy": "PREFIX_AWARE",
                "PrefixAwareRoutingConfig": {"PrefixLength": 2048},
            }
        }
        status, _ = await admin_call(http, old, "PUT", "/admin/routing", routing)
        assert status == 200
        # A Responses API id the old process learnt: its follow-up must still land
        # where the response is after the handover.
        via = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        raw = await via.responses.with_raw_response.create(
            model=MODEL, input="what is a rocket?", max_output_tokens=4
        )
        first_id, made_on = raw.parse().id, raw.headers["x-sim-instance"]
        load = Load(port)
        await load.until(20)
        new, new_port = await spawn_router(
            f"--listen=127.0.0.1:{port}", *saved, "--handover-socket", path
        )
        try:
            assert new_port == port
            code, events = await exited(old)
            assert code == 0
            names = [e["event"] for e in events]
            assert "handed over: draining" in names
            await load.until(20)  # the new process serves on the same port
            await load.stop()
            assert load.failures == []
            # Membership and routing as the old process had them.
            weights = {b["name"]: b["weight"] for b in await read(http, new, "/admin/backends")}
            assert weights == {sims[0].name: 1, sims[1].name: 1, sims[2].name: 2}
            now = await read(http, new, "/admin/routing")
            assert now["RoutingConfig"]["PrefixAwareRoutingConfig"]["PrefixLength"] == 2048
            raw = await via.responses.with_raw_response.create(
                model=MODEL, input="and a comet?", previous_response_id=first_id,
                max_output_tokens=4,
            )  # fmt: skip
            assert raw.headers["x-sim-instance"] == made_on
            await via.close()
            assert listens(path)  # the new process listens there now
        finally:
            await stop(new)


async def test_a_failed_start_leaves_the_old_process_serving_and_a_later_one_takes_over(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(2)
    path = str(tmp_path / "handover.sock")
    async with serving(f"--backend={sims[0].name}={sims[0].url}", "--handover-socket", path) as (
        old,
        port,
    ):
        # A new process whose config moved the listener cannot take these sockets over:
        # it exits 2 saying so, after the old process gave them (the handover began).
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            elsewhere = probe.getsockname()[1]
        code, err = await serve_exit(
            f"--listen=127.0.0.1:{elsewhere}",
            "--admin-listen=127.0.0.1:0",
            "--handover-socket",
            path,
        )
        assert code == 2
        assert f"listens on 127.0.0.1:{port};" in err.decode()
        async with aiohttp.ClientSession() as http:
            # Thawed: the old process takes changes again, and still serves.
            added = {"name": sims[1].name, "url": sims[1].url}
            status, _ = await admin_call(http, old, "POST", "/admin/backends", added)
            assert status == 201
            load = Load(port, clients=2)
            await load.until(5)
            # (no state file: the config names what a restart, or a handover, serves)
            edited = [f"--backend={s.name}={s.url}" for s in sims]
            new, _ = await spawn_router(
                f"--listen=127.0.0.1:{port}", *edited, "--handover-socket", path
            )
            try:
                code, events = await exited(old)
                assert code == 0
                warned = [e for e in events if e["event"] == "handover failed: still serving"]
                assert len(warned) == 1  # the first asker's: it went away before Ready
                await load.until(5)
                await load.stop()
                assert load.failures == []
                listed = await read(http, new, "/admin/backends")
                assert sorted(b["name"] for b in listed) == [s.name for s in sims]
            finally:
                await stop(new)
    assert not listens(path)  # the last process took its socket file away


async def test_a_stale_socket_file_is_an_ordinary_start_and_another_file_is_refused(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(1)
    backend = f"--backend={sims[0].name}={sims[0].url}"
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(stale))  # bound, never listening, closed: what a killed process leaves
    async with serving(backend, "--handover-socket", str(stale)) as (proc, _):
        assert stat.S_IMODE(os.stat(stale).st_mode) == 0o600  # its owner only
        await stop(proc)
    # Refused before anything is served (serve exits 2 with the message: the failed
    # start's test shows that path).
    regular = tmp_path / "notes.txt"
    regular.write_text("not a socket\n")
    with pytest.raises(HandoverError, match="exists and is not a socket"):
        await take_over(str(regular))
    assert regular.read_text() == "not a socket\n"
    with pytest.raises(HandoverError, match="no directory"):
        await take_over(str(tmp_path / "gone" / "h.sock"))


async def test_changes_wait_while_frozen_and_are_refused_once_handed_over(
    backends: StartBackend, start_router: StartRouter
) -> None:
    origin = await backends()
    router = await start_router([origin.spec], health={"active": False})
    control = RouterControl(router)
    frozen = await control.freeze()
    assert [b.name for b in frozen.backends] == [origin.name]
    change = asyncio.create_task(control.add_backend(BackendSpec("late", "http://127.0.0.1:9")))
    await asyncio.sleep(0)  # it runs up to the lock
    assert not change.done()
    control.thaw("this router handed over to process 42: ask again")
    with pytest.raises(Unavailable, match="handed over to process 42"):
        await change
    assert sorted(router.fleet.backends) == [origin.name]
    # A failed handover thaws without retiring: changes go through again.
    control2 = RouterControl(router)
    await control2.freeze()
    control2.thaw()
    await control2.add_backend(BackendSpec("later", "http://127.0.0.1:9"))
    assert "later" in router.fleet.backends


async def test_a_second_asker_is_told_a_handover_is_under_way(tmp_path: Path) -> None:
    gate = asyncio.Event()
    thawed = asyncio.Event()

    async def freeze() -> Snapshot:
        return Snapshot(client=[], admin=[], state=None, responses=[[("resp_1", "a")]], parts=1)

    handover = Handover(freeze, thawed.set, lambda pid: gate.set())
    path = str(tmp_path / "h.sock")
    await handover.listen(path)
    try:
        first = await take_over(path)
        assert first is not None
        assert [tuple(learnt) for learnt in first.responses] == [("resp_1", "a")]
        with pytest.raises(HandoverError, match="already under way"):
            await take_over(path)
        first.abandon()  # the first asker gives up: the old side thaws
        async with asyncio.timeout(WAIT):
            await thawed.wait()
        assert not gate.is_set()
        assert not handover.retired
    finally:
        await handover.close()
    assert not listens(path)


async def test_workers_hand_over_to_more_workers_then_to_one_process(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(2)
    path = str(tmp_path / "handover.sock")
    backends = [f"--backend={s.name}={s.url}" for s in sims]
    async with serving(*backends, "--handover-socket", path, "--workers", "2") as (old, port):
        load = Load(port, clients=4)
        await load.until(10)
        # Two accept queues (one per worker) handed to three workers: a third is
        # added beside them; then all three to one process, which serves them all.
        for workers in ("3", "1"):
            new, new_port = await spawn_router(
                f"--listen=127.0.0.1:{port}", *backends, "--handover-socket", path,
                "--workers", workers,
            )  # fmt: skip
            try:
                assert new_port == port
                code, _ = await exited(old)
                assert code == 0
                await load.until(10)
            except BaseException:
                new.kill()
                raise
            old = new
        await load.stop()
        assert load.failures == []
        await stop(old)


async def test_under_etcd_the_new_process_joins_as_a_replica_and_the_old_one_leaves(
    sim_fleet: SimFleet, etcd: EtcdServer, tmp_path: Path
) -> None:
    sims = await sim_fleet(2)
    path = str(tmp_path / "handover.sock")
    flags = ["--etcd", etcd.url, "--etcd-prefix", "/handover/", "--handover-socket", path]
    backends = [f"--backend={s.name}={s.url}" for s in sims]
    async with serving(*backends, *flags) as (old, port), aiohttp.ClientSession() as http:
        old_id = (await read(http, old, "/admin/stats"))["replicas"]["id"]
        load = Load(port, clients=4)
        await load.until(10)
        new, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *flags)
        try:
            code, _ = await exited(old)
            assert code == 0
            await load.until(10)
            await load.stop()
            assert load.failures == []
            # The membership is etcd's (the handover gave none); the old replica's row
            # left with it.
            new_id = (await read(http, new, "/admin/stats"))["replicas"]["id"]
            assert new_id != old_id
            async with EtcdClient([etcd.url]) as client:
                rows, _ = await client.range("/handover/replicas/")
            assert [row.key for row in rows] == [f"/handover/replicas/{new_id}".encode()]
            listed = await read(http, new, "/admin/backends")
            assert sorted(b["name"] for b in listed) == [s.name for s in sims]
        finally:
            await stop(new)


async def test_an_answer_begun_before_the_stop_still_takes_the_next_request_on_its_connection(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    # ~0.1 s of stream: the stop comes while it runs.
    sims = await sim_fleet(1, timing=Timing(time_scale=0.1))
    router = await start_router(sims)
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        async with http.post(url, json={**body, "stream": True}) as first:
            assert first.status == 200
            assert first.headers.get("Connection", "keep-alive").lower() != "close"
            stopping = asyncio.create_task(router.shutdown(grace=WAIT))
            await until(lambda: router.stopping)
            assert (await first.read()).rstrip().endswith(b"data: [DONE]")
        # The head offered keep-alive, so the client sends its next request on this
        # connection at once: it is answered, saying close, not cut off.
        async with http.post(url, json=body) as second:
            assert second.status == 200
            assert second.headers["Connection"].lower() == "close"
            await second.read()
        await stopping
    assert router.admission.accepted == 1  # both on one connection


async def gone(pid: int) -> None:
    """Return once process ``pid`` (not our child) has exited: its pidfd turns readable."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    exited: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: None if exited.done() else exited.set_result(None))
    try:
        async with asyncio.timeout(WAIT):
            await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def test_sigusr2_starts_the_code_on_disk_which_takes_over_and_systemd_follows_it(
    sim_fleet: SimFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sims = await sim_fleet(2)
    path = str(tmp_path / "handover.sock")
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        # The service manager's end of sd_notify, as systemd binds it (NotifyAccess=all).
        systemd.bind(str(tmp_path / "notify"))
        systemd.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))

        async def told() -> dict[str, str]:
            async with asyncio.timeout(WAIT):
                datagram = await loop.sock_recv(systemd, 4096)
            return dict(line.split("=", 1) for line in datagram.decode().splitlines())

        backends = [f"--backend={s.name}={s.url}" for s in sims]
        old, port = await spawn_router(*backends, "--handover-socket", path)
        assert old.stderr is not None
        # The new process writes to the same stderr: read it all along, to the end.
        logged = asyncio.create_task(old.stderr.read())
        new_pid = None
        try:
            assert await told() == {"READY": "1", "MAINPID": str(old.pid)}
            load = Load(port, clients=4)
            await load.until(10)
            old.send_signal(signal.SIGUSR2)
            ready = await told()
            new_pid = int(ready["MAINPID"])
            assert ready["READY"] == "1"
            assert new_pid != old.pid
            # (its exit, not asyncio's wait: that one also waits for the stderr pipe,
            # which the new process holds)
            await gone(old.pid)  # retired: and no STOPPING=1 from it
            await load.until(10)  # served by the new process
            await load.stop()
            assert load.failures == []
            os.kill(new_pid, signal.SIGTERM)
            assert await told() == {"STOPPING": "1"}
            await gone(new_pid)
            new_pid = None
            async with asyncio.timeout(WAIT):
                assert await old.wait() == 0
        finally:
            if old.returncode is None:
                old.kill()
                await old.wait()
            if new_pid is not None:
                os.kill(new_pid, signal.SIGKILL)
        async with asyncio.timeout(WAIT):
            events = [json.loads(line)["event"] for line in (await logged).splitlines()]
        assert "upgrade: new process started" in events
        assert "took over" in events
        assert "handed over: draining" in events


async def test_sigusr2_without_a_handover_socket_is_logged_and_changes_nothing(
    sim_fleet: SimFleet,
) -> None:
    sims = await sim_fleet(1)
    async with serving(f"--backend={sims[0].name}={sims[0].url}") as (proc, port):
        assert proc.stderr is not None
        proc.send_signal(signal.SIGUSR2)
        async with asyncio.timeout(WAIT):
            while True:
                event = json.loads(await proc.stderr.readline())
                if event["event"].startswith("SIGUSR2 ignored"):
                    break
        load = Load(port, clients=2)
        await load.until(5)
        await load.stop()
        assert load.failures == []
        await stop(proc)


async def test_without_a_state_file_the_membership_is_the_configs_as_after_a_restart(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(3)
    path = str(tmp_path / "handover.sock")
    config = [f"--backend={sims[0].name}={sims[0].url}", "--handover-socket", path]
    async with serving(*config) as (old, port), aiohttp.ClientSession() as http:
        added = {"name": sims[1].name, "url": sims[1].url}  # through the admin API only
        status, _ = await admin_call(http, old, "POST", "/admin/backends", added)
        assert status == 201
        # The config now names another backend too: a restart would serve the config's
        # two, not the admin API's change (kept only in a state file); so does a handover.
        edited = [*config, f"--backend={sims[2].name}={sims[2].url}"]
        new, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *edited)
        try:
            code, _ = await exited(old)
            assert code == 0
            listed = await read(http, new, "/admin/backends")
            assert sorted(b["name"] for b in listed) == [sims[0].name, sims[2].name]
        finally:
            await stop(new)


async def test_an_id_the_old_process_learns_while_it_drains_is_followed_in_the_new_one(
    backends: StartBackend, tmp_path: Path
) -> None:
    async def answer(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        request = json.loads(seen.body)
        if "previous_response_id" not in request:
            await backend.release.wait()  # held until the handover is done
        made = {"id": f"resp_{len(backend.requests)}_{backend.name}", "object": "response"}
        writer.write(
            response(200, json.dumps(made).encode(), [(b"Content-Type", b"application/json")])
        )
        return True

    pair = [await backends(answer), await backends(answer)]
    path = str(tmp_path / "handover.sock")
    config = [*(f"--backend={b.name}={b.url}" for b in pair), "--handover-socket", path]
    url = "/v1/responses"
    async with serving(*config) as (old, port), aiohttp.ClientSession() as http:
        first = asyncio.create_task(
            http.post(f"http://127.0.0.1:{port}{url}", json={"model": "m", "input": "a rocket?"})
        )
        await until(lambda: any(b.requests for b in pair))  # at its backend, answer held
        (held,) = [b for b in pair if b.requests]
        new, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *config)
        try:
            # The old process has retired (the new one logs "admin listening" after
            # it answered); it drains the held request, then learns its id.
            held.release.set()
            async with await first as made:
                assert made.status == 200
                made_id = (await made.json())["id"]
            follow_up = {"model": "m", "input": "and a comet?", "previous_response_id": made_id}
            async with http.post(f"http://127.0.0.1:{port}{url}", json=follow_up) as resp:
                assert resp.status == 200
            assert len(held.requests) == 2  # where its state is
            code, _ = await exited(old)  # drained, and gone
            assert code == 0
            stats = await read(http, new, "/admin/stats")
            assert (stats["responses"]["hits"], stats["responses"]["misses"]) == (1, 0)
        finally:
            await stop(new)
