"""Benchmark workloads (loadtests/workloads.py): deterministic, shaped as documented, keyed right.

Pure: no I/O, no sockets. Routing keys are computed with the router's own
extraction (``router.extract``) and the simulator's own template and tokenizer,
so these tests pin what the benchmarks rely on: the shared part of a prompt is
what the router hashes, in both request forms.
"""

from __future__ import annotations

import functools
import itertools
import statistics
from collections import defaultdict

import pytest

from hashring import hash_key, tenant_seed
from loadtests import workloads
from loadtests.simserver.__main__ import parse_args as sim_parse_args
from loadtests.simserver.model import tokenize
from loadtests.simserver.wire import Limits, parse_chat, parse_native
from loadtests.workloads import FLEET, NAMES, TENANT_HEADER, Request, build, encode
from router.extract import decode_openai, prompt_key

PREFIX_LENGTH = 4096  # the router's default PrefixLength
ASSISTANT_OPENING = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@functools.cache
def sample(name: str, duration: float = 300.0) -> list[Request]:
    """Five minutes of ``name`` at its calibrated rate, seed 1 (built once per test run)."""
    return build(name, seed=1, duration=duration, rate=FLEET[name].default_rate)


def chat_key(request: Request) -> bytes:
    return prompt_key(decode_openai(encode(request.chat_body())), PREFIX_LENGTH)


def native_key(request: Request) -> bytes:
    return encode(request.native_body())[:PREFIX_LENGTH]


def by_group(requests: list[Request]) -> dict[str, list[Request]]:
    groups: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        groups[request.group].append(request)
    return groups


# ---------------------------------------------------------------- every workload


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_requests_other_seed_others(name: str) -> None:
    first = build(name, seed=7, duration=60, rate=5)
    assert first == build(name, seed=7, duration=60, rate=5)
    other = build(name, seed=8, duration=60, rate=5)
    assert [r.at for r in other] != [r.at for r in first]
    assert {r.messages[-1]["content"] for r in other}.isdisjoint(
        {r.messages[-1]["content"] for r in first}
    )


@pytest.mark.parametrize("name", NAMES)
def test_arrivals_are_sorted_in_the_window_at_the_rate(name: str) -> None:
    duration = max(300.0, 2000 / FLEET[name].default_rate)  # hotslots: 0.6/s
    requests = sample(name, duration)
    times = [r.at for r in requests]
    assert times == sorted(times)
    assert times[0] >= 0
    assert times[-1] < duration
    # Poisson (conversations: clusters of turns) over >= 2,000 arrivals: 10 % is > 4 sigma.
    assert len(requests) / duration == pytest.approx(FLEET[name].default_rate, rel=0.10)


@pytest.mark.parametrize("name", NAMES)
def test_both_forms_give_the_simulator_the_same_prompt(name: str) -> None:
    limits = Limits(max_tokens_cap=4096)
    for request in sample(name)[:20]:
        chat = parse_chat(request.chat_body(), limits)
        native = parse_native(request.native_body(), limits)
        assert chat.tokens == native.tokens == tokenize(request.prompt_text())
        assert chat.max_tokens == native.max_tokens == request.max_tokens
        assert chat.stream
        assert chat.include_usage
        assert native.stream


def test_bodies_follow_the_apis() -> None:
    request = sample("tenants")[0]
    body = request.chat_body(stream=False, model="m")
    assert body["model"] == "m"
    assert body["stream"] is False
    assert "stream_options" not in body
    assert body["prompt_cache_key"] == request.tenant
    assert body["max_tokens"] == request.max_tokens
    assert next(iter(request.native_body())) == "inputs"  # first: the key is its start
    assert request.native_body(stream=False)["stream"] is False
    assert request.native_headers() == {TENANT_HEADER: request.tenant}
    untenanted = sample("long")[0]
    assert "prompt_cache_key" not in untenanted.chat_body()
    assert not untenanted.native_headers()
    assert untenanted.chat_body()["stream_options"] == {"include_usage": True}


def test_unknown_workload_and_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", seed=1, duration=10, rate=1)
    with pytest.raises(ValueError, match="> 0"):
        build("long", seed=1, duration=0, rate=1)


