"""The ladder's request bodies: workloads (a)-(d), the same bytes for every target.

Contract: ``build_requests(workload, keys)`` is deterministic (a fixed LCG
fills the prompts); every chat prompt is ``PREFIX`` characters, the key length
every target is asked to use; (c)'s body is 64 KiB.
"""

from __future__ import annotations

import json

WORKLOADS = {
    "a": "(a) OpenAI chat, 4 KiB prompt, non-streaming",
    "b": "(b) OpenAI chat, 4 KiB prompt, stream: true, 64 SSE chunks",
    "c": "(c) native /invocations, 64 KiB body",
    "d": "(d) idle SSE streams held open",
}


PREFIX = 4096  # the key length every target is asked to use (prefix-router's default)


def _prompt(key: int, size: int) -> str:
    words = ("cache", "prefix", "token", "router", "fleet", "engine", "batch", "decode")
    out = [f"Document {key}:"]
    n, i = len(out[0]), key
    while n < size:
        i = (i * 1103515245 + 12345) & 0x7FFFFFFF  # a fixed LCG: the same text every run
        word = words[i % len(words)] + str(i % 97)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:size]


def build_requests(workload: str, keys: int, events_marker: str = "") -> list[tuple[str, bytes]]:
    """(session id, body) per key: the bodies a workload cycles over."""
    out = []
    for k in range(keys):
        if workload == "c":
            filler = _prompt(k, 64 * 1024)
            head = b'{"parameters":{"max_new_tokens":16},"inputs":"'
            body = head + filler.encode()[: 64 * 1024 - len(head) - 2] + b'"}'
        else:
            message = {
                "model": "fast",
                "stream": workload in ("b", "d"),
                "max_tokens": 64,
                "messages": [
                    {"role": "system", "content": _prompt(k, PREFIX)},
                    {"role": "user", "content": f"Question about document {k}.{events_marker}"},
                ],
            }
            body = json.dumps(message, separators=(",", ":")).encode()
        out.append((f"s{k}", body))
    return out


def path_of(workload: str) -> str:
    return "/invocations" if workload == "c" else "/v1/chat/completions"


def raw_request(host: str, path: str, session: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        f"x-session-id: {session}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
