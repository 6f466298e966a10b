"""Router replicas on several hosts: each publishes its in-flight counts, all fold them in.

Contract:
- Each replica (one ``serve --etcd`` supervisor and its workers) holds one key,
  ``P replicas/<id>``, attached to a lease of ``TTL`` seconds that it keeps
  alive: a replica that dies or loses etcd vanishes from the others' view
  within the TTL.  Its value (JSON, ``Row``) is what the replica has in flight
  per backend (every worker's own counts, never what it folded in from other
  replicas), and the etcd revision it has applied.  It is written every
  ``PERIOD`` seconds when it changed; the lease is renewed every ``TTL / 3``
  (a keep-alive: a put with the lease does not renew it, and without one the
  key went every TTL, taking this replica out of the others' sums and
  drains until its next write).
- Every replica watches ``P replicas/`` and writes its estimate of the
  *other* replicas' counts into the last row of its shared in-flight table
  (the "remote" row, ``router.shared``): its workers fold that row in as they
  do each other's, so the ConcurrencyThreshold and BalanceFactor bound the
  fleet, not one replica (SageMaker's semantics).  The remote row is written
  by this process alone, so it needs no atomics.
- The estimate: another replica's row as published, plus what this replica's
  own counts gained per backend since that row was published (a loss counts
  as none: no replica's request is taken as finished before its row says
  so); rewritten every ``EXTRAPOLATE_PERIOD`` while the own counts move.
  "Since published": a row carries its wall-clock time (``Row.at``), and each
  replica keeps its own counts of the last ``HISTORY`` periods, so the time a
  row spent in etcd's watch and this loop's queue counts as what it is, the
  others' gains, not as nothing.  A row from an older version (no time), one
  older than the history, or a first row before any history is based on the
  oldest or current counts at hand.  Hosts' clocks are taken to agree within
  a few ms (NTP); a skew shifts the base by as much.
  Why: a published row is up to ``PERIOD`` + the watch's delay old, and every
  replica reads the same old rows, so all of them see the first members of a
  hot key's walk below the threshold and each adds its own requests on top
  (herding: on ``sysprompt`` with SageMaker's semantics, 4 replicas, P90
  TTFT +18 % and the least loaded instance at 8.8 % against 10.1 %,
  ``loadtests/RESULTS.md``).  A load balancer in front spreads requests
  evenly over the replicas, so what this replica added to a backend since
  another's row is what that one most likely added too; with it the same
  run is within 9 % of one router's P90 and inside its share range.  A
  replica that takes more than its share is underestimated until its next
  row, as with no estimate at all.
- TRAFFIC placement: the row also carries the placement records this
  replica's workers made since its last write (``hashring.shared.Record``,
  passed in with ``add_records``); the other replicas hand them to their
  workers (``on_records``).  Records of model pools (``Record.pool`` set)
  travel apart from the fleet's (``pool_records``), so a replica of a version
  without pools still reads the rest of the row.  A row with records is
  written even if its counts did not change.  Cost: a record per routed request (~60 bytes of
  JSON), batched into the 10 writes a second a replica makes anyway, so the
  etcd traffic grows with the request rate, not the write rate.  A record
  lost (a watch re-listed after a compaction) only delays agreement: the
  replicas converge on a key's earliest placement the next time any of them
  routes it.
- The admission queue's reserve (``router.queue``): the row carries until
  when this replica's workers want it (``reserve_until``, Unix time rounded
  up to whole seconds, so it changes at most once a second); the latest of
  the other replicas' goes into the remote row's cell of the reserve plane
  (``router.shared.SharedDeadline``), which every worker reads.
- Drains across replicas (``drained``): a backend set draining leaves when
  every live replica has applied the revision that set it draining and
  reports nothing in flight to it, and this replica has nothing either.
- Claim spreading (``router.balancer``): every ``EXTRAPOLATE_PERIOD`` this
  replica adds up how many of its workers' requests went past their primary
  (each worker's ``CONTENDED_CELL``, ``router.worker``) and takes their rate
  over the last ``RATE_WINDOW`` seconds (``RateWindow``; ``rate``, published
  in its row); the fleet's is its own plus the other rows' (a row without
  one counts as this replica's), and ``claim_spread`` of it goes into the
  remote row's ``SPREAD_CELL``, which every worker reads (``spread`` holds
  it for the admin API).  A count that went down (a worker restarted, a
  backend left with its counters) starts the window again; until it spans
  ``RATE_MIN_SPAN`` the rate and spread stay as they were.
  Why those requests: only a request that found its walk's first member
  full can race another for a place freed there; one whose primary had room
  claimed a place nobody else wanted.  Counting every request made c = R on
  ``long`` under SageMaker's semantics at 35 requests/s (its homes rarely
  full: 0.5 % overflow) and cost it 3 points of hit rate live.
- Cost: each replica writes at most 1/``PERIOD`` times a second (10/s) and
  receives every other replica's writes: R replicas make 10 R writes/s and
  10 R (R - 1) watch events/s on etcd, fine for the R = 2-10 a fleet runs.
- etcd lost: publishing and the watch retry with backoff; the remote row keeps
  the last counts until a replica's lease expires (its key is deleted, its
  counts leave the sum).  Nothing here blocks a request.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable

import msgspec

from hashring.shared import Record

from .config import RoutingConfig, Strategy
from .control import PeerView, ReplicasView, UdpView
from .etcd import EtcdClient, EtcdError, LeaseNotFound
from .log import get_logger
from .responses import Learnt
from .shared import (
    CONTENDED_CELL,
    DEFAULT_PERIOD,
    PLANES,
    SPREAD_CELL,
    SharedDeadline,
    SharedTable,
    stamp_cells,
)
from .udprows import FAST_PERIOD, FAST_STALE, Pace, Sample, Sender, UdpRows, peer_address

__all__ = ["PERIOD", "RateWindow", "Replicas", "Row", "claim_spread"]

log = get_logger("replicas")

PERIOD = 0.1
TTL = 3
# How often the remote row follows this replica's own counts between the
# others' rows: the workers' fold period, so each fold sees a fresh estimate.
EXTRAPOLATE_PERIOD = DEFAULT_PERIOD
# This replica's own counts kept for basing the estimate at a row's publish
# time: one a period, 0.5 s (a row older than that on arrival is based on the
# oldest: the estimate then counts less than it could, never more).
HISTORY = round(0.5 / EXTRAPOLATE_PERIOD)
# Claim spreading measures the request rate over this long (router.balancer):
# at 5 requests/s a replica counts ~25 in it, its rate within ~20 %, and the
# fleet's, summed over the replicas' rows, closer (a 2 s window on one
# replica's count times R made c jump between 1 and 3 at sysprompt's 20/s).
RATE_WINDOW = 5.0
RATE_MIN_SPAN = 1.0  # ... and takes none from less (10 ms holding one request is 100/s)
MAX_RECORDS = 10_000  # placement records kept for the next write while etcd is away


def claim_spread(replicas: int, rate: float, period: float = PERIOD) -> int:
    """Claim spreading's ``c`` (``router.balancer``) for ``replicas`` routers that
    see each other's counts a ``period`` late, where ``rate`` requests/s in the
    fleet find their walk's first member full (overflow and fallback): those
    made in one period (the claims that race for a place freed in it), rounded,
    at least 1 and at most ``replicas``.

    ``sysprompt`` (20 requests/s, ~87 % past the primary) gets 2, which
    offline gives one router's share range at R = 4 where c = R cost ``long``
    2.9 hit-rate points; ``long`` (0.5 % past the primary) gets 1."""
    if replicas <= 1:
        return 1
    return max(1, min(replicas, round(rate * period)))


def late_counts_cost(routing: RoutingConfig) -> str | None:
    """What the others' counts 0.1 s late (etcd rows, no UDP rows) cost ``routing``
    between replicas, or None: the settings whose P90 TTFT on one hot prompt is
    more than 10 % over one router's offline (loadtests/RESULTS.md, "UDP rows")."""
    if routing.routing_strategy is not Strategy.PREFIX_AWARE:
        return None
    prefix = routing.prefix_aware_routing_config
    scope = prefix.concurrency_scope
    if prefix.balance_mode == "IN_FLIGHT" and scope == "PREFILL" and prefix.balance_factor:
        return "BalanceFactor under ConcurrencyScope PREFILL: P90 TTFT x1.24-1.36"
    if prefix.balance_mode == "TRAFFIC" and scope == "IN_FLIGHT":
        return "BalanceMode TRAFFIC with ConcurrencyScope IN_FLIGHT: P90 TTFT x1.26 at 4 replicas"
    return None