@pytest.mark.parametrize("name", NAMES)
def test_fleet_flags_are_the_simulators(name: str) -> None:
    params = FLEET[name]
    args = sim_parse_args(params.sim_args())
    assert args.capacity_blocks == params.capacity_blocks
    assert args.prefill_tokens_per_s == params.prefill_tokens_per_s
    assert args.decode_ms == pytest.approx(params.decode_s_per_token * 1000)
    assert args.max_num_seqs == params.max_num_seqs
    assert args.overhead_ms == pytest.approx(params.request_overhead_s * 1000)
    assert params.rate_for(2 * params.instances) == pytest.approx(2 * params.default_rate)


# ---------------------------------------------------------------- long


def test_long_documents_are_about_8000_tokens_and_come_first_in_both_forms() -> None:
    groups = by_group(sample("long"))
    assert len(groups) > 100  # many documents, Zipf-popular
    for requests in list(groups.values())[:30]:
        system = requests[0].messages[0]
        assert system["role"] == "system"
        assert 7_600 <= len(tokenize(system["content"])) <= 8_500
        assert all(r.messages[0] is system for r in requests)
        assert len(tokenize(requests[0].messages[-1]["content"])) == pytest.approx(50, abs=2)
    keyed = [(group, requests) for group, requests in groups.items() if len(requests) >= 2]
    assert len(keyed) > 20
    for keys in (chat_key, native_key):
        per_group = {group: {keys(r) for r in requests} for group, requests in keyed}
        assert all(len(k) == 1 for k in per_group.values())  # the question is past the key
        assert len({next(iter(k)) for k in per_group.values()}) == len(keyed)  # docs differ


def test_long_popularity_is_skewed() -> None:
    counts = sorted((len(r) for r in by_group(sample("long")).values()), reverse=True)
    assert counts[0] > 5 * statistics.median(counts)


# ---------------------------------------------------------------- short


def test_short_histories_grow_turn_by_turn() -> None:
    groups = by_group(sample("short"))
    multi = [requests for requests in groups.values() if len(requests) >= 3]
    assert len(multi) > 50
    for requests in multi:
        for before, after in itertools.pairwise(requests):
            assert after.at > before.at
            assert after.messages[: len(before.messages)] == before.messages
            assert [m["role"] for m in after.messages[len(before.messages) :]] == [
                "assistant",
                "user",
            ]
            head = before.prompt_text().removesuffix(ASSISTANT_OPENING)
            assert after.prompt_text().startswith(head)
            assert len(tokenize(after.prompt_text())) > len(tokenize(before.prompt_text()))


def test_short_shares_only_its_system_prompt_across_conversations() -> None:
    requests = sample("short")
    systems = {id(r.messages[0]) for r in requests}
    assert len(systems) == 1
    system_tokens = len(tokenize(requests[0].messages[0]["content"]))
    assert system_tokens == pytest.approx(workloads.SHORT_SYSTEM_TOKENS, abs=2)
    # Conversations are told apart by the router: their first user message differs.
    firsts = {r.messages[1]["content"] for r in requests}
    assert len(firsts) == len(by_group(requests))


def test_short_lengths_resemble_sharegpt() -> None:
    """Turns ~3.5 a conversation, user ~161 and reply ~338 tokens on average (docstring)."""
    requests = build("short", seed=2, duration=1800, rate=30)
    firsts = [r for r in requests if len(r.messages) == 2]  # conversations begun in the window
    assert len(firsts) > 1000
    user = [len(tokenize(r.messages[-1]["content"])) for r in requests]
    replies = [r.max_tokens for r in requests]
    assert statistics.fmean(user) == pytest.approx(161, rel=0.15)
    assert statistics.median(user) < 0.8 * statistics.fmean(user)  # a long right tail
    assert statistics.fmean(replies) == pytest.approx(338, rel=0.15)
    assert max(replies) <= FLEET["short"].default_max_tokens
    groups = by_group(requests)
    began = [groups[r.group] for r in firsts if r.at < 600]  # long enough to finish
    assert statistics.fmean(len(g) for g in began) == pytest.approx(3.5, rel=0.15)


