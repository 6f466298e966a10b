"""Responses API follow-ups: send them to the backend that holds the response's state.

Why: vLLM keeps ``/v1/responses`` state in process memory
(``VLLM_ENABLE_RESPONSES_API_STORE=1``), so a request naming a
``previous_response_id``, and ``GET``/``DELETE /v1/responses/{id}`` or
``POST /v1/responses/{id}/cancel``, only succeed on the instance that
produced that response; anywhere else they are a 404 ("Response with id ...
not found.").

Contract:
- ``ResponseIds`` remembers ``response id -> backend name`` for the
  ``capacity`` ids most recently learnt or followed (``limits.response_ids``,
  0: the feature is off).  Memory: ~180 bytes an id (the 37-character str key
  of a vLLM id and its LRU slot; the backend name is shared), ~18 MB at the
  default 100,000 (``python -m loadtests.bench_responses`` measures it).
- Learning reads only the first bytes of the 2xx answers to ``POST
  /v1/responses`` (``IdScanner``): the response object's ``id`` is the first
  ``"id"`` key of its JSON, and of the first SSE event (``response.created``,
  which carries the whole object) of a stream.  That holds for vLLM, SGLang
  and OpenAI (``id`` is the object's first field; output items, which have
  ids of their own, come after).  A body piece that holds the id is searched
  in place; only a window cut before the id is gathered, and never past
  ``WINDOW`` bytes.  A body compressed or shaped otherwise is not learnt
  (counted ``unread``).
- Routing (``Exchange``): an OpenAI request with ``previous_response_id`` (read
  by the same decode as the routing key, ``router.extract``) and any request
  on ``/v1/responses/{id}[/...]`` (``response_id_of``) go to the id's backend
  whatever the strategy, if it is known (``hits``) and available (not down,
  draining or gone); otherwise the strategy's usual rule applies, the prefix
  rule for a keyed request: ``misses`` (id unknown) and ``fallbacks`` (its
  backend cannot take it; the engine then most likely answers 404, since the
  state is gone with it).
- Sharing (several workers or replicas): with ``share()``, every id learnt
  here also goes to ``outbox``; ``publish`` hands it over and the other
  processes ``apply`` it (``router.worker`` sends it with the TRAFFIC
  placement records, on the same channel and replica rows).  ``on_learn``
  fires once per batch, so the worker can send new ids at the end of the
  loop iteration instead of waiting for its period.
- The race: a client can send a follow-up the moment it reads the answer,
  on another connection that another worker accepts, before the id got
  there: without a wait, 6 of 205 immediate follow-ups that reached the
  other worker missed (2 workers, a loaded 2-core machine).  So when ids are
  shared (``wait_s`` > 0, set by the worker: 20 ms), a request whose id is
  unknown waits for it (``wait``: the callback fires when ``apply`` brings
  the id) for at most ``wait_s``, then counts a miss and takes the
  strategy's rule (with it: 0 of 173 missed).  An id that never comes
  (unknown to the whole fleet, evicted) costs that wait, once.  Across
  replicas ids travel in the 100 ms rows: a follow-up sent through another
  replica within ~0.1-0.2 s of its answer still misses.
- Read in parts (``frozen``: a handover passing the table on, a worker
  starting): the table is read a part at a time, the caller's loop let go
  between parts, while it stays in use.  Meanwhile nothing moves in it: ids
  learnt, and ids used (the most recently used now), go to a side table that
  is looked up first, bounded by ``capacity`` itself (its oldest dropped: the
  table after the merge would not keep them either), and merged in when the
  last reader is closed (``FrozenIds.close``), the bound applied then.  A
  list of 10 million ids made at once held the loop 6-9 s.  ``newest_first``
  parts are for ``seed``: a worker that serves while they come adds each
  only where it has room, behind what it learnt meanwhile.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice

__all__ = ["WINDOW", "FrozenIds", "IdScanner", "Learnt", "ResponseIds", "response_id_of"]

# The most body bytes a scan reads for the id: the response object's first field.
WINDOW = 4096
MAX_ID_LENGTH = 256  # longer is not an id we keep (nor a vLLM one: resp_ + 32 hex)

_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,%d})"' % MAX_ID_LENGTH)
_JSON = re.compile(rb"\s*\{")
_PREFIX = b"/v1/responses/"

_COUNTS = ("hits", "misses", "fallbacks", "learnt", "unread")

# A learnt id as other processes get it: (id, backend name).
Learnt = tuple[str, str]


def response_id_of(path: bytes) -> str | None:
    """The id of ``/v1/responses/{id}`` or ``/v1/responses/{id}/...``, else None."""
    if not path.startswith(_PREFIX):
        return None
    rest = path[len(_PREFIX) :]
    response_id = rest.partition(b"/")[0]
    if not response_id or len(response_id) > MAX_ID_LENGTH:
        return None
    return response_id.decode("latin-1")


class ResponseIds:
    """id -> backend, least recently used first (see the module contract)."""

    __slots__ = (
        "_fresh",
        "_fresh_new",
        "_ids",
        "_readers",
        "_waiters",
        "capacity",
        "fallbacks",
        "hits",
        "learnt",
        "misses",
        "on_learn",
        "outbox",
        "tap",
        "unread",
        "wait_s",
    )

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()
        # While ``frozen``: what changed since, most recently used last (None: not frozen).
        self._fresh: OrderedDict[str, str] | None = None
        self._fresh_new = 0  # of those, ids not in ``_ids``
        self._readers = 0  # FrozenIds not closed yet
        self.hits = self.misses = self.fallbacks = self.learnt = self.unread = 0
        self.outbox: list[Learnt] | None = None  # None: not shared
        self.on_learn: Callable[[], None] | None = None
        # Every id learnt here or applied from elsewhere, as it comes (a handover's old
        # process forwards what it learns while it drains: router.handover).
        self.tap: Callable[[list[Learnt]], None] | None = None
        self.wait_s = 0.0  # how long an unknown id is waited for (shared ids only)
        # id -> the requests waiting for it, in arrival order: a dict, so that a
        # request that stops waiting (its client gone, its wait over) leaves in O(1);
        # a list was scanned, quadratic when many wait for one id (any unknown id
        # will do): 5,000 clients leaving newest first held the loop 0.71 s.
        self._waiters: dict[str, dict[Callable[[], None], None]] = {}

    def __len__(self) -> int:
        return len(self._ids) + self._fresh_new

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def share(self, on_learn: Callable[[], None] | None = None, wait_s: float = 0.0) -> None:
        """Keep what is learnt here for ``publish``; ``on_learn`` when an outbox fills;
        an unknown id may be waited for ``wait_s``."""
        self.outbox = []
        self.on_learn = on_learn
        self.wait_s = wait_s

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._trim()

    def _put(self, response_id: str, backend: str) -> None:
        fresh = self._fresh
        if fresh is not None:
            self._put_fresh(response_id, backend)
            return
        ids = self._ids
        ids[response_id] = backend
        ids.move_to_end(response_id)
        if len(ids) > self.capacity:
            self._trim()

    def _put_fresh(self, response_id: str, backend: str) -> None:
        fresh = self._fresh
        assert fresh is not None
        if response_id not in fresh and response_id not in self._ids:
            self._fresh_new += 1
        fresh[response_id] = backend
        fresh.move_to_end(response_id)
        while len(fresh) > self.capacity:  # its oldest would not outlive the merge
            dropped, _ = fresh.popitem(last=False)
            if dropped not in self._ids:
                self._fresh_new -= 1

    def _trim(self) -> None:
        if self._fresh is not None:
            return  # being read in parts: the bound is applied once they are done
        ids = self._ids
        while len(ids) > self.capacity:
            ids.popitem(last=False)

    def learn(self, response_id: str, backend: str) -> None:
        """A response this process saw ``backend`` produce."""
        self._put(response_id, backend)
        self.learnt += 1
        if self.tap is not None:
            self.tap([(response_id, backend)])
        outbox = self.outbox
        if outbox is not None:
            if not outbox and self.on_learn is not None:
                self.on_learn()
            outbox.append((response_id, backend))

    def backend_of(self, response_id: str) -> str | None:
        """The backend that holds ``response_id`` (now the most recently used), or None."""
        if self._fresh is not None:
            return self._frozen_use(response_id)
        ids = self._ids
        backend = ids.get(response_id)
        if backend is not None:
            ids.move_to_end(response_id)
        return backend

    def _frozen_use(self, response_id: str) -> str | None:
        fresh = self._fresh
        assert fresh is not None
        backend = fresh.get(response_id)
        if backend is not None:
            fresh.move_to_end(response_id)
            return backend
        backend = self._ids.get(response_id)
        if backend is not None:
            self._put_fresh(response_id, backend)  # the most recently used, once merged
        return backend

    def holder(self, response_id: str) -> str | None:
        """``backend_of`` without making the id the most recently used (a dry run)."""
        fresh = self._fresh
        if fresh is not None and response_id in fresh:
            return fresh[response_id]
        return self._ids.get(response_id)

    def wait(self, response_id: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``apply`` brings ``response_id`` (see ``unwait``)."""
        self._waiters.setdefault(response_id, {})[callback] = None

    def waiting(self, response_id: str) -> int:
        """How many requests wait for ``response_id``."""
        return len(self._waiters.get(response_id, ()))

    def unwait(self, response_id: str, callback: Callable[[], None]) -> None:
        waiters = self._waiters.get(response_id)
        # pop's default, False, says the callback was not waiting
        if waiters is not None and waiters.pop(callback, False) is None and not waiters:
            del self._waiters[response_id]

    def publish(self) -> list[Learnt]:
        """What was learnt here since the last call."""
        outbox = self.outbox
        if not outbox:
            return []
        self.outbox = []
        return outbox

    def apply(self, learnt: Iterable[Learnt]) -> None:
        """Ids other processes learnt, in the order they learnt them."""
        if not self.enabled:
            return
        if self.tap is not None:
            learnt = list(learnt)
            self.tap(learnt)
        waiters = self._waiters
        for response_id, backend in learnt:
            self._put(response_id, backend)
            if waiters and response_id in waiters:
                for callback in waiters.pop(response_id):
                    callback()

    def snapshot(self) -> list[Learnt]:
        """Every id held, least recently used first, at once (tests: the router reads
        the table in parts, ``frozen``)."""
        if self._fresh is not None:
            merged = OrderedDict(self._ids)
            for response_id, backend in self._fresh.items():
                merged[response_id] = backend
                merged.move_to_end(response_id)
            return list(merged.items())
        return list(self._ids.items())

    def frozen(self, size: int, *, newest_first: bool = False) -> FrozenIds:
        """Every id held, least recently used first (or ``newest_first``), in parts of
        ``size``, read while the table stays in use (see the module contract); ``close``
        the result.  Several may be open at once (a handover, a worker starting): the
        table moves again once the last is closed; one opened while another is open
        reads the table and then what changed since, as the merge will order them."""
        if self._fresh is None:
            self._fresh = OrderedDict()
        self._readers += 1
        return FrozenIds(self, size, newest_first)

    def _thaw(self) -> None:
        self._readers -= 1
        if self._readers:
            return
        fresh, self._fresh = self._fresh, None
        self._fresh_new = 0
        if fresh:
            ids = self._ids
            for response_id, backend in fresh.items():
                ids[response_id] = backend
                ids.move_to_end(response_id)
        self._trim()  # once: what came meanwhile, a resize

    def seed(self, learnt: Iterable[Learnt]) -> None:
        """Ids of the table as it was when this process started, newest first, given
        while it serves (``frozen(newest_first=True)``, a worker starting): each is
        added behind every id held, and only while there is room, so what this process
        learnt or was told meanwhile stays the more recent and is never evicted by
        them.  Waiters for an id are called as by ``apply``."""
        if not self.enabled:
            return
        ids, fresh, waiters = self._ids, self._fresh, self._waiters
        for response_id, backend in learnt:
            if len(self) >= self.capacity:
                return
            if response_id in ids or (fresh is not None and response_id in fresh):
                continue
            if fresh is None:
                ids[response_id] = backend
                ids.move_to_end(response_id, last=False)  # the oldest
            else:  # (itself read in parts meanwhile: merged as if learnt)
                self._put_fresh(response_id, backend)
            if waiters and response_id in waiters:
                for callback in waiters.pop(response_id):
                    callback()

    def add_counts(self, counts: dict[str, int]) -> None:
        """Add another process's ``counts()`` (a supervisor adding up its workers)."""
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + counts.get(name, 0))

    def counts(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "fallbacks": self.fallbacks,
            "learnt": self.learnt,
            "unread": self.unread,
        }