class RateWindow:
    """A rate from a cumulative count sampled over time: the increase over the
    samples of the last ``window`` seconds.  A count that went down starts the
    window again; ``add`` answers None until the samples span ``min_span``."""

    __slots__ = ("_samples", "min_span", "window")

    def __init__(self, window: float, min_span: float, every: float):
        """``every``: about how often ``add`` is called (sizes the sample ring)."""
        self.window = window
        self.min_span = min_span
        self._samples: deque[tuple[float, int]] = deque(maxlen=round(window / every) + 1)

    def add(self, now: float, count: int) -> float | None:
        samples = self._samples
        if samples and count < samples[-1][1]:
            samples.clear()  # a worker restarted or a backend left: its counts went
        samples.append((now, count))
        since, first = samples[0]
        if now - since < self.min_span:
            return None
        return (count - first) / (now - since)


# A whole fleet's placement record as rows carry it: ``Record`` without its pool,
# the shape every version reads; the records of model pools go beside them.
FleetRecord = tuple[tuple[float, int], int, str | None, str | None]


class Row(msgspec.Struct, frozen=True, omit_defaults=True):
    applied: int  # the last etcd revision this replica applied
    loads: dict[str, int] = {}
    waiting: dict[str, int] = {}
    records: list[FleetRecord] = []  # TRAFFIC placements since the last write
    responses: list[Learnt] = []  # Responses API ids learnt since the last write
    pool_records: list[Record] = []  # TRAFFIC placements of model pools (``Record.pool``)
    # Until when (Unix time, whole seconds) this replica's admission queues want their
    # reserve: a tenant under its share sent a request there (router.queue); 0: not.
    reserve_until: int = 0
    at: float = 0.0  # wall-clock time of the counts (0: a version that did not say)
    # Requests/s this replica routed past their primary over the last RATE_WINDOW,
    # to 0.1 (claim spreading); -1: not said (taken as routing as we do).
    rate: float = -1.0
    # UDP rows (router.udprows): where this replica takes the others' samples, the
    # key its own are signed with (hex), and the number of the sample of the counts
    # above (datagrams carry the same numbers); "", "", 0: no UDP rows.
    udp: str = ""
    udp_key: str = ""
    seq: int = 0

    def with_records(self, records: list[Record], responses: list[Learnt]) -> Row:
        """This row carrying ``records`` (the fleet's in ``records``, the pools' apart)
        and ``responses``."""
        fleet = [record[:4] for record in records if record.pool is None]
        pools = [record for record in records if record.pool is not None]
        return msgspec.structs.replace(self, records=fleet, pool_records=pools, responses=responses)

    def placements(self) -> list[Record]:
        """The records this row carries, as ``with_records`` was given them."""
        return [Record(*record) for record in self.records] + self.pool_records


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Row)


