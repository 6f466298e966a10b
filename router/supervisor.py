"""``prefix-router serve --workers N``: the supervisor of N data-plane processes.

Contract:
- ``Workers`` runs beside a ``Router`` started with ``start_control`` (the
  supervisor's: health checks, membership, config; no listener).  It is
  given the client listener's sockets, listening with SO_REUSEPORT
  (``router.sockets``: made by the daemon, or handed over by the process it
  replaces, ``router.handover``), deals them out, at least one per worker
  and address, and keeps its copies: a worker that exits leaves its
  sockets open, so a connection waiting in its queue is served by its
  successor (0.1 s after a crash, up to ``RESTART_MAX`` in a crash loop)
  instead of reset.  It creates the shared in-flight table (``router.shared``: one row per worker,
  one column per backend) and starts N ``python -m router.worker``
  processes, each with its channel (``router.channel``) and the table (and,
  for UDP rows, the eventfd each worker signals its row's changes on:
  ``changes_fd``, ``router.shared.ChangeSignal``; whoever reads it, the
  replica's sender, lets go of it before ``stop`` closes it).
- Changes: ``apply(op)`` is called in the same step (no await between) as
  the supervisor's own router takes the op (``router.control.ops.apply``, the
  same function every worker runs), so a worker starting at any moment gets
  each op exactly once, in its ``Init`` snapshot or as an ``Apply``.  It sends
  the op to every worker at once; what it returns resolves once each has it
  in its ring, so a 2xx from the admin API means every worker routes by it.
  A worker that dies meanwhile does not hold the change up: it restarts from
  the fleet as it is by then.  Health transitions decided here go to the
  workers the same way, without waiting.
- Reads: ``refresh()`` asks every worker for its accounting and adds it up
  into the supervisor's router (backend counters, the recorder, idle
  connections), whose views and metrics then read as one router's would.
  Per-tenant series (``router.tenants``) come as deltas since the last
  report and are absorbed into the supervisor's own bounded view; the
  workers get one digest key in their ``Init``, so a tenant has one label.
  An A/B experiment's arms (``router.arms``) are added up the same way, their
  TTFT samples merged (bottom-k).
  In-flight counts are read from the table (all rows, folded on read), and
  so is the claim spread the workers route by (``router.replicas``).
- Rows: one per worker, then with ``predecessor`` one for the requests of
  the process this one took over from (``router.handover``: ``predecessor()``
  writes what it reports as it drains; zero once it is gone), then with
  ``remote`` the other replicas' (written by ``router.replicas``, the last
  row).  The host's counts, what a replica sends the others and what a
  handover reports, are the rows before the remote one (``host_loads``).
- ``explain`` (the admin API's dry run, ``router.explain``) is answered by
  the first worker up, not here: a worker holds what the data path decides
  by (the TRAFFIC placement every worker shares, the response ids, the
  random generator), and it reads every worker's in-flight row (and the
  other replicas') at once before it answers, so the loads are the fleet's.
- A worker that exits unexpectedly: its row is zeroed (its requests are
  gone with it: their clients saw the connection reset), it is started
  again in its slot after a backoff that doubles while it keeps failing
  (``RESTART_INITIAL`` to ``RESTART_MAX``, reset after ``STABLE_SECONDS``
  up), and nothing else is disturbed.  Its counters start again from zero,
  as a restarted process's do.
- ``stop()`` closes its copies of the listening sockets, sends SIGTERM to
  every worker (each closes its own and drains, as a single router does,
  for up to ``shutdown_grace``), waits for them, and kills one that is
  still there a grace period later.
- TRAFFIC placement and Responses API ids (``Records``): what one worker
  decided or learnt is passed on to every other worker as it arrives, and to
  ``on_records`` (the other replicas); ``relay`` passes the other replicas'
  records to every worker.  The supervisor's router keeps every response id
  it passes on, so that a worker that (re)starts gets them right after its
  ``Init``, read as they were in the same step, in Records of
  ``IDS_PER_PART`` (``router.channel.send_ids``: one message of 10 million would pass the
  channel's frame bound, and the worker could never start).
  Each worker stamps its placements with ``stamp_base + index``.  A worker
  that restarts starts with an empty table and learns the fleet's homes
  from the records that follow (a key it places meanwhile is re-homed when
  it hears of the earlier placement).
- Slots: a backend gets the lowest free column when it is added and keeps
  it until it is removed; the column is free again at once.  Each worker
  takes the changes in order, so it forgets the removed backend (its cell
  zeroed, its leases counted on in its own dict) before it hears of the one
  that takes the column; until it has, the processes that heard read its
  old count under the new name, for as long as a change takes to reach a
  worker (the channel's round trip).  There are ``SLOTS``: a
  fleet larger than that refuses to start (``refuse_past_slots``, which
  ``prefix-router check-config`` calls too: ``ConfigError``, exit 2, naming
  the limit), and ``full`` tells the control plane to refuse (or, for
  etcd's membership, skip) an add before it persists anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import signal
import socket
import sys
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

import msgspec

from .channel import (
    IDS_PER_PART,
    Applied,
    Apply,
    Channel,
    ChannelClosed,
    Explain,
    Explained,
    Failed,
    HistogramData,
    Idle,
    Init,
    Query,
    Ready,
    Records,
    Recovered,
    Report,
    Signals,
    send_ids,
)
from .config import ConfigError
from .control import Rejected, Unavailable, WorkerView
from .control.ops import AddBackend, Op, RemoveBackend, SetHealthy
from .fleet import AdminState
from .log import get_logger
from .metrics import DURATION_BUCKETS, TTFT_BUCKETS, WINDOW, Histogram, Recorder
from .predecessor import Predecessor
from .shared import (
    PLANES,
    SPREAD_CELL,
    TABLE_PLANES,
    ChangeSignal,
    SharedLoadTracker,
    SharedTable,
)
from .sockets import deal
from .tenants import TenantMetrics

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hashring.shared import Record

    from .app import Router
    from .explain import DryRequest, Explanation
    from .handover import Load
    from .responses import Learnt
    from .signals import Signal

__all__ = ["Workers", "refuse_past_slots"]

log = get_logger("supervisor")

SLOTS = 8192  # backends a fleet may have at once under --workers
RESTART_INITIAL = 0.1
RESTART_MAX = 5.0
STABLE_SECONDS = 10.0


class _Worker:
    __slots__ = (
        "channel",
        "ids",
        "index",
        "pending",
        "process",
        "ready",
        "restarts",
        "sockets",
        "started",
        "task",
    )

    def __init__(self, index: int):
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.channel: Channel | None = None
        self.ready: asyncio.Future[bool] | None = None  # True once listening, False: exited
        self.pending: dict[int, asyncio.Future[Report | Explained | None]] = {}
        self.task: asyncio.Task[None] | None = None
        self.ids: asyncio.Task[None] | None = None  # the response ids, sent as it starts
        self.started = 0.0
        self.restarts = 0
        self.sockets: list[socket.socket] = []  # its listening sockets (router.sockets.deal)


def refuse_past_slots(size: int) -> None:
    """Raise ConfigError (exit 2) if a fleet of ``size`` backends has no column each:
    what ``Workers`` refuses to start with, and ``prefix-router check-config`` reports."""
    if size > SLOTS:
        # Not "load what fits": the state file is rewritten whole at the next change,
        # so the backends left out would be dropped from it for good, and which ones
        # fit would depend on the file's order.  Refuse, as a corrupt file is refused.
        raise ConfigError(
            f"{size} backends, but --workers holds at most {SLOTS} (one column each in"
            f" the shared in-flight table): remove {size - SLOTS} from the state file"
            " (or the config, without one)"
        )


class Workers:
    def __init__(
        self,
        router: Router,
        count: int,
        sockets: list[socket.socket],
        *,
        remote: bool = False,
        predecessor: bool = False,
        stamp_base: int = 0,
        signal_changes: bool = False,
    ):
        """``sockets``: the client listener's, listening (SO_REUSEPORT), dealt out
        among the workers (``router.sockets.deal``); ``remote``: one more row in the
        table, the other replicas' counts (written by ``router.replicas``);
        ``predecessor``: one more row, the requests of a process we took over from
        (``predecessor()``);
        ``stamp_base``: this replica's placement stamps (``stamp_base + worker
        index``, unique in the fleet);
        ``signal_changes``: the workers signal each change of their rows on
        ``changes_fd`` (``router.shared.ChangeSignal``, for UDP rows)."""
        self.router = router
        self.count = count
        self.stamp_base = stamp_base
        # Every worker labels a tenant alike (router.tenants): one digest key for all.
        tenants = router.config.tenants
        self._tenants = msgspec.structs.replace(
            tenants, label_key=tenants.label_key or os.urandom(16).hex()
        )
        router.tenants = TenantMetrics(tenants.metrics_top, labelled=True)
        self.port = int(sockets[0].getsockname()[1])
        refuse_past_slots(len(router.fleet.backends))
        self.table = SharedTable.create(count + predecessor + remote, SLOTS, TABLE_PLANES)
        self.predecessor_row = count if predecessor else None
        self.remote_row = count + predecessor if remote else None
        self._predecessor = Predecessor(self.table, count) if predecessor else None
        # ``host_loads``' last read of the rows and its answer.
        self._host_raw = b""
        self._host_loads: list[Load] = []
        self._closed = False  # the table: unmapped by ``stop``
        self.slots: dict[str, int] = {}
        self.limit = SLOTS  # backends the fleet may have: one column each
        self._free: list[int] = []  # a heap: freed columns below ``_top``
        self._top = 0  # this column and every one above it was never taken
        for name in router.fleet.backends:
            self._take_slot(name)
        # The supervisor owns no row: its trackers read every row, folded on read.
        self._trackers = [SharedLoadTracker(self.table, plane, None) for plane in range(PLANES)]
        router.fleet.loads, router.fleet.waiting = self._trackers
        for name, slot in self.slots.items():
            for tracker in self._trackers:
                tracker.assign(name, slot)
        self._workers = [_Worker(i) for i in range(count)]
        backlog = router.config.limits.listen_backlog
        for worker, dealt in zip(self._workers, deal(sockets, count, backlog=backlog), strict=True):
            worker.sockets = dealt
        self._seq = 0
        self._stopping = False
        self.tracing: dict[str, int] = {}  # the workers' tracing counters, added up
        if router.config.otel.endpoint is not None:
            from .tracing import TracerCollector  # imported only when tracing is on

            router.collector.registry.register(TracerCollector(lambda: self.tracing))
        self.on_idle: Callable[[str], None] | None = None  # a draining backend's count hit zero
        # the workers' placements and response ids, for the other replicas
        self.on_records: Callable[[list[Record], list[Learnt]], None] | None = None
        router.health.on_transition = self._health_changed
        # The prefix-cache check judges on every worker's repeated keys, added up
        # just before each scrape round (router.cachecheck).
        router.health.before_round = self.refresh
        # Engine signals (router.signals): every round's figures to every worker.
        if router.signals is not None:
            router.signals.on_change = self._signals_changed
        # Last: nothing above can fail with it open.
        self.changes_fd = ChangeSignal.open() if signal_changes else None

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker; return once all listen (raise if one cannot start)."""
        for worker in self._workers:
            await self._spawn(worker)
        for worker in self._workers:
            assert worker.ready is not None
            if not await worker.ready:
                raise RuntimeError(f"worker {worker.index} exited before it listened")

    @property
    def sockets(self) -> list[socket.socket]:
        """Every worker's listening sockets (what a handover passes on)."""
        return [sock for worker in self._workers for sock in worker.sockets]

    async def stop(self) -> None:
        self._stopping = True
        # Our copies first: a listener closes once its worker lets go of it too, so
        # that a connection is refused (as by one process), not kept waiting for
        # nobody; one handed over lives on in the process that took it.
        for worker in self._workers:
            for sock in worker.sockets:
                sock.close()
        for worker in self._workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        grace = self.router.config.timeouts.shutdown_grace + 5.0
        for worker in self._workers:
            process = worker.process
            if process is None:
                continue
            try:
                async with asyncio.timeout(grace):
                    await process.wait()
            except TimeoutError:
                log.error("worker did not stop: killed", worker=worker.index, pid=process.pid)
                process.kill()
                await process.wait()
        for worker in self._workers:
            if worker.ids is not None:
                worker.ids.cancel()
            if worker.task is not None:
                worker.task.cancel()
            if worker.channel is not None:
                worker.channel.close()
        for tracker in self._trackers:
            tracker.close()  # its views of the table first
        self._closed = True
        if self._predecessor is not None:
            self._predecessor.closed = True
        self.table.close()
        if self.changes_fd is not None:
            os.close(self.changes_fd)
            self.changes_fd = None

    @property
    def ready(self) -> bool:
        """At least one worker is listening."""
        return any(
            w.ready is not None and w.ready.done() and w.ready.result() for w in self._workers
        )

    def views(self) -> list[WorkerView]:
        return [
            WorkerView(
                index=w.index,
                pid=w.process.pid if w.process is not None else None,
                up=w.ready is not None and w.ready.done() and w.ready.result(),
                restarts=w.restarts,
            )
            for w in self._workers
        ]

    @property
    def pids(self) -> list[int | None]:
        return [w.process.pid if w.process else None for w in self._workers]

    def _init(self, index: int) -> Init:
        """The fleet as it is now, for a worker that starts now."""
        router = self.router
        fleet = router.fleet
        backends = [
            msgspec.structs.replace(b.spec, weight=b.weight) for b in fleet.backends.values()
        ]
        config = msgspec.structs.replace(
            router.config,
            backends=backends,
            routing=router.balancer.config,
            tenants=self._tenants,
        )
        return Init(
            index=index,
            stamp=self.stamp_base + index,
            config=config,
            draining=[n for n, b in fleet.backends.items() if b.state is AdminState.DRAINING],
            unhealthy=[n for n, b in fleet.backends.items() if not b.healthy],
            slots=dict(self.slots),
            table_rows=self.table.rows,
            table_slots=SLOTS,
            ramps=dict(fleet.ramps),
            signals=router.signals.figures if router.signals is not None else {},
        )

    async def _spawn(self, worker: _Worker) -> None:
        ours, theirs = socket.socketpair()
        listening = [sock.fileno() for sock in worker.sockets]
        fds = [theirs.fileno(), self.table.fd, *listening]
        args = ["--channel-fd", str(fds[0]), "--table-fd", str(fds[1])]
        args += ["--listen-fds", ",".join(map(str, listening))]
        if self.changes_fd is not None:
            fds.append(self.changes_fd)
            args += ["--changes-fd", str(self.changes_fd)]
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.worker", *args, pass_fds=fds
            )
        finally:
            theirs.close()
        worker.started = time.monotonic()
        worker.channel = await Channel.open(ours)
        worker.ready = asyncio.get_running_loop().create_future()
        # The snapshot and the worker's place in the broadcast are taken in one
        # step: every op from here on reaches it, every op before is in the snapshot.
        worker.channel.send(self._init(worker.index))
        # The response ids as they are in this same step, a part at a time.
        ids = self.router.responses.frozen(IDS_PER_PART, newest_first=True)
        worker.ids = asyncio.create_task(send_ids(worker.channel, ids))
        worker.ids.add_done_callback(lambda _: ids.close())  # (cancelled before it ran)
        worker.task = asyncio.create_task(self._run(worker))
        log.info("worker started", worker=worker.index, pid=worker.process.pid)

    async def _run(self, worker: _Worker) -> None:
        """Read the worker's messages until it exits, then restart it."""
        assert worker.channel is not None
        assert worker.process is not None
        try:
            while True:
                self._handle(worker, await worker.channel.receive())
        except ChannelClosed:
            pass
        code = await worker.process.wait()
        worker.channel.close()
        worker.channel = None
        for future in worker.pending.values():
            if not future.done():
                future.set_result(None)  # it restarts from the fleet as it is by then
        worker.pending.clear()
        if worker.ready is not None and not worker.ready.done():
            worker.ready.set_result(False)
        worker.ready = None
        self.table.zero_row(worker.index)
        if self.changes_fd is not None:  # its counts left the host's: the others hear of it
            ChangeSignal.notify(self.changes_fd)
        if self._stopping:
            return
        worker.restarts += 1
        up = time.monotonic() - worker.started
        failing = 0 if up > STABLE_SECONDS else worker.restarts
        delay = min(RESTART_MAX, RESTART_INITIAL * 2 ** min(8, failing)) if failing else 0.0
        log.error("worker exited: restarting", worker=worker.index, code=code, delay_s=delay)
        await asyncio.sleep(delay)  # crash-loop backoff, not synchronisation
        if not self._stopping:
            await self._spawn(worker)

    def _handle(self, worker: _Worker, message: object) -> None:
        router = self.router
        if isinstance(message, Ready):
            if worker.ready is not None and not worker.ready.done():
                worker.ready.set_result(True)
        elif isinstance(message, (Applied, Report, Explained)):
            future = worker.pending.pop(message.seq, None)
            if future is not None and not future.done():
                future.set_result(None if isinstance(message, Applied) else message)
        elif isinstance(message, Failed):
            backend = router.fleet.backends.get(message.name)
            if backend is not None:  # the worker counted the error: only health here
                router.health.failed(backend, message.reason)
        elif isinstance(message, Recovered):
            backend = router.fleet.backends.get(message.name)
            if backend is not None:
                router.health.answered(backend)
        elif isinstance(message, Records):
            self._send_all(message, but=worker)
            router.responses.apply(message.responses)
            if self.on_records is not None:
                self.on_records(message.records, message.responses)
        elif (
            isinstance(message, Idle)
            and self.on_idle is not None
            and not self.in_flight(message.name)
        ):
            self.on_idle(message.name)

    def learnt(self, responses: list[Learnt]) -> None:
        """Response ids learnt elsewhere (the process this one took over from, as it
        drains), for every worker."""
        self.relay([], responses)

    def relay(self, records: list[Record], responses: list[Learnt]) -> None:
        """Pass another replica's placement records and response ids to every worker."""
        self.router.responses.apply(responses)
        self._send_all(Records(records, responses))

    # -- changes --------------------------------------------------------------------

    @property
    def full(self) -> bool:
        """Every column is taken: one more backend cannot be added (see the contract)."""
        return len(self.slots) >= self.limit

    def _take_slot(self, name: str) -> int:
        # The lowest free column: a fold reads up to the highest one in use.  A freed
        # column is free at once (the contract says why that is safe enough).
        # A heap, not a scan: at start-up a scan per backend was O(n^2), 3.7 s at SLOTS.
        if self._free:
            slot = heapq.heappop(self._free)
        elif self._top < SLOTS:
            slot = self._top
            self._top += 1
        else:  # callers check ``full`` first
            raise ValueError(f"at most {SLOTS} backends with --workers")
        self.slots[name] = slot
        return slot

    def prepare(self, op: Op) -> Op:
        """The op as the workers get it: an added backend with its column."""
        if isinstance(op, AddBackend):
            slot = self._take_slot(op.spec.name)
            for tracker in self._trackers:
                tracker.assign(op.spec.name, slot)
            self._host_raw = b""  # (host_loads: the names moved)
            if self._predecessor is not None:  # (back: the predecessor's requests on it)
                self._predecessor.write(op.spec.name, slot)
            return AddBackend(op.spec, slot, op.ramp)
        if isinstance(op, RemoveBackend):
            slot = self.slots.pop(op.name)
            heapq.heappush(self._free, slot)
            for tracker in self._trackers:
                tracker.forget(op.name)
            self._host_raw = b""
            for row in (self.predecessor_row, self.remote_row):  # rows we write, not workers
                if row is not None:
                    for plane in range(PLANES):
                        self.table.cells[self.table.index(row, plane, slot)] = 0
        return op

    def _ask(
        self, message: Callable[[int], Apply | Query]
    ) -> list[asyncio.Future[Report | Explained | None]]:
        """Send ``message(seq)`` to every worker up; a future per worker for its answer."""
        self._seq += 1
        seq = self._seq
        futures = []
        loop = asyncio.get_running_loop()
        for worker in self._workers:
            if worker.channel is None:
                continue  # restarting: its Init will have the fleet as it is by then
            future: asyncio.Future[Report | Explained | None] = loop.create_future()
            worker.pending[seq] = future
            try:
                worker.channel.send(message(seq))
            except ChannelClosed:
                worker.pending.pop(seq)
                continue
            futures.append(future)
        return futures

    def _send_all(self, message: Records | Signals, *, but: _Worker | None = None) -> None:
        """Send ``message`` to every worker up (but one), expecting no answer."""
        for worker in self._workers:
            if worker is not but and worker.channel is not None:
                with contextlib.suppress(ChannelClosed):  # exiting: it restarts without
                    worker.channel.send(message)

    def apply(self, op: Op) -> Awaitable[object]:
        """Send ``op`` (already ``prepare``d and applied here) to every worker now; await
        the result for all to have it.  Call it in the same step as the local apply: a
        worker that starts in between would get the op twice (in its ``Init`` and here)
        and refuse it, or, the other way round, never."""
        return asyncio.gather(*self._ask(lambda seq: Apply(seq, op)))

    def _signals_changed(self, figures: dict[str, Signal]) -> None:
        self._send_all(Signals(figures))  # a restarting worker gets them in its Init

    def _health_changed(self, name: str, healthy: bool) -> None:
        # A recovery ramp (slow start) runs from the moment the supervisor saw it up.
        ramp = self.router.fleet.ramps.get(name) if healthy else None
        healthy_op = SetHealthy(name, healthy, ramp.start if ramp is not None else None)
        self._ask(lambda seq: Apply(seq, healthy_op))  # nobody waits: futures resolve on ack

    # -- reads ----------------------------------------------------------------------

    def claim_spread(self) -> int:
        """The claim spread the workers route by: the remote row's (``router.replicas``),
        1 without other replicas."""
        if self.remote_row is None:
            return 1
        return self.table.cells[self.table.row_cell(self.remote_row, SPREAD_CELL)] or 1

    def in_flight(self, name: str) -> int:
        """Requests in flight to ``name`` on this host, read now: its workers' and its
        predecessor's (``host_loads``' rows)."""
        slot = self.slots.get(name)
        if slot is None:
            return 0
        table = self.table
        rows = table.rows if self.remote_row is None else self.remote_row
        return sum(table.cells[table.index(row, 0, slot)] for row in range(rows))

    def host_loads(self) -> list[Load]:
        """This host's requests in flight per backend, read now: its workers' rows and
        its predecessor's, not the other replicas' (what a handover reports).  The same
        list while no cell of those rows changed (one copy and compare of them)."""
        if self._closed:
            # Our workers have exited; the process we took over from may still drain.
            return self._predecessor.loads() if self._predecessor is not None else []
        table = self.table
        rows = table.rows if self.remote_row is None else self.remote_row
        raw = table.counts_bytes(rows, PLANES, self._top)
        if raw == self._host_raw:
            return self._host_loads
        loads, waiting = (table.plane_sums(plane, rows, self._top) for plane in range(PLANES))
        self._host_raw = raw
        self._host_loads = sorted(
            (name, loads[slot], waiting[slot]) for name, slot in self.slots.items() if loads[slot]
        )
        return self._host_loads

    def predecessor(self, changes: dict[str, tuple[int, int]]) -> None:
        """The process we took over from: its backends whose in-flight counts changed,
        as it reported them (``router.handover``), written into its row, which every
        worker folds in as another worker's (within a fold period) and reads again at
        its decisions.  Kept for every backend it names: one added here later (back)
        gets its count at once."""
        if self._predecessor is None:
            return
        ended = self._predecessor.report(changes, self.slots)
        if self._closed:
            return  # (what we report for it, our workers gone: ``host_loads``)
        if self.changes_fd is not None:
            ChangeSignal.notify(self.changes_fd)  # the other replicas count them too
        for name in ended:  # a drain waiting on the host's last request
            if self.on_idle is not None and not self.in_flight(name):
                self.on_idle(name)

    async def explain(self, request: DryRequest, k: int) -> Explanation:
        """The dry run, answered by the first worker up (see the contract)."""
        for worker in self._workers:
            channel = worker.channel
            if channel is None or worker.ready is None or not worker.ready.done():
                continue
            self._seq += 1
            seq = self._seq
            future: asyncio.Future[Report | Explained | None]
            future = worker.pending[seq] = asyncio.get_running_loop().create_future()
            remote = " and the other replicas' row" if self.remote_row is not None else ""
            if self.predecessor_row is not None:
                remote += " and the row of the process this one took over from"
            view = (
                f"worker {worker.index} of {self.count}: in flight read from every worker's"
                f" row{remote} as it answered"
            )
            try:
                channel.send(Explain(seq, request, k, view))
            except ChannelClosed:
                worker.pending.pop(seq)
                continue
            answer = await future
            if not isinstance(answer, Explained):
                break  # it exited meanwhile
            if answer.explanation is None:
                raise Rejected(answer.error, field=answer.param)
            return answer.explanation
        raise Unavailable("no worker could answer now; retry")

    async def refresh(self) -> None:
        """Add up every worker's accounting into the supervisor's router.

        The supervisor's own fold comes first: every count the answer shows was in
        the table before any worker folded for it, so a caller who reads a count
        knows every worker's balancer sees it too.  (Folding after the workers
        answered could show a lease taken between their folds and this one, which
        a worker would not see until its next timed fold.)"""
        for tracker in self._trackers:
            tracker.fold()
        futures = self._ask(Query)
        reports = [r for r in await asyncio.gather(*futures) if isinstance(r, Report)]
        self._merge(reports)
        self.router.balancer.set_claim_spread(self.claim_spread())  # the workers' (views)

    def _merge(self, reports: list[Report]) -> None:
        router = self.router
        recorder = Recorder()
        idle: Counter[str] = Counter()
        tracing: Counter[str] = Counter()
        totals: dict[str, list[int]] = {}
        for report in reports:
            tracing.update(report.tracing)
            for name, counts in report.backends.items():
                row = totals.setdefault(name, [0, 0, 0, 0, 0, 0, 0])
                row[0] += counts.requests
                row[1] += counts.overflow
                row[2] += counts.fallback
                row[3] += counts.errors
                row[4] += counts.repeats_sent
                row[5] += counts.repeats_answered
                row[6] += counts.tie_breaks
                idle[name] += counts.idle_connections
            for name, kind, decision, status, count in report.requests:
                recorder.requests[name, kind, decision, status] += count
            recorder.decisions.update(report.decisions)
            _add_histograms(recorder.ttft, report.ttft, TTFT_BUCKETS)
            _add_histograms(recorder.duration, report.duration, DURATION_BUCKETS)
            for name, window in report.windows.items():
                merged = recorder.windows.setdefault(name, deque(maxlen=WINDOW * self.count))
                merged.extend(window)
            recorder.no_backend += report.no_backend
            recorder.refused.update(report.refused)
            recorder.models.update(report.models)
            recorder.sources.update(report.sources)
        for backend in router.fleet.backends.values():
            requests, overflow, fallback, errors, sent, answered, ties = totals.get(
                backend.name, (0, 0, 0, 0, 0, 0, 0)
            )
            backend.requests, backend.overflow = requests, overflow
            backend.fallback, backend.errors = fallback, errors
            backend.repeats_sent, backend.repeats_answered = sent, answered
            backend.tie_breaks = ties
        router.recorder = recorder
        router.reported_idle = dict(idle)
        responses = router.responses
        responses.hits = responses.misses = responses.fallbacks = 0
        responses.learnt = responses.unread = 0
        for report in reports:
            responses.add_counts(report.responses)
            router.tenants.absorb(report.tenants)
        router.reported_queue = (
            sum(report.queue[0] for report in reports),
            sum(report.queue[1] for report in reports),
        )
        router.reported_connections = (
            sum(report.connections[0] for report in reports),
            sum(report.connections[1] for report in reports),
        )
        arms = router.balancer.arms
        if arms is not None:  # an A/B experiment: its arms' totals, from scratch each read
            arms.reset()
            arms.absorb([arm for report in reports for arm in report.arms])
        self.tracing = dict(tracing)


def _add_histograms(
    into: dict[str, Histogram], source: dict[str, HistogramData], bounds: tuple[float, ...]
) -> None:
    for name, data in source.items():
        histogram = into.get(name)
        if histogram is None:
            histogram = into[name] = Histogram(bounds)
        for i, count in enumerate(data.counts):
            histogram.counts[i] += count
        histogram.total += data.total
