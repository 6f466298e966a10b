"""``router.shared``: fleet-wide in-flight counts in a memfd table, with real worker processes.

The workers are real Python processes given the table's fd with ``pass_fds``;
they start together on a "go" line, and the tests wait for them with
``wait()``.  Every fold the tests depend on is called explicitly: nothing here
depends on timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import Lease
from router.balancer import Balancer
from router.config import BackendSpec, RoutingConfig, parse_routing
from router.fleet import Fleet
from router.shared import (
    TABLE_PLANES,
    ChangeSignal,
    SharedDeadline,
    SharedLoadTracker,
    SharedTable,
    stamp_cells,
)
from router.udprows import UdpRows
from tests.harness.routers import SAGEMAKER

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 6
NAMES = [f"b{slot}" for slot in range(SLOTS)]

# A worker: attaches, binds b0..b5 to slots 0..5 on both planes, says "ready".
#   cycles N SEED  waits for "go", then N random acquire/release steps on plane 0
#                  (folding every 100), releases every lease on odd slots, keeps
#                  the rest, prints its own counts and exits holding them (a cell
#                  outlives its writer: nobody zeroes it)
#   hold           holds row+1 leases on each backend on plane 0 and one on b0 on
#                  plane 1, prints its own counts, then blocks until killed
#   read           (read-only) prints the folded counts of plane 0 and exits
WORKER = """
import json, random, sys
from router.shared import TABLE_PLANES, SharedDeadline, SharedLoadTracker, SharedTable
fd, rows, slots, row = map(int, sys.argv[1:5])
mode = sys.argv[5]
table = SharedTable.attach(fd, rows, slots, 2)
names = [f"b{slot}" for slot in range(slots)]
if mode == "read":
    reader = SharedLoadTracker(table, 0, None)
    for slot, name in enumerate(names):
        reader.assign(name, slot)
    reader.fold()
    print(json.dumps({"counts": dict(reader.counts), "total": reader.total}))
    sys.exit(0)
loads, waiting = SharedLoadTracker(table, 0, row), SharedLoadTracker(table, 1, row)
for tracker in (loads, waiting):
    for slot, name in enumerate(names):
        tracker.assign(name, slot)
print("ready", flush=True)
if mode == "cycles":
    cycles, seed = int(sys.argv[6]), int(sys.argv[7])
    sys.stdin.readline()
    rng = random.Random(seed)
    held = []
    for i in range(cycles):
        if held and rng.random() < 0.5:
            held.pop(rng.randrange(len(held))).release()
        else:
            held.append(loads.acquire(rng.choice(names)))
        if i % 100 == 0:
            loads.fold()
            assert loads.total == sum(loads.counts.values()) >= len(held)
    for lease in held:
        if int(lease.member[1:]) % 2:
            lease.release()
    print(json.dumps(loads.own_counts()), flush=True)
elif mode == "hold":
    held = [loads.acquire(name) for name in names for _ in range(row + 1)]
    held.append(waiting.acquire("b0"))
    print(json.dumps(loads.own_counts()), flush=True)
    sys.stdin.readline()
"""


@contextmanager
def worker_processes(table: SharedTable) -> Iterator[list[subprocess.Popen[str]]]:
    """Processes started into the list; any still running at the end are killed and reaped."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


def spawn(table: SharedTable, row: int, mode: str, *args: object) -> subprocess.Popen[str]:
    command = [str(table.fd), str(table.rows), str(table.slots), str(row), mode]
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, *command, *map(str, args)],
        cwd=ROOT, pass_fds=(table.fd,), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    assert text, f"worker exited early with {proc.wait()}"
    return text.strip()


def reader(table: SharedTable, plane: int = 0) -> SharedLoadTracker:
    tracker = SharedLoadTracker(table, plane, None)
    for slot, name in enumerate(NAMES):
        tracker.assign(name, slot)
    return tracker


def worker(table: SharedTable, row: int, plane: int = 0) -> SharedLoadTracker:
    tracker = SharedLoadTracker(table, plane, row)
    for slot, name in enumerate(NAMES):
        tracker.assign(name, slot)
    return tracker


@pytest.fixture
def table() -> Iterator[SharedTable]:
    table = SharedTable.create(rows=5, slots=SLOTS)
    yield table
    os.close(table.fd)  # trackers may still view the mapping; the fd is what matters here


def column(table: SharedTable, plane: int = 0) -> dict[str, int]:
    return {name: table.column_total(plane, slot) for slot, name in enumerate(NAMES)}


def test_four_processes_writing_the_same_slots_lose_no_update(table: SharedTable) -> None:
    with worker_processes(table) as procs:
        for row in range(4):
            procs.append(spawn(table, row, "cycles", 20_000, row))
        assert [line(proc) for proc in procs] == ["ready"] * 4
        for proc in procs:  # all attached: start them together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        held: Counter[str] = Counter()
        for proc in procs:
            held.update(json.loads(line(proc)))
            assert proc.wait(timeout=60) == 0
    assert held, "the workers were to keep the leases on even slots"
    expected = {name: held[name] for name in NAMES}
    assert column(table) == expected  # every column sums to what is still held
    assert all(expected[name] == 0 for name in NAMES[1::2])  # released: back to 0
    assert column(table, plane=1) == dict.fromkeys(NAMES, 0)

    supervisor = reader(table)
    assert dict(supervisor.counts) == {}
    assert supervisor.total == 0
    assert supervisor.fold()
    assert dict(supervisor.counts) == {name: n for name, n in expected.items() if n}
    assert supervisor.total == sum(expected.values())
    assert not supervisor.fold()  # nothing changed since