# ---------------------------------------------------------------- hotdocs, hotslots


@pytest.mark.parametrize(
    ("name", "documents", "tokens", "question"),
    [("hotdocs", 10, (7_600, 8_500), 50), ("hotslots", 9, (1_100, 1_350), 30)],
)
def test_few_hot_documents_on_instances_of_few_sequences(
    name: str, documents: int, tokens: tuple[int, int], question: int
) -> None:
    # Issue 12's shape: a few documents, Zipf 1.1, the top one a third of requests or more;
    # instances that run few sequences at once (the simulator's max_num_seqs).
    requests = sample(name, 2000 / FLEET[name].default_rate)
    groups = by_group(requests)
    assert len(groups) == documents
    counts = sorted((len(r) for r in groups.values()), reverse=True)
    assert 0.30 < counts[0] / len(requests) < 0.45  # Zipf 1.1: ~37 %
    assert counts[0] > 1.8 * counts[1]
    for group in groups.values():
        low, high = tokens
        assert low <= len(tokenize(group[0].messages[0]["content"])) <= high
        assert len({chat_key(r) for r in group}) == 1  # one key a document
        assert len(tokenize(group[0].messages[-1]["content"])) == pytest.approx(question, abs=2)
    assert len({chat_key(g[0]) for g in groups.values()}) == documents
    fleet = FLEET[name]
    assert (fleet.max_num_seqs, fleet.instances) == {"hotdocs": (4, 7), "hotslots": (1, 3)}[name]
    assert all(r.max_tokens == fleet.default_max_tokens for r in requests)


def test_hotdocs_is_long_with_fewer_hotter_documents() -> None:
    # Same generator as long (so long is unchanged by the refactor): same instruction
    # and document layout, other documents and popularity.
    hot, long = sample("hotdocs")[0], sample("long")[0]
    assert (
        hot.messages[0]["content"].split("\n\n")[0] == long.messages[0]["content"].split("\n\n")[0]
    )
    assert hot.messages[0]["content"] != long.messages[0]["content"]


# ---------------------------------------------------------------- sysprompt, tenants, agent


def test_sysprompt_is_one_key() -> None:
    requests = sample("sysprompt")[:200]
    assert {r.group for r in requests} == {"sys"}
    assert len(tokenize(requests[0].messages[0]["content"])) == pytest.approx(3000, abs=2)
    assert len({chat_key(r) for r in requests}) == 1
    assert len({native_key(r) for r in requests}) == 1


def test_tenants_share_the_instruction_and_carry_distinct_keys() -> None:
    requests = sample("tenants")
    assert len({r.messages[0]["content"] for r in requests}) == 1
    tenants = {r.tenant for r in requests}
    assert len(tenants) > 20
    assert None not in tenants
    assert all(r.group == r.tenant for r in requests)
    # Same prompt prefix, different tenant: different routing hashes, in both forms.
    one = {}
    for r in requests:
        one.setdefault(r.tenant, r)
    chat = {hash_key(chat_key(r), tenant_seed(r.tenant)) for r in one.values()}
    native = {
        hash_key(native_key(r), tenant_seed(r.native_headers()[TENANT_HEADER]))
        for r in one.values()
    }
    assert len(chat) == len(native) == len(one)
    assert len({chat_key(r) for r in one.values()}) == 1  # only the seed tells them apart


def test_agent_sends_its_tool_catalogue_first() -> None:
    requests = sample("agent")
    assert all(r.tools is not None and len(r.tools) == workloads.AGENT_TOOLS for r in requests)
    catalogue = requests[0].tools
    assert all(r.tools is catalogue for r in requests)
    body = requests[0].chat_body()
    assert body["tools"] == list(catalogue)
    assert chat_key(requests[0]).startswith(b"\x1etools\x1f[")
    assert requests[0].prompt_text().startswith("<|begin_of_text|><|start_header_id|>tools")
    assert len(tokenize(requests[0].prompt_text())) > 6_000
    # Tasks take several steps, each adding a tool call and its result.
    steps = by_group(requests)
    longest = max(steps.values(), key=len)
    assert len(longest) >= 3
    assert longest[-1].messages[-1]["role"] == "tool"
