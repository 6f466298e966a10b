"""``router.responses`` without I/O: the id scan over every split of real bodies, the LRU."""

from __future__ import annotations

import msgspec
import pytest

from loadtests.simserver.responses import ResponsesReply, ResponsesRequest, ResponseStore
from loadtests.simserver.wire import GenRequest, usage
from router.responses import WINDOW, IdScanner, ResponseIds, response_id_of

ID = "resp_0b9e1c3f6a2d4e5f8a7b6c5d4e3f2a1b"


def reply() -> ResponsesReply:
    request = ResponsesRequest(
        GenRequest(tokens=None, max_tokens=3, stream=True, include_usage=True),  # type: ignore[arg-type]
        messages=[],
        body={"input": "hi", "instructions": "x" * 5000},  # long: the id must come first
        store=False,
    )
    return ResponsesReply(ID, "m", request, ResponseStore(0))


def bodies() -> dict[str, bytes]:
    whole = msgspec.json.encode(reply().whole("a b c", usage(10, 3, 0)))
    stream = reply()
    token = stream.token(0, "a", ("a", usage(10, 1, 0)))
    events = [*stream.opening(), token, *stream.closing(usage(10, 1, 0))]
    sse = b"".join(stream.sse(event) for event in events)
    openai_order = b'data: {"type":"response.created","sequence_number":0,"response":'
    openai_order += b'{"id": "%s","object":"response","output":[{"id":"msg_1"}]}}\n\n' % ID.encode()
    return {"json": whole, "vllm sse": sse, "openai sse": openai_order}


def scan(pieces: list[bytes]) -> str | None:
    scanner = IdScanner()
    for piece in pieces:
        found = scanner.feed(piece)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("kind", ["json", "vllm sse", "openai sse"])
def test_the_id_is_found_wherever_the_body_is_split(kind: str) -> None:
    body = bodies()[kind]
    for cut in range(len(body) + 1):
        assert scan([body[:cut], body[cut:]]) == ID, cut
    assert scan([body[i : i + 1] for i in range(len(body))]) == ID


def test_the_scan_gives_up_at_the_window_or_the_end_of_the_first_event() -> None:
    padding = b'{"created_at": 1, "x": "' + b"y" * WINDOW
    assert scan([padding, b'", "id": "resp_late"}']) == ""
    assert scan([padding[:100], padding[100:]]) == ""
    first_event = b'event: error\ndata: {"error": {"message": "no"}}\n\n'
    assert scan([first_event + b'data: {"id": "resp_2"}\n\n']) == ""
    assert scan([b'{"object": "response", "id": "resp_', b'x"}']) == "resp_x"
    assert scan([b'{"id": "resp_', b"x"]) is None  # not yet


def test_ids_in_paths() -> None:
    assert response_id_of(b"/v1/responses/resp_1") == "resp_1"
    assert response_id_of(b"/v1/responses/resp_1/cancel") == "resp_1"
    assert response_id_of(b"/v1/responses/resp_1/input_items") == "resp_1"
    assert response_id_of(b"/v1/responses/") is None
    assert response_id_of(b"/v1/responses") is None
    assert response_id_of(b"/v1/responses/" + b"x" * 300) is None


def test_the_map_keeps_the_most_recently_used_and_counts() -> None:
    ids = ResponseIds(3)
    for i in range(3):
        ids.learn(f"r{i}", f"b{i}")
    assert ids.backend_of("r0") == "b0"  # now the most recent
    ids.learn("r3", "b3")  # r1 goes
    assert ids.backend_of("r1") is None
    assert [ids.backend_of(f"r{i}") for i in (0, 2, 3)] == ["b0", "b2", "b3"]
    ids.apply([("r4", "b4"), ("r5", "b5")])
    assert ids.snapshot() == [("r3", "b3"), ("r4", "b4"), ("r5", "b5")]
    ids.resize(1)
    assert ids.snapshot() == [("r5", "b5")]
    assert ids.counts()["learnt"] == 4