def test_the_supervisor_sees_the_sum_after_fold_and_hears_when_a_backend_is_idle(
    table: SharedTable,
) -> None:
    workers = [worker(table, row) for row in range(3)]
    supervisor = reader(table)
    idle: list[str] = []
    supervisor.on_idle = idle.append
    leases = [workers[row].acquire("b1") for row in range(3)] + [workers[2].acquire("b4")]
    assert dict(supervisor.counts) == {}
    supervisor.fold()
    assert dict(supervisor.counts) == {"b1": 3, "b4": 1}
    assert supervisor.total == 4
    assert supervisor.get("b1") == 3
    assert supervisor.in_flight("b1") == 3
    with pytest.raises(TypeError, match="read-only"):
        supervisor.acquire("b1")

    leases[0].release()
    assert supervisor.in_flight("b1") == 2  # read now
    assert supervisor.get("b1") == 3  # folded: as of the last fold
    leases[1].release()
    leases[2].release()
    supervisor.fold()
    assert dict(supervisor.counts) == {"b4": 1}
    assert supervisor.total == 1
    assert idle == ["b1"]  # fleet-wide count fell to zero: a drain across workers may end


def test_a_worker_counts_its_own_leases_at_once_and_the_others_after_fold(
    table: SharedTable,
) -> None:
    me, other = worker(table, 0), worker(table, 1)
    idle: list[str] = []
    me.on_idle = idle.append
    mine = [me.acquire("b0"), me.acquire("b0")]
    theirs = [other.acquire("b0"), other.acquire("b3")]
    assert me.get("b0") == 2
    assert me.total == 2
    me.fold()
    assert dict(me.counts) == {"b0": 3, "b3": 1}
    assert me.total == 4
    assert me.own("b0") == 2
    assert me.own_counts() == {"b0": 2}
    for lease in mine:
        assert lease.release()
        assert not lease.release()  # exactly once
    assert idle == ["b0"]  # own count at zero, though another worker still has one
    assert dict(me.counts) == {"b0": 1, "b3": 1}
    assert me.total == 2
    for lease in theirs:
        lease.release()
    me.fold()
    assert dict(me.counts) == {}
    assert me.total == 0
    assert column(table) == dict.fromkeys(NAMES, 0)


def test_zero_row_of_a_killed_worker_restores_the_totals(table: SharedTable) -> None:
    me = worker(table, 0)
    supervisor, waiting = reader(table), reader(table, plane=1)
    kept = [me.acquire("b2")]
    with worker_processes(table) as procs:
        procs += [spawn(table, 1, "hold"), spawn(table, 3, "hold")]
        assert [line(proc) for proc in procs] == ["ready"] * 2
        held = [json.loads(line(proc)) for proc in procs]
        assert held == [dict.fromkeys(NAMES, 2), dict.fromkeys(NAMES, 4)]
        procs[1].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=30) == -signal.SIGKILL
        # Dead, but its row still counts until the supervisor zeroes it.
        for tracker in (me, supervisor, waiting):
            tracker.fold()
        assert me.get("b2") == 7
        assert me.get("b0") == 6
        assert me.total == 6 * SLOTS + 1
        assert supervisor.total == 6 * SLOTS + 1
        assert waiting.get("b0") == 2

        table.zero_row(3)  # every plane of row 3
        for tracker in (me, supervisor, waiting):
            tracker.fold()
        assert dict(me.counts) == {**dict.fromkeys(NAMES, 2), "b2": 3}
        assert me.total == 2 * SLOTS + 1 == supervisor.total
        assert dict(waiting.counts) == {"b0": 1}
        assert column(table) == {**dict.fromkeys(NAMES, 2), "b2": 3}
    kept[0].release()


def test_forget_unbinds_and_late_releases_write_nowhere(table: SharedTable) -> None:
    me, other = worker(table, 0), worker(table, 1)
    old = [me.acquire("b0"), me.acquire("b0")]
    theirs = other.acquire("b0")
    me.fold()
    assert me.get("b0") == 3

    me.forget("b0")  # the backend is removed: my cell is zeroed at once
    assert table.column_total(0, 0) == 1  # the other worker's, until it forgets too
    assert me.get("b0") == 2
    assert me.total == 2
    assert me.slot_of("b0") is None
    assert me.in_flight("b0") == 2
    other.forget("b0")
    theirs.release()
    assert table.column_total(0, 0) == 0

    # Every worker forgot b0: the supervisor may give slot 0 to another backend.
    for tracker in (me, other):
        tracker.assign("new", 0)
    fresh = other.acquire("new")
    old[0].release()  # a lease of the forgotten b0: must not touch slot 0
    assert table.column_total(0, 0) == 1
    me.fold()
    assert me.get("new") == 1
    assert me.get("b0") == 1
    assert me.total == 2

    # b0 comes back on another slot while a lease of its old life is held: it counts there.
    me.forget("b5")
    me.assign("b0", 5)
    assert table.column_total(0, 5) == 1
    assert me.get("b0") == 1
    old[1].release()
    assert table.column_total(0, 5) == 0
    assert "b0" not in me.counts
    fresh.release()


