"""One worker process of ``prefix-router serve --workers N``: the data plane alone.

    python -m router.worker --channel-fd FD --table-fd FD --listen-fds FD,... [--changes-fd FD]

Contract:
- The supervisor (``router.supervisor``) starts the worker with two
  inherited descriptors: its end of the channel (``router.channel``) and the
  shared in-flight table (``router.shared``); with UDP rows a third, the
  eventfd the worker signals each change of its row on (``ChangeSignal``).  The first message is
  ``Init``: the fleet and config as they are now.  The worker builds a
  ``Router`` from it, counts in flight in its own row of the table (the
  balancer reads fleet-wide counts: its own plus the other workers', folded
  every ``FOLD_SECONDS``), serves the listening sockets the supervisor
  dealt it (``--listen-fds``: its own accept queues of the port's
  SO_REUSEPORT group, which outlive it) and answers ``Ready``.
- Every ``Apply`` goes through ``router.control.ops.apply``, the one apply
  path, and is acknowledged once the worker's ring has it.  ``Query`` is
  answered with the worker's traffic accounting (``Report``), ``Explain``
  with the dry run of a routing decision (``router.explain``), every
  worker's in-flight row read first.
- TRAFFIC placement is one for the fleet: the balancer records its
  decisions (``Balancer.share_placement``), the worker sends them every
  ``PUBLISH_SECONDS`` when it made any (``Records``) and folds in what the
  supervisor passes on from the other workers and replicas.  A new key is
  placed here at once, with no round trip; replicas converge on the earliest
  placement (``hashring.shared.PlacementLog``).  Responses API ids learnt here
  (``router.responses``) go in the same messages, sent at the end of the loop
  iteration that learnt them; the ids the fleet knew when the worker started
  come in ``Init``.
- Engine signals (``router.signals``): the supervisor scrapes; the worker
  breaks ties by the figures of its ``Init`` and then of each ``Signals``.
- Health belongs to the supervisor: this process runs no checks, it reports
  passive failures (and the first good answer after one) and applies the
  supervisor's ``SetHealthy`` ops.  It tells the supervisor when its own
  count for a draining backend reaches zero (``Idle``).
- Claim spreading (``router.balancer``): every ``SPREAD_SECONDS`` the
  worker writes how many of its requests went past their primary (its
  backends' overflow and fallback counters summed, nothing on the request
  path) into its row's ``CONTENDED_CELL`` and
  takes the spread the supervisor set in the table's last row
  (``SPREAD_CELL``, ``router.replicas``); a table without replicas never
  sets it, and the spread stays 1.
- SIGTERM or SIGINT drain and exit 0, as a single router does; so does the
  channel closing (the supervisor is gone: nobody would restart or stop us).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
from collections.abc import Iterable

import msgspec

from .app import Router
from .channel import (
    Applied,
    Apply,
    BackendCounts,
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
)
from .config import tls_context
from .control.ops import AddBackend, RemoveBackend, apply
from .explain import Refused, explain
from .fleet import AdminState, Backend, Fleet
from .health import HealthMonitor
from .log import configure, get_logger
from .metrics import Histogram
from .shared import (
    CONTENDED_CELL,
    DEFAULT_PERIOD,
    PLANES,
    SPREAD_CELL,
    TABLE_PLANES,
    ChangeSignal,
    SharedDeadline,
    SharedLoadTracker,
    SharedTable,
    stamp_cells,
)

__all__ = ["main", "report"]

# How stale the other workers' in-flight counts may be (router.shared says what
# a fold costs and what a worker misses meanwhile).
FOLD_SECONDS = DEFAULT_PERIOD
# How late the other workers learn of a placement made here (and, through the
# supervisor and router.replicas, the other replicas, PERIOD later again).
PUBLISH_SECONDS = DEFAULT_PERIOD
# How often this worker's contended count and the replicas' claim spread are exchanged.
SPREAD_SECONDS = 0.1

log = get_logger("worker")


class ReportedHealth(HealthMonitor):
    """Passive health handed to the supervisor, which decides for every worker."""

    def __init__(self, fleet: Fleet, router: Router, channel: Channel):
        super().__init__(fleet, router.config.health)
        self._channel = channel
        self._reported: set[str] = set()  # failures reported and not yet followed by a success

    def start(self) -> None:
        pass  # no checks here

    def watch(self, backend: Backend) -> None:
        pass

    def unwatch(self, name: str) -> None:
        self._reported.discard(name)

    def failed(self, backend: Backend, reason: str) -> None:
        self._reported.add(backend.name)
        self._channel.send(Failed(backend.name, reason))

    def answered(self, backend: Backend) -> None:
        if self._reported and backend.name in self._reported:
            self._reported.discard(backend.name)
            self._channel.send(Recovered(backend.name))


def _histograms(source: dict[str, Histogram]) -> dict[str, HistogramData]:
    return {name: HistogramData(h.counts, h.total) for name, h in source.items()}


def report(router: Router, seq: int) -> Report:
    """This process's traffic accounting, for the supervisor to add up."""
    recorder = router.recorder
    idle = router.idle_connections()
    return Report(
        seq=seq,
        backends={
            name: BackendCounts(
                b.requests,
                b.overflow,
                b.fallback,
                b.errors,
                idle.get(name, 0),
                b.repeats_sent,
                b.repeats_answered,
                b.tie_breaks,
            )
            for name, b in router.fleet.backends.items()
        },
        requests=[(*key, count) for key, count in recorder.requests.items()],
        decisions=dict(recorder.decisions),
        ttft=_histograms(recorder.ttft),
        duration=_histograms(recorder.duration),
        windows={name: list(window) for name, window in recorder.windows.items()},
        no_backend=recorder.no_backend,
        refused=dict(recorder.refused),
        tracing=router.tracer.counts() if router.tracer is not None else {},
        responses=router.responses.counts(),
        models=dict(recorder.models),
        sources=dict(recorder.sources),
        tenants=router.tenants.take(),
        queue=(router.queue.depth, router.queue.tenants) if router.queue is not None else (0, 0),
        connections=router.client_connections(),
        arms=router.balancer.arms.reports() if router.balancer.arms is not None else [],
    )


