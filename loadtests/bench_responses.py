"""What following Responses API ids costs: per request, per response, per id held.

    python -m loadtests.bench_responses [--repeats 7] [--requests 2000] [--ids 100000]

Prints, each figure the median over --repeats runs (the machine is shared):
  learn     one /v1/responses answer: ``IdScanner`` over its first body piece
            (a vLLM JSON body of ~1.4 KiB, or the first SSE read of a stream:
            ``response.created`` and ``response.in_progress``) and
            ``ResponseIds.learn``
  route     one follow-up's routing decision (decode, key, hash, then the
            strategy's pick, or the id's lookup and ``Balancer.pin``), with
            the feature off and on, and their ratio
  memory    bytes per id held in a ``ResponseIds`` of --ids vLLM-shaped ids
            (``resp_`` + 32 hex digits), measured with tracemalloc
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tracemalloc
from functools import partial

from hashring import hash_key, tenant_seed
from loadtests.simserver.responses import ResponsesReply, ResponsesRequest, ResponseStore
from loadtests.simserver.wire import GenRequest, usage
from router.balancer import Balancer
from router.extract import decode_openai, prompt_key
from router.responses import IdScanner, ResponseIds

from .bench_decision import PREFIX_LENGTH, balancer
from .bench_hashring import median_ns_per_item

MEMBERS = 64


def vllm_id(rng: random.Random) -> str:
    return f"resp_{rng.getrandbits(128):032x}"


def answers(ids: list[str]) -> tuple[list[bytes], list[bytes]]:
    """The first body piece of a JSON answer and of a stream, per id."""
    request = ResponsesRequest(
        GenRequest(tokens=None, max_tokens=16, stream=False, include_usage=True),  # type: ignore[arg-type]
        messages=[],
        body={"input": "hi", "instructions": "You are a helpful assistant. " * 8},
        store=False,
    )
    whole, streams = [], []
    for response_id in ids:
        reply = ResponsesReply(response_id, "m", request, ResponseStore(0))
        text = " ".join(["token"] * 16)
        whole.append(json.dumps(reply.whole(text, usage(100, 16, 0))).encode())
        streams.append(b"".join(reply.sse(event) for event in reply.opening()[:2]))
    return whole, streams


def learn_all(pieces: list[bytes], ids: ResponseIds) -> None:
    for piece in pieces:
        found = IdScanner().feed(piece)
        assert found
        ids.learn(found, "instance-1")


def follow_ups(count: int, ids: list[str], rng: random.Random) -> list[bytes]:
    return [
        json.dumps(
            {
                "model": "m",
                "input": f"And what about clause {i % 97}? " + "context " * rng.randrange(20, 60),
                "previous_response_id": ids[i % len(ids)],
            }
        ).encode()
        for i in range(count)
    ]


def route_all(chooser: Balancer, responses: ResponseIds | None, bodies: list[bytes]) -> None:
    for body in bodies:
        request = decode_openai(body)
        key = prompt_key(request, PREFIX_LENGTH)
        key_hash = hash_key(key, tenant_seed(request.prompt_cache_key))
        choice = None
        if responses is not None and request.previous_response_id is not None:
            name = responses.backend_of(request.previous_response_id)
            if name is not None:
                choice = chooser.pin(name)
        if choice is None:
            choice = chooser.choose(key_hash)
        assert choice is not None
        choice.release()


def bytes_per_id(count: int, rng: random.Random) -> float:
    ids = [vllm_id(rng) for _ in range(count)]  # the strings arrive with the answers anyway
    names = [f"instance-{i}" for i in range(MEMBERS)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = ResponseIds(count)
    for i, response_id in enumerate(ids):
        held.learn(response_id, names[i % MEMBERS])
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    key_bytes = sum(sys.getsizeof(i) for i in ids)
    return (after - before + key_bytes) / count


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_responses", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--ids", type=int, default=100_000)
    args = parser.parse_args()
    rng = random.Random(1)
    n = args.requests
    ids = [vllm_id(rng) for _ in range(n)]
    whole, streams = answers(ids)
    print(
        f"# Responses API follow-ups: Python {sys.version.split()[0]}, {n} answers and "
        f"follow-ups, {MEMBERS} members, PREFIX_AWARE IN_FLIGHT, median of {args.repeats}"
    )
    print(f"JSON answer head {len(whole[0]):,} B, stream first read {len(streams[0]):,} B")
    for name, pieces in (("json", whole), ("sse", streams)):
        ns = median_ns_per_item(partial(learn_all, pieces, ResponseIds(n)), n, args.repeats)
        print(f"learn {name}: {ns:,.0f} ns per answer")
    chooser = balancer(MEMBERS, "IN_FLIGHT")
    known = ResponseIds(n)
    for i, response_id in enumerate(ids):
        known.learn(response_id, f"instance-{i % MEMBERS}")
    bodies = follow_ups(n, ids, rng)
    off = median_ns_per_item(partial(route_all, chooser, None, bodies), n, args.repeats)
    on = median_ns_per_item(partial(route_all, chooser, known, bodies), n, args.repeats)
    print(f"route follow-up: off {off:,.0f} ns, on {on:,.0f} ns, on/off {on / off:.3f}")
    print(f"memory: {bytes_per_id(args.ids, rng):,.0f} bytes per id ({args.ids:,} ids held)")


if __name__ == "__main__":
    main()