def test_assign_and_forget_refuse_what_would_mix_two_backends(table: SharedTable) -> None:
    me = worker(table, 0)
    with pytest.raises(ValueError, match="slot 1 is 'b1'"):
        me.assign("other", 1)
    with pytest.raises(ValueError, match="already has slot 1"):
        me.assign("b1", 2)
    me.assign("b1", 1)  # the same binding again: nothing to do
    for slot in (-1, SLOTS):
        with pytest.raises(ValueError, match="out of range"):
            me.assign("other", slot)
    with pytest.raises(KeyError, match="no slot"):
        me.forget("other")
    # A backend without a slot (not assigned yet) is counted here, written nowhere.
    lease = me.acquire("unassigned")
    assert me.get("unassigned") == 1
    assert me.total == 1
    assert column(table) == dict.fromkeys(NAMES, 0)
    lease.release()
    assert me.total == 0


def test_the_segment_outlives_the_processes_that_attached_it(table: SharedTable) -> None:
    assert os.readlink(f"/proc/self/fd/{table.fd}").startswith("/memfd:")  # no name to unlink
    with worker_processes(table) as procs:
        procs += [spawn(table, row, "hold") for row in (1, 2)]
        assert [line(proc) for proc in procs] == ["ready"] * 2
        held = [json.loads(line(proc)) for proc in procs]
        assert held == [dict.fromkeys(NAMES, row + 1) for row in (1, 2)]
        for proc in procs:  # end them the ordinary way: stdin closed, exit 0
            assert proc.stdin is not None
            proc.stdin.close()
            assert proc.wait(timeout=30) == 0
        expected = dict.fromkeys(NAMES, 5)
        assert column(table) == expected  # still mapped here, and still what they wrote
        # A process started after they all exited attaches the same segment by its fd.
        late = spawn(table, 0, "read")
        procs.append(late)
        assert json.loads(line(late)) == {"counts": expected, "total": 5 * SLOTS}
        assert late.wait(timeout=30) == 0
    with pytest.raises(PermissionError):  # sealed: nobody can shrink it under the others
        os.ftruncate(table.fd, 0)


def test_attach_checks_the_shape_and_leaves_the_fd_open(table: SharedTable) -> None:
    with pytest.raises(ValueError, match="bytes"):
        SharedTable.attach(table.fd, 4, SLOTS, 2)
    with pytest.raises(ValueError, match="header"):  # same size, another shape
        SharedTable.attach(table.fd, 5, SLOTS + 1, 2)
    os.fstat(table.fd)  # still open
    again = SharedTable.attach(os.dup(table.fd), 5, SLOTS, 2)
    me = worker(table, 0)
    lease = me.acquire("b3")
    assert again.column_total(0, 3) == 1  # one segment, two mappings
    lease.release()
    me.close()
    again.close()
    for rows, slots, planes in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="positive"):
            SharedTable.create(rows, slots, planes)


def two_workers(table: SharedTable, routing: RoutingConfig) -> tuple[Balancer, Balancer]:
    """Two workers' balancers on ``table`` (rows 0 and 1), as ``router.worker`` makes them."""
    specs = [BackendSpec(name, f"http://127.0.0.1:{9000 + i}") for i, name in enumerate(NAMES)]
    balancers = []
    for row in range(2):
        fleet = Fleet(specs)
        fleet.loads, fleet.waiting = worker(table, row, 0), worker(table, row, 1)
        balancers.append(Balancer(fleet, routing, seed=row))
    return balancers[0], balancers[1]


def test_the_balancer_sees_the_other_workers_load_without_waiting_for_a_fold(
    table: SharedTable,
) -> None:
    """Two workers' balancers on one table: the threshold is fleet-wide, and the
    member a walk chooses is read again in the other rows before it is taken."""
    routing = parse_routing(
        {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 2, **SAGEMAKER},
        }
    )
    first, second = two_workers(table, routing)
    key = 12345
    held = [choice for choice in (first.choose(key), first.choose(key)) if choice is not None]
    assert [choice.decision for choice in held] == ["primary", "primary"]
    home = held[0].backend.name
    loads = second.fleet.loads
    assert isinstance(loads, SharedLoadTracker)
    assert loads.get(home) == 0  # not folded: the home looked idle to the second worker
    after = second.choose(key)
    assert after is not None
    assert after.decision == "overflow"
    assert after.backend.name != home
    assert loads.get(home) == 2  # what the walk read again
    for choice in held:
        choice.release()
    # Only the member chosen is read again: a place freed elsewhere waits for the
    # fold (the safe side: the walk goes on past a member that has room).
    picked = second.peek(key)
    assert picked is not None
    assert picked[1] == "overflow"
    loads.fold()
    again = second.choose(key)
    assert again is not None
    assert (again.decision, again.backend.name) == ("primary", home)
    for choice in (after, again):
        choice.release()