def test_shared_ids_are_published_once_and_announced_once_a_batch() -> None:
    announced: list[int] = []
    ids = ResponseIds(10)
    ids.share(lambda: announced.append(len(ids.outbox or [])))
    ids.learn("r0", "b0")
    ids.learn("r1", "b1")
    assert announced == [0]  # once, when the outbox was empty
    assert ids.publish() == [("r0", "b0"), ("r1", "b1")]
    assert ids.publish() == []
    ids.learn("r2", "b0")
    assert announced == [0, 0]
    off = ResponseIds(0)
    off.apply([("r0", "b0")])
    assert len(off) == 0


def test_a_waiter_is_called_once_when_its_id_is_applied_and_not_after_unwait() -> None:
    ids = ResponseIds(10)
    called: list[str] = []

    def first() -> None:
        called.append("first")

    def second() -> None:
        called.append("second")

    ids.wait("r0", first)
    ids.wait("r0", second)
    ids.unwait("r0", second)
    ids.apply([("r1", "b1"), ("r0", "b0")])
    ids.apply([("r0", "b0")])
    assert called == ["first"]
    ids.unwait("r0", first)  # gone already: nothing to do


def test_read_in_parts_the_table_stays_in_use_and_changes_land_after() -> None:
    """``frozen``: the parts are the table as it was, oldest first, whatever happens
    meanwhile; lookups, learning and use go on; at ``close`` the ids learnt and used
    meanwhile are the most recent, and the bound (resized meanwhile) holds again."""
    ids = ResponseIds(6)
    ids.apply([(f"r{i}", "a") for i in range(5)])
    frozen = ids.frozen(2)
    assert frozen.count == 3
    parts = iter(frozen)
    assert next(parts) == [("r0", "a"), ("r1", "a")]
    ids.learn("r5", "b")
    ids.apply([("r6", "c"), ("r2", "z")])  # a new backend for a frozen id: the new wins
    assert ids.backend_of("r0") == "a"  # used: the most recent once merged
    assert (ids.holder("r2"), ids.holder("r6"), ids.backend_of("nope")) == ("z", "c", None)
    ids.resize(4)
    assert len(ids) == 7  # the bound waits for the end
    # A second reader opened now (a worker starting): the table as it is now, what
    # changed since the first last; the table moves again once both are closed.
    second = ids.frozen(3)
    assert second.count == 3
    assert [*second] == [
        [("r0", "a"), ("r1", "a"), ("r2", "a")],
        [("r3", "a"), ("r4", "a"), ("r5", "b")],
        [("r6", "c"), ("r2", "z"), ("r0", "a")],
    ]
    assert [*parts] == [[("r2", "a"), ("r3", "a")], [("r4", "a")]]  # as it was
    frozen.close()
    frozen.close()  # once
    assert len(ids) == 7  # the second is still open
    second.close()
    assert ids.snapshot() == [("r5", "b"), ("r6", "c"), ("r2", "z"), ("r0", "a")]
    assert len(ids) == 4
    assert list(frozen) == []  # closed: nothing more
    ids.frozen(2).close()  # and it can be read in parts again


def test_seeded_ids_stay_behind_what_the_worker_learnt_and_fill_only_its_room() -> None:
    """A worker starting serves while the fleet's ids come, newest first: an id it was
    told meanwhile stays the most recent, and the oldest of the seed go where there is
    no room (before, a full seed pushed the newer ids out)."""
    supervisor = ResponseIds(4)
    supervisor.apply([(f"old{i}", "a") for i in range(4)])
    parts = supervisor.frozen(2, newest_first=True)
    worker = ResponseIds(4)
    worker.apply([("new", "b")])
    woken: list[str] = []
    worker.wait("old1", lambda: woken.append("old1"))
    for part in parts:
        worker.seed(part)
    parts.close()
    assert worker.snapshot() == [("old1", "a"), ("old2", "a"), ("old3", "a"), ("new", "b")]
    assert woken == ["old1"]


def test_the_side_table_is_bounded_while_the_table_is_read() -> None:
    ids = ResponseIds(3)
    ids.apply([(f"a{i}", "x") for i in range(3)])
    reader = ids.frozen(10)
    ids.apply([(f"b{i}", "y") for i in range(10)])
    assert len(ids) == 6  # the table's 3 and the side table's newest 3
    assert ids.holder("b6") is None  # dropped: the merge would not keep it either
    reader.close()
    assert ids.snapshot() == [("b7", "y"), ("b8", "y"), ("b9", "y")]
    assert len(ids) == 3