class Replicas:
    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        table: SharedTable,
        slots: Callable[[], dict[str, int]],
        applied: Callable[[], int],
        *,
        replica_id: str | None = None,
        udp: UdpRows | None = None,
        changes_fd: int | None = None,
    ):
        """``table``: the host's in-flight table, its last row the remote one;
        ``slots()``: backend -> column now; ``applied()``: the store's revision;
        ``udp``: this replica's UDP rows, open (router.udprows), or None;
        ``changes_fd``: the eventfd the workers signal each change of their rows
        on (``router.shared.ChangeSignal``), or None: sampled every FAST_PERIOD."""
        self.client = client
        self.key_prefix = prefix + b"replicas/"
        self.id = replica_id or os.urandom(6).hex()
        self.table = table
        self.remote = table.rows - 1  # the last row: the other replicas' sum
        # The admission queue's reserve: the workers' deadlines read, the others' written.
        self._wants = SharedDeadline(table, self.remote, rows=self.remote)
        self.slots = slots
        self.applied = applied
        self.others: dict[str, Row] = {}
        # This replica's own counts, per plane, when each other replica's row was
        # published (as ``_history`` has them), and the last HISTORY periods' counts.
        self._bases: dict[str, list[dict[str, int]]] = {}
        self._history: deque[tuple[float, list[dict[str, int]]]] = deque(maxlen=HISTORY)
        self._lease = 0
        self._published: Row | None = None
        self._records: list[Record] = []
        self._responses: list[Learnt] = []
        # another replica's placements and response ids
        self.on_records: Callable[[list[Record], list[Learnt]], None] | None = None
        # Claim spreading: the workers' contended cells, the spread's cell, the rate.
        self._contended_cells = [table.row_cell(row, CONTENDED_CELL) for row in range(self.remote)]
        self._spread_cell = table.row_cell(self.remote, SPREAD_CELL)
        # Each worker's oldest change not yet sent, and where this takes it (the lag).
        self._stamps = [stamp_cells(table, row) for row in range(self.remote)]
        self._window = RateWindow(RATE_WINDOW, RATE_MIN_SPAN, EXTRAPOLATE_PERIOD)
        self.rate = -1.0  # this replica's, published in its row; -1: not measured yet
        self.spread = 1
        self._changed = asyncio.Event()  # any other replica's row changed or left
        self._tasks: list[asyncio.Task[None]] = []
        # The own counts as last sampled and their number (rows and datagrams).
        # Numbered from the wall clock in microseconds, one more per change: a
        # replica restarted under the same id numbers above its last life (which
        # cannot change a million times a second), so its row is taken as newer.
        self._seq = time.time_ns() // 1000
        self._sample: list[dict[str, int]] = [{} for _ in range(PLANES)]
        self._sample_raw = b""  # the workers' rows when sampled
        # UDP rows: where each other replica listens, its key, and when (monotonic)
        # its last datagram came.
        self.udp = udp
        self._peers: dict[str, tuple[str, int]] = {}
        self._keys: dict[str, bytes] = {}
        self._heard: dict[str, float] = {}
        self._flushing: asyncio.Handle | None = None  # the remote row's write, pending
        self._flush_pace = Pace()  # see _flush
        self.sender: Sender | None = None
        if udp is not None:
            udp.key_of = self._keys.get
            udp.on_sample = self._take_sample
            self.sender = Sender(udp, self.sampled, self._peers, changes_fd, self.changed_at)

    @property
    def key(self) -> bytes:
        return self.key_prefix + self.id.encode()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="replica publish"),
            asyncio.create_task(self._watch_loop(), name="replica watch"),
            asyncio.create_task(self._extrapolate_loop(), name="replica estimate"),
        ]
        if self.sender is not None:
            self.sender.start()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # a loop that died: still let go of the rest
                log.error("replica task failed", task=task.get_name(), reason=repr(exc))
        # Nothing sent or written from here on: the sender lets go of the workers'
        # eventfd before their owner (``Workers.stop``) closes it.
        if self.sender is not None:
            await self.sender.close()
        if self.udp is not None:
            self.udp.close()
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        if self._lease:
            try:
                await self.client.lease_revoke(self._lease)  # our key goes at once
            except EtcdError:
                pass  # etcd away: the lease runs out in TTL
            except Exception as exc:  # never let the shutdown stop here
                log.error("lease revoke failed", reason=repr(exc))

    # -- what we publish ---------------------------------------------------------

    def add_records(self, records: list[Record], responses: list[Learnt]) -> None:
        """Placement records and response ids of this replica's workers, for the
        next write (the newest ``MAX_RECORDS`` of each: while etcd is away the
        oldest go)."""
        self._records += records
        del self._records[:-MAX_RECORDS]
        self._responses += responses
        del self._responses[:-MAX_RECORDS]

    def local(self) -> list[dict[str, int]]:
        """This replica's own counts per plane: every worker row, not the remote one."""
        slots = self.slots()
        return self._local(slots, _span(slots))

    def _local(self, slots: dict[str, int], span: int) -> list[dict[str, int]]:
        planes = []
        for plane in range(PLANES):
            sums = self.table.plane_sums(plane, self.remote, span)
            planes.append({name: sums[slot] for name, slot in slots.items() if sums[slot]})
        return planes

    def sampled(self) -> tuple[int, list[dict[str, int]]]:
        """This replica's own counts now (``local``) and their number, one more
        than the last sample's if they changed.  Reads up to the highest column in
        use, not the table's every slot (a sample follows each change: its cost is
        in the lag)."""
        slots = self.slots()
        span = _span(slots)
        raw = self.table.counts_bytes(self.remote, PLANES, span)  # the workers' rows
        if raw == self._sample_raw:
            return self._seq, self._sample  # not a cell changed: the every-ms case when idle
        self._sample_raw = raw
        local = self._local(slots, span)
        if local != self._sample:
            self._seq, self._sample = self._seq + 1, local
        return self._seq, self._sample

    def changed_at(self) -> float:
        """When (Unix time) the oldest change the workers signalled since the last
        call was made, 0.0 if none (or the workers do not stamp their changes:
        ``router.shared.ChangeSignal``); takes those changes."""
        cells = self.table.cells
        oldest = 0
        for stamp in self._stamps:
            if stamp is None:
                continue
            changed, taken = stamp
            at = cells[changed]
            if at > cells[taken]:
                oldest = at if not oldest else min(oldest, at)
                cells[taken] = at
        return oldest / 1e6

    def local_row(self) -> Row:
        seq, (loads, waiting) = self.sampled()
        left = self._wants.latest() - time.monotonic()
        until = math.ceil(time.time() + left) if left > 0 else 0  # whole seconds: few writes
        row = Row(self.applied(), loads, waiting, reserve_until=until, rate=self.rate, seq=seq)
        if self.udp is not None:
            row = msgspec.structs.replace(row, udp=self.udp.address, udp_key=self.udp.key.hex())
        return row

    async def _publish_loop(self) -> None:
        attempt = 0
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while True:
            try:
                if not self._lease:
                    self._lease = await self.client.lease_grant(TTL)
                    self._published = None
                    renewed = loop.time()
                elif loop.time() - renewed >= TTL / 3:
                    await self.client.lease_keepalive(self._lease)
                    renewed = loop.time()
                row = self.local_row()
                records, self._records = self._records, []
                responses, self._responses = self._responses, []
                if records or responses or row != self._published:
                    value = msgspec.structs.replace(row, at=time.time())
                    if records or responses:
                        value = value.with_records(records, responses)
                    try:
                        await self.client.put(self.key, _encoder.encode(value), lease=self._lease)
                    except BaseException:
                        self._records[:0] = records  # not written: with the next one
                        self._responses[:0] = responses
                        del self._records[:-MAX_RECORDS]
                        del self._responses[:-MAX_RECORDS]
                        raise
                    self._published = row
                attempt = 0
            except LeaseNotFound:
                self._lease = 0  # expired while etcd was away: a new one, our key again
                continue
            except EtcdError as exc:
                log.warning("cannot publish this replica's row", reason=str(exc))
                attempt += 1
                await asyncio.sleep(min(2.0, PERIOD * 2**attempt) * random.uniform(0.5, 1))
                continue
            await asyncio.sleep(PERIOD)  # the publication period itself

    # -- what the others publish ---------------------------------------------------

    async def _watch_loop(self) -> None:
        attempt = 0
        while True:
            try:
                items, revision = await self.client.range(self.key_prefix)
                for by_replica in (self.others, self._bases, self._peers, self._keys, self._heard):
                    by_replica.clear()
                for kv in items:
                    self._take(kv.key, kv.value)
                self._write_remote()
                self._changed.set()
                async with self.client.watch(self.key_prefix, start_revision=revision + 1) as w:
                    attempt = 0
                    async for event in w:
                        self._take(event.key, event.value if event.type == "PUT" else None)
                        self._write_remote()
                        self._changed.set()
            except EtcdError as exc:
                log.warning("replica watch lost", reason=str(exc))
            except Exception:  # a bug of ours must not end what the others publish
                log.exception("replica watch failed")
            attempt += 1
            await asyncio.sleep(min(2.0, PERIOD * 2**attempt) * random.uniform(0.5, 1))

    def _take(self, key: bytes, value: bytes | None) -> None:
        replica = key[len(self.key_prefix) :].decode(errors="replace")
        if replica == self.id:
            return
        if value is None:
            for by_replica in (self.others, self._bases, self._peers, self._keys, self._heard):
                by_replica.pop(replica, None)
            return
        try:
            row = _decoder.decode(value)
        except (msgspec.DecodeError, RecursionError) as exc:  # any writer's value
            log.warning("replica row skipped", replica=replica, reason=str(exc) or "too deep")
            return
        self._listen_to(replica, row)
        held = self.others.get(replica)
        if held is not None and held.seq > row.seq:  # a datagram brought newer counts
            row = msgspec.structs.replace(
                row, loads=held.loads, waiting=held.waiting, at=held.at, seq=held.seq
            )
        self.others[replica] = row
        self._bases[replica] = self._local_at(row.at)
        if (row.records or row.pool_records or row.responses) and self.on_records is not None:
            self.on_records(row.placements(), row.responses)

    def _listen_to(self, replica: str, row: Row) -> None:
        """Where ``replica`` takes UDP rows and its key, as its etcd row says."""
        address = peer_address(row.udp) if row.udp else None
        try:
            key = bytes.fromhex(row.udp_key)
        except ValueError:
            key = b""
        if address is None or len(key) != 16 or not (self.udp and self.udp.reaches(address)):
            self._peers.pop(replica, None)
            self._keys.pop(replica, None)
        else:
            self._peers[replica], self._keys[replica] = address, key

    def _take_sample(self, replica: str, sample: Sample) -> None:
        """Another replica's counts by UDP (``udp.on_sample``; signed, router.udprows)."""
        held = self.others.get(replica)
        if held is None:
            return  # its key came with its row: cannot happen, but a row may just have left
        if sample.seq < held.seq:
            return  # what we hold is newer (reordered)
        self._heard[replica] = time.monotonic()
        if sample.seq == held.seq:
            return  # a keep-alive
        self.others[replica] = msgspec.structs.replace(
            held, loads=sample.loads, waiting=sample.waiting, at=sample.at, seq=sample.seq
        )
        self._bases[replica] = self._local_at(sample.at)
        if self.udp is not None:
            self.udp.taken(sample.changed or sample.at)
        if self._flushing is None:  # one write for what came meanwhile
            self._flushing = self._flush_pace.later(self._flush)

    def heard(self, replica: str, now: float | None = None) -> bool:
        """``replica``'s counts come by UDP: its last datagram is under FAST_STALE old."""
        heard = self._heard.get(replica)
        if heard is None:
            return False
        return (time.monotonic() if now is None else now) - heard < FAST_STALE

    def remember(self, now: float, local: list[dict[str, int]]) -> None:
        """Keep ``local`` as this replica's own counts at wall-clock ``now``."""
        self._history.append((now, local))

    def _local_at(self, at: float) -> list[dict[str, int]]:
        """This replica's own counts as of wall-clock ``at``: the last kept at or
        before it, the oldest kept if it is older, now without a time or history."""
        history = self._history
        if not at or not history:
            return self.local()
        for kept, counts in reversed(history):
            if kept <= at:
                return counts
        return history[0][1]

    def estimate(self, local: list[dict[str, int]] | None = None) -> list[Counter[str]]:
        """The other replicas' counts per plane, as the contract estimates them."""
        monotonic = time.monotonic()
        # A replica heard by UDP sends each change within FAST_PERIOD: no news is none.
        estimated = [replica for replica in self.others if not self.heard(replica, monotonic)]
        if estimated and local is None:
            local = self.local()  # only what is estimated needs this replica's own counts
        planes = []
        for plane, field in enumerate(("loads", "waiting")):
            sums: Counter[str] = Counter()
            for row in self.others.values():
                published: dict[str, int] = getattr(row, field)
                for name, count in published.items():
                    sums[name] += count
            if local is not None:
                now = local[plane]
                for replica in estimated:
                    base = self._bases[replica][plane] if replica in self._bases else now
                    for name, count in now.items():
                        gained = count - base.get(name, 0)
                        if gained > 0:
                            sums[name] += gained
            planes.append(sums)
        return planes

    def _flush(self) -> None:
        """The remote row written for the datagrams that came; the next write waits
        four times as long as this one took in CPU time (``Pace``), so a big fleet's rewrites
        (~230 us at 1,000 backends) take at most a fifth of the loop, and a small
        one's (~7 us) follow every datagram."""
        self._flushing = None
        start = time.thread_time()  # CPU time: a preemption mid-write is not its cost
        self._write_remote()
        self._flush_pace.ran(time.thread_time() - start)
        if self.udp is not None:
            self.udp.written()

    def _write_remote(self, local: list[dict[str, int]] | None = None) -> None:
        table = self.table
        cells = table.cells
        slots = self.slots()
        for plane, sums in enumerate(self.estimate(local)):
            first = table.index(self.remote, plane)
            for name, slot in slots.items():
                cells[first + slot] = sums.get(name, 0)
        until = max((row.reserve_until for row in self.others.values()), default=0)
        left = until - time.time()
        self._wants.set(time.monotonic() + left if left > 0 else 0.0)

    def measure_spread(self, now: float) -> int:
        """Take the workers' contended counts at ``now`` (``time.monotonic``) and set
        the claim spread from the fleet's rate (the contract)."""
        cells = self.table.cells
        rate = self._window.add(now, sum(cells[i] for i in self._contended_cells))
        if rate is None:
            return self.spread  # too few counts yet (a start, a restart): as it was
        rate = self.rate = round(rate, 1)
        others = self.others.values()
        fleet = rate + sum(row.rate if row.rate >= 0 else rate for row in others)
        # The race for a freed place lasts as long as the others' counts are late.
        fast = bool(self.others) and all(self.heard(replica, now) for replica in self.others)
        period = 2 * FAST_PERIOD if fast else PERIOD
        self.spread = claim_spread(len(others) + 1, fleet, period)
        cells[self._spread_cell] = self.spread
        return self.spread

    async def _extrapolate_loop(self) -> None:
        """Keep the remote row following this replica's own counts between rows,
        and the claim spread following the rate."""
        written: list[dict[str, int]] | None = None
        while True:
            await asyncio.sleep(EXTRAPOLATE_PERIOD)  # a period, not a wait for an event
            self.measure_spread(time.monotonic())
            local = self.local()
            self.remember(time.time(), local)
            if not self.others:
                written = None
                continue
            if local != written:
                self._write_remote(local)
                written = local

    def view(self) -> ReplicasView:
        """For ``/admin/stats``: this replica, the others it holds, its UDP rows."""
        now = time.monotonic()
        others = [
            PeerView(replica, row.seq, self.heard(replica, now))
            for replica, row in sorted(self.others.items())
        ]
        udp = self.udp
        if udp is None:
            return ReplicasView(self.id, others)
        sent = UdpView(
            udp.address,
            udp.sent,
            self.sender.signals if self.sender is not None else 0,
            udp.received,
            udp.rejected,
            udp.stale,
            udp.oversize,
            udp.errors,
            udp.lag(),
        )
        return ReplicasView(self.id, others, sent)

    # -- drains --------------------------------------------------------------------

    def busy_elsewhere(self, name: str, since: int) -> bool:
        """Some other live replica has not applied ``since`` yet or has ``name`` in flight."""
        return any(row.applied < since or row.loads.get(name) for row in self.others.values())

    async def changed(self) -> None:
        """Return at the next change of another replica's row."""
        self._changed.clear()
        await self._changed.wait()


def _span(slots: dict[str, int]) -> int:
    """Columns ``[0, span)`` hold every backend of ``slots`` (backend -> column)."""
    return max(slots.values(), default=-1) + 1