def test_under_prefill_scope_the_walk_reads_the_requests_not_yet_answered_again(
    table: SharedTable,
) -> None:
    """ConcurrencyScope PREFILL bounds requests not yet answered (plane 1): the
    chosen member is read again there too."""
    routing = parse_routing(
        {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {
                "ConcurrencyThreshold": 1,
                **SAGEMAKER,
                "ConcurrencyScope": "PREFILL",
            },
        }
    )
    first, second = two_workers(table, routing)
    key = 4242
    held = first.choose(key)
    assert held is not None
    home = held.backend.name
    after = second.choose(key)  # no fold: only the read again sees the home waiting
    assert after is not None
    assert (after.decision, after.backend.name != home) == ("overflow", True)
    after.release()
    held.first_byte()  # answered: in flight still, no longer waiting
    again = second.choose(key)
    assert again is not None
    assert (again.decision, again.backend.name) == ("overflow", after.backend.name)
    # The view still counts the home as waiting until something reads it again.
    second.fleet.waiting.fold()
    last = second.choose(key)
    assert last is not None
    assert (last.decision, last.backend.name) == ("primary", home)
    for choice in (held, again, last):
        choice.release()


def test_refresh_reads_one_backend_now_and_the_next_fold_keeps_the_rows_truth(
    table: SharedTable,
) -> None:
    me, other, supervisor = worker(table, 0), worker(table, 1), reader(table)
    assert me.refreshes
    woken: list[str] = []
    me.on_fold = lambda: woken.append("wake")  # the admission queue's wake
    me.fold()
    lease = other.acquire("b1")
    assert not me.refresh("b2")  # unchanged
    assert not me.refresh("nobody")  # no slot: nothing to read
    assert me.refresh("b1")
    assert (dict(me.counts), me.total) == ({"b1": 1}, 1)
    assert not me.refresh("b1")
    assert woken == []  # a count that rose frees no place
    assert supervisor.refresh("b1")
    assert supervisor.get("b1") == 1
    idle: list[str] = []
    supervisor.on_idle = idle.append
    # The other row goes back to the bytes the last fold read: the fold must
    # still take back what the refresh saw in between.
    lease.release()
    me.fold()
    assert (dict(me.counts), me.total) == ({}, 0)
    assert supervisor.refresh("b1")
    assert idle == ["b1"]  # a drain across workers hears it, as from a fold
    supervisor.fold()
    assert idle == ["b1"]
    mine = me.acquire("b1")
    theirs = [other.acquire("b1"), other.acquire("b4")]
    assert me.refresh("b1")
    assert me.get("b1") == 2
    me.fold()
    assert (dict(me.counts), me.total) == ({"b1": 2, "b4": 1}, 3)
    theirs[0].release()
    assert woken == []
    assert me.refresh("b1")  # a place freed: the timed fold will not report it now
    assert woken == ["wake"]
    for held in (mine, theirs[1]):
        held.release()
    me.fold()
    assert (dict(me.counts), me.total) == ({}, 0)


# One step of the next test: (who, what, backend): who 0-3 is a tracker of a table
# of 4 rows, 4 the read-only one; what 0 acquire, 1 release, 2 fold, 3 refresh,
# 4 forget or assign again.
_STEPS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 4), st.sampled_from(NAMES[:3])), max_size=60
)