class FrozenIds:
    """``ResponseIds.frozen``: ``count`` lists of ids, each a step of the caller's."""

    def __init__(self, ids: ResponseIds, size: int, newest_first: bool = False):
        self._ids: ResponseIds | None = ids
        # Opened while another reader holds the table still: what changed since (the
        # side table, a copy: bounded by the capacity) comes after it, the most recent
        # last (or first).
        fresh = list(ids._fresh.items()) if ids._fresh else []
        self.count = -(-(len(ids._ids) + len(fresh)) // size)
        if newest_first:
            self._items = chain(reversed(fresh), reversed(ids._ids.items()))
        else:
            self._items = chain(ids._ids.items(), fresh)
        self._size = size

    def __iter__(self) -> Iterator[list[Learnt]]:
        while self._ids is not None:
            part = list(islice(self._items, self._size))
            if not part:
                return
            yield part

    def close(self) -> None:
        """The table moves again: what changed meanwhile is merged in (once)."""
        ids, self._ids = self._ids, None
        if ids is not None:
            ids._thaw()


class IdScanner:
    """Finds the response id in the first bytes of one response body, fed piece by piece.

    ``feed`` returns the id, ``""`` when it will not be found (window full, or
    the first SSE event ended without one), or None for "feed more".
    """

    __slots__ = ("_window",)

    def __init__(self) -> None:
        self._window: bytearray | None = None  # only when a piece ended before the id

    def feed(self, data: bytes) -> str | None:
        window = self._window
        if window is None:
            found = _scan(data, len(data) >= WINDOW)
            if found is None:
                self._window = bytearray(memoryview(data)[:WINDOW])
            return found
        window += memoryview(data)[: WINDOW - len(window)]
        return _scan(window, len(window) >= WINDOW)


def _scan(data: bytes | bytearray, full: bool) -> str | None:
    """Search the first ``WINDOW`` bytes in place (no slice: a slice is a copy)."""
    end = min(len(data), WINDOW)
    if _JSON.match(data, 0, end) is None:  # SSE: only the first event
        stop = data.find(b"\n\n", 0, end)
        if stop >= 0:
            end, full = stop, True
    match = _ID.search(data, 0, end)
    if match is not None:
        return match[1].decode("latin-1")
    return "" if full else None