class _Worker:
    def __init__(self, init: Init, channel: Channel, table: SharedTable):
        self.channel = channel
        config = init.config
        if config.seed is not None:  # each worker its own RANDOM draws
            config = msgspec.structs.replace(config, seed=config.seed + init.index)
        router = self.router = Router(config, tls=tls_context(config))
        fleet = router.fleet
        self.trackers = [SharedLoadTracker(table, plane, init.index) for plane in range(PLANES)]
        fleet.loads, fleet.waiting = self.trackers
        for name, slot in init.slots.items():
            self._assign(name, slot)
        fleet.set_states(init.draining, AdminState.DRAINING)
        for name in init.unhealthy:
            fleet.set_healthy(name, False)
        for name, ramp in init.ramps.items():
            fleet.set_ramp(name, ramp)
        router.health = ReportedHealth(fleet, router, channel)
        if router.signals is not None:
            router.signals.set(init.signals)
        fleet.loads.on_idle = self._idle
        router.tenants.deltas = True  # the supervisor keeps the sums (router.tenants)
        if router.queue is not None:
            # Another worker's (or replica's) request ended: a place may be free here.
            for tracker in self.trackers:
                tracker.on_fold = router.queue.wake
            # The reserve is wanted where any worker (or replica) saw a tenant under its
            # share; deciding at its edge, a worker reads the others' counts first.
            router.queue.fleet_wants = SharedDeadline(table, init.index)
            router.queue.refresh = self._fold
        router.balancer.share_placement(init.stamp)
        router.responses.apply(init.responses)
        # A follow-up may reach another worker a moment after the answer: new ids
        # leave at the end of this loop iteration, not a period later, and an
        # unknown id is waited for up to two periods (router.responses, "The race").
        router.responses.share(self._flush_soon, wait_s=2 * PUBLISH_SECONDS)
        self.sockets: list[socket.socket] = []  # the listening sockets the supervisor dealt us
        self._publishing: asyncio.TimerHandle | None = None
        # Claim spreading: this row's contended count, the last row's spread (0 means 1).
        self._cells = table.cells
        self._contended = table.row_cell(init.index, CONTENDED_CELL)
        self._spread = table.row_cell(table.rows - 1, SPREAD_CELL)
        self._spreading: asyncio.TimerHandle | None = None
        self._spread_set = 1  # the last spread set (the balancer's starts at 1)

    def _fold(self) -> None:
        """Fold the other rows in now; a change wakes the queue as the timed fold would
        have (it will not: it sees these rows as read)."""
        changed = [tracker.fold() for tracker in self.trackers]
        queue = self.router.queue
        if any(changed) and queue is not None:
            queue.wake()

    def _publish(self) -> None:
        """Send the placements made since the last call, if any; again in a period."""
        self._flush()
        loop = asyncio.get_running_loop()
        self._publishing = loop.call_later(PUBLISH_SECONDS, self._publish)

    def _exchange_spread(self) -> None:
        """Publish the contended count and take the spread (the contract); again in a period."""
        cells = self._cells
        backends = self.router.fleet.backends.values()
        cells[self._contended] = sum(b.overflow + b.fallback for b in backends)
        spread = cells[self._spread] or 1
        if spread != self._spread_set:
            self.router.balancer.set_claim_spread(spread)
            self._spread_set = spread
        loop = asyncio.get_running_loop()
        self._spreading = loop.call_later(SPREAD_SECONDS, self._exchange_spread)

    def _flush_soon(self) -> None:
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the placements and response ids learnt so far.  Also before every
        answer to the supervisor: once a change is acknowledged by every worker,
        each one's earlier placements have reached the supervisor (and, relayed in
        order, every worker that answers the next change)."""
        records = self.router.balancer.publish_records()
        responses = self.router.responses.publish()
        if records or responses:
            with contextlib.suppress(ChannelClosed):  # gone: _receive stops us
                self.channel.send(Records(records, responses))

    def _assign(self, name: str, slot: int) -> None:
        for tracker in self.trackers:
            tracker.assign(name, slot)

    def _forget(self, names: Iterable[str]) -> None:
        for name in names:
            for tracker in self.trackers:
                tracker.forget(name)

    def _idle(self, name: str) -> None:
        backend = self.router.fleet.backends.get(name)
        if backend is not None and backend.state is AdminState.DRAINING:
            # Called from a lease's release, mid-way through an exchange's end: the
            # supervisor gone is _receive's to act on, not a reason to stop that end.
            with contextlib.suppress(ChannelClosed):
                self.channel.send(Idle(name))

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer the supervisor until the channel closes or ``stop`` is set."""
        router = self.router
        loop = asyncio.get_running_loop()
        for tracker in self.trackers:
            tracker.start(loop, FOLD_SECONDS)
        await router.start(sockets=self.sockets)
        # What start built lives as long as the process: kept out of the
        # collector's sight, a full collection walks only what requests made
        # (with ~55,000 objects from start, one took 14-21 ms of the loop).
        gc.freeze()
        self._publish()
        self._exchange_spread()
        self.channel.send(Ready(os.getpid()))
        receiving = asyncio.create_task(self._receive())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait((receiving, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            receiving.cancel()
            stopping.cancel()
            await router.shutdown()
            for timer in (self._publishing, self._spreading):
                if timer is not None:
                    timer.cancel()
            for tracker in self.trackers:
                tracker.stop()

    async def _receive(self) -> None:
        channel, router = self.channel, self.router
        try:
            while True:
                message = await channel.receive()
                if isinstance(message, Apply):
                    op = message.op
                    if isinstance(op, AddBackend) and op.slot >= 0:
                        self._assign(op.spec.name, op.slot)
                    apply(router, op)
                    if isinstance(op, RemoveBackend):
                        self._forget((op.name,))
                    await router.fleet.settled()
                    self._flush()
                    channel.send(Applied(message.seq))
                elif isinstance(message, Signals):
                    if router.signals is not None:
                        router.signals.set(message.figures)
                elif isinstance(message, Records):
                    if message.records:
                        router.balancer.apply_records(message.records)
                    if message.seed:
                        router.responses.seed(message.responses)
                    else:
                        router.responses.apply(message.responses)
                elif isinstance(message, Query):
                    # Fold now: whoever reads the answer has every worker's counts
                    # as of this moment (a test can rely on it; the timer bounds the rest).
                    for tracker in self.trackers:
                        tracker.fold()
                    self._flush()
                    channel.send(report(router, message.seq))
                elif isinstance(message, Explain):
                    for tracker in self.trackers:
                        tracker.fold()  # every worker's row as of now: the fleet's loads
                    try:
                        answer = Explained(
                            message.seq, explain(router, message.request, message.k, message.view)
                        )
                    except Refused as exc:
                        answer = Explained(message.seq, None, str(exc), exc.param)
                    channel.send(answer)
                else:
                    log.error("unexpected message", message=type(message).__name__)
        except ChannelClosed as exc:
            if not router.stopping:
                log.warning("supervisor gone: stopping", reason=str(exc))


async def _run(
    channel_fd: int, table_fd: int, changes_fd: int | None, listen_fds: list[int]
) -> None:
    channel = await Channel.open(socket.socket(fileno=channel_fd))
    init = await channel.receive()
    if not isinstance(init, Init):
        raise SystemExit(f"worker: expected Init, got {type(init).__name__}")
    table = SharedTable.attach(table_fd, init.table_rows, init.table_slots, TABLE_PLANES)
    worker = _Worker(init, channel, table)
    worker.sockets = [socket.socket(fileno=fd) for fd in listen_fds]
    if changes_fd is not None:  # UDP rows: the supervisor hears of each change at once
        stamp = stamp_cells(table, init.index)  # the lag counted from the change itself
        signal_change = ChangeSignal(changes_fd, asyncio.get_running_loop(), table.cells, stamp)
        for tracker in worker.trackers:
            tracker.on_change = signal_change
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.serve(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the drain
        channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.worker")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--table-fd", type=int, required=True)
    parser.add_argument("--changes-fd", type=int, default=None)
    parser.add_argument(
        "--listen-fds", required=True, help="the listening sockets, comma-separated"
    )
    args = parser.parse_args(argv)
    configure()
    import uvloop

    listen_fds = [int(fd) for fd in args.listen_fds.split(",")]
    uvloop.run(_run(args.channel_fd, args.table_fd, args.changes_fd, listen_fds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