@given(steps=_STEPS)
@settings(max_examples=150)
def test_a_backend_whose_cells_compare_equal_to_those_read_has_the_count_of_its_column(
    steps: list[tuple[int, int, str]],
) -> None:
    """``probes`` (what the balancer compares instead of calling ``refresh``): for every
    tracker, a middle row's too (the own row splits the column in two views), a
    backend whose probe compares equal has the count its column sums to now, and
    ``refresh`` makes it so, whatever folds, refreshes and slot changes came between."""
    table = SharedTable.create(rows=4, slots=SLOTS)
    trackers = [worker(table, row) for row in range(4)] + [reader(table)]
    held: list[Lease] = []
    for who, what, name in steps:
        tracker = trackers[who]
        if what == 0 and tracker.row is not None:
            held.append(tracker.acquire(name))
        elif what == 1 and held:
            held.pop(len(held) // 2).release()
        elif what == 2:
            tracker.fold()
        elif what == 3:
            tracker.refresh(name)
            assert tracker.get(name) == tracker.in_flight(name)
        elif what == 4 and tracker.slot_of(name) is not None:
            tracker.forget(name)
        elif what == 4:
            tracker.assign(name, NAMES.index(name))
        for each in trackers:
            assert each.total == sum(each.counts.values())
            for member, (now, then, now_after, then_after) in each.probes.items():
                if now == then and now_after == then_after:
                    assert each.get(member) == each.in_flight(member)
    for lease in held:
        lease.release()
    for tracker in trackers:
        tracker.close()
    table.close()


def test_a_forgotten_backend_is_not_read_again_and_the_table_closes_after_its_trackers() -> None:
    table = SharedTable.create(rows=2, slots=SLOTS)
    me, other, supervisor = worker(table, 0), worker(table, 1), reader(table)
    lease = other.acquire("b1")
    me.forget("b1")
    assert not me.refresh("b1")  # no slot, no view of its cells
    me.assign("b1", 1)
    assert me.get("b1") == 0  # as assigned: the others' count comes with the next fold
    assert me.refresh("b1")
    assert me.get("b1") == 1
    lease.release()
    with pytest.raises(BufferError, match="close the SharedLoadTrackers"):
        table.close()  # the trackers still view the mapping
    for tracker in (me, other, supervisor):
        tracker.close()
    table.close()


async def test_start_folds_on_the_loop_until_stop(table: SharedTable) -> None:
    me = worker(table, 0)
    supervisor = reader(table)
    lease: Lease = me.acquire("b2")
    supervisor.fold()
    idle: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    supervisor.on_idle = idle.set_result
    supervisor.start(asyncio.get_running_loop(), period=0.001)
    lease.release()
    assert await idle == "b2"  # the timer's fold saw the column fall to zero
    supervisor.stop()
    with pytest.raises(ValueError, match="positive"):
        supervisor.start(asyncio.get_running_loop(), period=0)


def test_the_benchmark_runs_and_prints_its_tables() -> None:
    """``python -m loadtests.bench_shared``, tiny: it runs and prints both tables (no timing)."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_shared", "--pairs", "2", "--requests", "50",
         "--folds", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 1,000 | 8 |" in done.stdout
    assert "| 1,000 | 8 | 7 x 1,000 |" in done.stdout


# -- the other replicas' row (router/replicas.py writes it) -----------------------


class _Remote:
    """A replica's estimate over ``table`` (rows 0-3 its workers', row 4 the remote
    one), fed rows by hand: nothing is started, etcd never called."""

    def __init__(
        self, table: SharedTable, udp: UdpRows | None = None, changes_fd: int | None = None
    ) -> None:
        from router.etcd import EtcdClient
        from router.replicas import Replicas

        self.table = table
        self.replicas = Replicas(
            EtcdClient(["http://127.0.0.1:9"]),
            b"/t/",
            table,
            lambda: {name: slot for slot, name in enumerate(NAMES)},
            lambda: 0,
            replica_id="me",
            udp=udp,
            changes_fd=changes_fd,
        )

    def arrives(self, replica: str, row: object) -> None:
        from router.replicas import _encoder

        value = None if row is None else _encoder.encode(row)
        self.replicas._take(self.replicas.key_prefix + replica.encode(), value)
        self.replicas._write_remote()

    def remote(self, plane: int = 0) -> dict[str, int]:
        self.replicas._write_remote()
        table = self.table
        cells = {name: table.cells[table.index(4, plane, s)] for s, name in enumerate(NAMES)}
        return {name: count for name, count in cells.items() if count}


def router_table() -> SharedTable:
    """Rows 0-3 a replica's workers', row 4 the remote one; a router's planes."""
    return SharedTable.create(rows=5, slots=SLOTS, planes=TABLE_PLANES)


def test_the_remote_row_is_the_others_rows_plus_what_this_replica_gained_since() -> None:
    from router.replicas import Row

    table = router_table()
    estimate = _Remote(table)
    replicas, arrives, remote = estimate.replicas, estimate.arrives, estimate.remote
    zero, one, waiting = worker(table, 0), worker(table, 1), worker(table, 0, plane=1)

    held = [zero.acquire("b0")]
    arrives("r1", Row(0, {"b0": 2}, {"b1": 1}))
    assert remote() == {"b0": 2}  # as published: nothing gained since it came
    assert remote(1) == {"b1": 1}
    held += [one.acquire("b0"), one.acquire("b0"), zero.acquire("b1"), waiting.acquire("b1")]
    # r1 most likely did what this replica did since its row: two more on b0, one on b1.
    assert remote() == {"b0": 2 + 2, "b1": 1}
    assert remote(1) == {"b1": 1 + 1}
    arrives("r2", Row(0, {"b2": 1}))  # based on this replica's counts now
    assert remote() == {"b0": 4, "b1": 1, "b2": 1}
    for lease in held:
        lease.release()
    # Back to nothing in flight here: a loss counts as none, the rows as published.
    assert remote() == {"b0": 2, "b2": 1}
    assert remote(1) == {"b1": 1}
    arrives("r1", None)  # r1's lease expired: its counts and its base go
    assert remote() == {"b2": 1}
    assert remote(1) == {}
    for tracker in (zero, one, waiting):
        tracker.close()

    # The admission queue's reserve: a worker's deadline goes out in the row (Unix
    # time, whole seconds up); another replica's comes into the remote row's cell.
    wants = SharedDeadline(table, 2)
    assert replicas.local_row().reserve_until == 0
    wants.set(time.monotonic() + 5)
    assert 0 < replicas.local_row().reserve_until - time.time() <= 6
    wants.set(0)
    reader = SharedDeadline(table, None)
    arrives("r3", Row(0, reserve_until=int(time.time()) + 30))
    assert 28 < reader.latest() - time.monotonic() <= 30
    arrives("r3", Row(0, reserve_until=int(time.time()) - 1))  # lapsed
    assert reader.latest() < time.monotonic()
    os.close(table.fd)


def test_a_row_nested_past_the_recursion_limit_is_skipped_not_raised() -> None:
    # Any etcd writer can put one; msgspec raises RecursionError (not a
    # DecodeError) skipping the unknown field, which ended the watch task.
    from router.replicas import Row, _encoder

    table = router_table()
    estimate = _Remote(table)
    good = _encoder.encode(Row(0, {"b0": 2}))
    deep = good[:-1] + b',"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    take = estimate.replicas._take
    take(estimate.replicas.key_prefix + b"r1", deep)
    assert estimate.remote() == {}
    take(estimate.replicas.key_prefix + b"r1", good)
    assert estimate.remote() == {"b0": 2}
    os.close(table.fd)


def test_a_sample_reads_the_columns_in_use_and_numbers_each_change() -> None:
    table = router_table()
    replicas = _Remote(table).replicas
    in_use = {name: slot for slot, name in enumerate(NAMES[:3])}  # columns 0-2 of 6
    replicas.slots = lambda: in_use
    seq, planes = replicas.sampled()
    assert planes == [{}, {}]
    zero, three = worker(table, 0), worker(table, 3, plane=1)
    held = [zero.acquire("b2"), three.acquire("b2"), three.acquire("b0")]
    assert replicas.sampled() == (seq + 1, [{"b2": 1}, {"b2": 1, "b0": 1}])
    assert replicas.sampled()[0] == seq + 1  # nothing changed: the same number
    # A count in a column no backend uses is no backend's: the sample stays.
    lease = zero.acquire("b4")
    assert replicas.sampled()[0] == seq + 1
    in_use["b4"] = 4  # once it is in use, it is
    assert replicas.sampled() == (seq + 2, [{"b2": 1, "b4": 1}, {"b2": 1, "b0": 1}])
    for each in [*held, lease]:
        each.release()
    assert replicas.sampled() == (seq + 3, [{}, {}])
    assert table.plane_sums(1, 4, 3).tolist() == table.plane_sums(1, 4).tolist()[:3]
    for tracker in (zero, three):
        tracker.close()
    os.close(table.fd)


def test_a_row_is_based_on_this_replicas_counts_when_it_was_published() -> None:
    # A row spends time in etcd's watch before it arrives: what this replica
    # gained meanwhile is what the other most likely gained too.
    from router.replicas import HISTORY, Row

    table = router_table()
    estimate = _Remote(table)
    replicas, zero = estimate.replicas, worker(table, 0)
    held = [zero.acquire("b0")]
    replicas.remember(100.0, replicas.local())  # b0: 1
    held += [zero.acquire("b0"), zero.acquire("b0")]
    replicas.remember(100.01, replicas.local())  # b0: 3
    held.append(zero.acquire("b0"))  # b0: 4 now
    estimate.arrives("r1", Row(0, {"b1": 1}, at=100.005))
    assert estimate.remote() == {"b0": 3, "b1": 1}  # gained 3 since 100.0
    estimate.arrives("r2", Row(0, {"b2": 1}, at=100.02))
    assert estimate.remote() == {"b0": 3 + 1, "b1": 1, "b2": 1}  # r2: 1 since 100.01
    # Older than every count kept: the oldest; no time (an older version): now.
    estimate.arrives("r1", Row(0, {"b1": 1}, at=99.0))
    estimate.arrives("r2", Row(0, {"b2": 1}))
    assert estimate.remote() == {"b0": 3, "b1": 1, "b2": 1}
    for i in range(HISTORY):  # the history is bounded
        replicas.remember(200.0 + i, replicas.local())
    assert len(replicas._history) == HISTORY
    for lease in held:
        lease.release()
    zero.close()
    os.close(table.fd)


def test_the_claim_spread_follows_the_fleets_rate_and_a_count_that_went_down_restarts_it() -> None:
    from router.replicas import Row
    from router.shared import CONTENDED_CELL, RESERVE_PLANE, SPREAD_CELL

    table = router_table()
    estimate = _Remote(table)
    replicas = estimate.replicas
    contended = [table.index(row, RESERVE_PLANE) + CONTENDED_CELL for row in range(4)]
    spread = table.index(4, RESERVE_PLANE) + SPREAD_CELL

    def at(now: float, *counts: int) -> int:
        for cell, count in zip(contended, counts, strict=False):
            table.cells[cell] = count
        return replicas.measure_spread(now)

    # Alone, whatever the rate: nothing races.
    assert at(0.0, 0, 0) == 1
    assert at(1.0, 500, 500) == 1
    assert table.cells[spread] == 1
    assert replicas.local_row().rate == 1000.0  # published for the others
    estimate.arrives("old", Row(0, {}, {}))  # a version without a rate: counts as ours
    # Two workers' requests past their primary at 1,000/s, twice that in the fleet:
    # capped at 2.
    assert at(1.5, 750, 750) == 2
    assert table.cells[spread] == 2
    # A worker restarted (its count back at 0): the window starts again, and
    # until it spans a second the spread stays as it was.
    assert at(1.6, 0, 760) == 2
    # 6 requests/s here, as much for the old replica: 1.2 in a period, rounded to 1.
    assert at(2.6, 3, 763) == 1
    assert replicas.local_row().rate == 6.0
    estimate.arrives("new", Row(0, {}, {}, rate=10.0))
    # 6 + 6 + 10 = 22/s in the fleet, 2.2 a period: 2.
    assert at(3.6, 6, 766) == 2
    assert table.cells[spread] == 2


async def test_udp_samples_replace_a_replicas_counts_when_newer_and_end_its_estimate() -> None:
    from router.replicas import Row
    from router.udprows import Sample

    table = router_table()
    estimate = _Remote(table, UdpRows("me", lambda _: None))  # not opened: nothing sent
    replicas, arrives, remote = estimate.replicas, estimate.arrives, estimate.remote
    zero = worker(table, 0)
    key = "ab" * 16
    arrives("r1", Row(0, {"b0": 1}, udp="127.0.0.1:7400", udp_key=key, seq=5))
    assert replicas._peers == {"r1": ("127.0.0.1", 7400)}
    assert replicas._keys == {"r1": bytes.fromhex(key)}
    take = replicas._take_sample
    assert replicas.view().udp.lag_ms is None  # type: ignore[union-attr]
    sampled = time.time()
    take("r1", Sample(6, sampled - 0.25, {"b2": 2}, {"b2": 1}))  # sampled 250 ms ago
    await asyncio.sleep(0)  # one pass of the loop: the write it scheduled
    lag = replicas.view().udp.lag_ms  # type: ignore[union-attr]
    assert lag is not None
    assert lag.samples == 1
    assert 250 <= lag.p50 == lag.max <= 250 + 1000 * (time.time() - sampled)
    cells = {name: table.cells[table.index(4, 0, s)] for s, name in enumerate(NAMES)}
    assert {name: n for name, n in cells.items() if n} == {"b2": 2}
    assert (remote(), remote(1)) == ({"b2": 2}, {"b2": 1})
    replicas._heard.clear()
    take("r1", Sample(4, time.time(), {"b3": 9}, {}))  # older (reordered): ignored
    assert remote() == {"b2": 2}
    assert not replicas.heard("r1")  # and it says nothing of r1 being heard
    take("r1", Sample(6, time.time(), {"b2": 2}, {"b2": 1}))  # a keep-alive: heard
    assert replicas.heard("r1")
    # Heard by UDP, r1 sends each change: what this replica gains is not added to it.
    held = zero.acquire("b0")
    assert remote() == {"b2": 2}
    # The etcd row of an older sample brings its other fields, not its counts.
    arrives("r1", Row(3, {"b0": 1}, udp="127.0.0.1:7400", udp_key=key, seq=5))
    assert remote() == {"b2": 2}
    assert replicas.others["r1"].applied == 3
    # Without a datagram for FAST_STALE, the estimate between rows is back.
    replicas._heard["r1"] -= 1.0
    more = zero.acquire("b1")
    assert remote() == {"b1": 1, "b2": 2}
    # A row without an address (or a key that is not one): nothing sent to it.
    arrives("r1", Row(3, udp="127.0.0.1:7400", udp_key="zz", seq=7))
    assert (replicas._peers, replicas._keys) == ({}, {})
    arrives("r1", None)
    assert replicas.view().others == []
    # Samples are numbered from the wall clock in microseconds: a replica restarted
    # under the same id numbers above its last life, so its first row is newer.
    before = time.time_ns() // 1000
    again = _Remote(table).replicas
    assert before <= again.sampled()[0] <= time.time_ns() // 1000
    held.release()
    more.release()
    zero.close()
    os.close(table.fd)


async def test_a_workers_signal_sends_its_change_to_the_other_replicas_without_a_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from router import udprows
    from router.replicas import Row
    from router.udprows import Sample

    # No keep-alive in the test's time but the first: every later datagram is a signal's.
    monkeypatch.setattr(udprows, "KEEPALIVE", 3600.0)
    loop = asyncio.get_running_loop()
    table = router_table()
    fd = ChangeSignal.open()
    me, peer = UdpRows("me", lambda _: None), UdpRows("r1", lambda _: None)
    peer.key_of = {"me": me.key}.get
    got: asyncio.Queue[Sample] = asyncio.Queue()
    peer.on_sample = lambda _, sample: got.put_nowait(sample)
    zero = worker(table, 0)
    sender = None
    try:
        await me.open("127.0.0.1:0")
        address = await peer.open("127.0.0.1:0")
        estimate = _Remote(table, me, changes_fd=fd)
        replicas = estimate.replicas
        estimate.arrives("r1", Row(0, udp=address, udp_key=peer.key.hex()))
        sender = replicas.sender
        assert sender is not None
        sender.start()  # the reader on the eventfd, and the keep-alive's timer
        assert (await asyncio.wait_for(got.get(), 10)).loads == {}  # the first keep-alive
        assert sender.signals == 0
        # One signal per pass of the worker's loop, however many cells it wrote,
        # stamped with the time of the pass's first change (what the lag counts from).
        zero.on_change = ChangeSignal(fd, loop, table.cells, stamp_cells(table, 0))
        before = time.time()
        leases = [zero.acquire("b1"), zero.acquire("b1"), zero.acquire("b2")]
        sample = await asyncio.wait_for(got.get(), 10)
        assert (sample.loads, sender.signals, me.sent) == ({"b1": 2, "b2": 1}, 1, 2)
        assert before - 1e-6 <= sample.changed <= sample.at <= time.time()
        first = sample.changed
        leases.pop().release()
        sample = await asyncio.wait_for(got.get(), 10)
        assert (sample.loads, sender.signals) == ({"b1": 2}, 2)
        assert first < sample.changed <= sample.at  # the first stamp was taken: a new one
        # Untouched between signals: the eventfd holds nothing, no datagram goes.
        assert not ChangeSignal.take(fd)
        for lease in leases:
            lease.release()
        assert (await asyncio.wait_for(got.get(), 10)).loads == {}
        assert sender.signals == 3
        # Closed, it lets go of the eventfd (its owner closes it next) and sends nothing.
        await sender.close()
        assert not loop.remove_reader(fd)
        zero.acquire("b0").release()
        await asyncio.sleep(0)  # the pass's signal is written, and stays unread
        assert ChangeSignal.take(fd)
        assert sender.signals == 3
    finally:
        if sender is not None:
            await sender.close()
        os.close(fd)
        zero.close()
        me.close()
        peer.close()
        os.close(table.fd)


async def test_a_count_moved_by_assign_or_forget_is_signalled() -> None:
    """Leases held on a backend before its slot: ``assign`` moves their count into
    the row, ``forget`` out of it; either is a change the other replicas must hear."""
    fd = ChangeSignal.open()
    table = router_table()
    tracker = SharedLoadTracker(table, 0, 0)
    try:
        tracker.on_change = ChangeSignal(fd, asyncio.get_running_loop())
        tracker.assign("b0", 0)  # nothing held: nothing moves, no signal
        await asyncio.sleep(0)
        assert not ChangeSignal.take(fd)
        held = tracker.acquire("b1")  # no slot yet: counted in the dict, not signalled
        await asyncio.sleep(0)
        assert not ChangeSignal.take(fd)
        tracker.assign("b1", 1)
        await asyncio.sleep(0)
        assert ChangeSignal.take(fd)
        assert tracker.in_flight("b1") == 1
        tracker.forget("b1")
        await asyncio.sleep(0)
        assert ChangeSignal.take(fd)
        assert table.column_total(0, 1) == 0
        held.release()
    finally:
        tracker.close()
        os.close(fd)
        os.close(table.fd)


async def test_a_stamp_stays_the_oldest_change_until_the_supervisor_takes_it() -> None:
    """Two passes signal before the supervisor wakes: the lag counts from the first."""
    fd = ChangeSignal.open()
    table = router_table()
    zero, one = worker(table, 0), worker(table, 1)
    replicas = _Remote(table).replicas
    try:
        assert replicas.changed_at() == 0.0  # nothing signalled yet
        zero.on_change = ChangeSignal(
            fd, asyncio.get_running_loop(), table.cells, stamp_cells(table, 0)
        )
        one.on_change = ChangeSignal(
            fd, asyncio.get_running_loop(), table.cells, stamp_cells(table, 1)
        )
        before = time.time()
        held = [zero.acquire("b0")]
        await asyncio.sleep(0)  # the pass ends: its signal goes
        first = table.cells[stamp_cells(table, 0)[0]]
        await asyncio.sleep(0.002)  # a later pass, the time apart measurable
        held += [zero.acquire("b1"), one.acquire("b2")]
        await asyncio.sleep(0)
        assert table.cells[stamp_cells(table, 0)[0]] == first  # not taken: kept
        later = table.cells[stamp_cells(table, 1)[0]]
        assert before * 1e6 - 1 <= first < later
        assert replicas.changed_at() == first / 1e6  # the oldest of both workers'
        assert replicas.changed_at() == 0.0  # taken: nothing new since
        held.pop().release()
        await asyncio.sleep(0)
        assert replicas.changed_at() * 1e6 >= later  # after the take, a new stamp
        for lease in held:
            lease.release()
    finally:
        zero.close()
        one.close()
        os.close(fd)
        os.close(table.fd)


async def test_a_change_signal_is_one_eventfd_write_per_pass() -> None:
    fd = ChangeSignal.open()
    table = router_table()
    tracker = worker(table, 0)
    try:
        tracker.on_change = ChangeSignal(fd, asyncio.get_running_loop())
        leases = [tracker.acquire("b0") for _ in range(5)]
        await asyncio.sleep(0)  # the pass after: the signal's write, once
        assert os.eventfd_read(fd) == 1
        for lease in leases:
            lease.release()
        await asyncio.sleep(0)
        assert os.eventfd_read(fd) == 1
        tracker.on_change = None  # off: no write
        tracker.acquire("b0").release()
        await asyncio.sleep(0)
        assert not ChangeSignal.take(fd)
    finally:
        tracker.close()
        os.close(fd)
        os.close(table.fd)
