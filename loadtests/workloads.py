"""Benchmark workloads: seeded request streams with shared prompt prefixes, and their fleet.

Contract
--------
- ``build(name, seed=, duration=, rate=)`` returns the requests of workload
  ``name`` (one of ``NAMES``) sent in ``[0, duration)`` seconds, sorted by
  arrival time, with ``rate`` requests/s on average. The same arguments give
  the same requests in any process (``random.Random`` seeded with a string;
  no hash randomisation, no clock, no download); another seed gives others.
- Text is synthetic: pseudo-words from a fixed vocabulary. The simulator's
  tokenizer is 4 UTF-8 bytes a token and the text is ASCII, so "N tokens"
  below means 4N characters, exactly as the simulated instances count them.
- A ``Request`` is sent in OpenAI chat form (``chat_body``) or native form
  (``native_body`` + ``native_headers``, as SageMaker's ``/invocations``).
  Both put the shared part first: in chat form the router's extracted text
  starts with the tools and the system message; in native form ``inputs`` is
  the first field and holds the prompt as the simulator's chat template
  renders it (``prompt_text``), so both forms give the instance the same
  tokens and the router a key made of the shared part.
- Messages, tools and their dicts are shared between requests (a
  conversation's turns share their history): treat them as read-only.
- ``FLEET[name]`` is the simulated fleet (7 instances) and the arrival rate
  each workload was calibrated for; ``FleetParams.sim_args()`` gives the
  matching ``python -m loadtests.simserver`` flags.

Workloads
---------
``long`` (AWS's "long"): 1,000 documents of 7,600-8,400 tokens (~32 KB each),
each the system message after a short shared instruction, then a ~50-token
question; documents are drawn with Zipf popularity (s = 0.55: the top one
~2 % of requests, half of them below 0.07 %); Poisson arrivals; 128 output
tokens.

``short`` (AWS's "short", ShareGPT-like): conversations whose every turn
sends the whole history so far, after a 150-token system prompt shared by all
of them. Shapes follow published ShareGPT statistics, approximately:
turns per conversation geometric with mean 3.5 (ShareGPT: 330,239 turns in
94,145 conversations, 3.51 a conversation; Yan et al. 2025, "ShareChat",
arXiv:2512.17843, Table 1); user messages log-normal with mean 161 tokens and
replies log-normal with mean 338 tokens (ShareGPT's mean input and output
lengths in the vLLM paper, Kwon et al., SOSP 2023, Fig. 11, which is what
vLLM's ``benchmark_serving`` ShareGPT sampler draws: first human turn, first
reply), both with sigma 1 (medians ~60 % of the means, long right tails),
replies capped at 1,024 tokens (the simulator's ``max_tokens`` cap). The
reply length is the turn's ``max_tokens``, and as many tokens of synthetic
text stand for the reply in the next turn's history. The next turn comes after
the reply has streamed (``max_tokens`` x 25 ms) and an exponential think time
of mean 30 s. Conversations start as a Poisson process from 15 minutes before
0, so the window opens on a steady state (turns before 0 are not sent).

``sysprompt``: one 3,000-token support instruction for every request, then a
~50-token question: a single routing key, the hot-spot case.

``tenants``: the same 3,000-token instruction used by 48 tenants (Zipf s = 1
over tenants), each request carrying its tenant's key (``prompt_cache_key``,
or the ``X-Amzn-SageMaker-Prefix-Aware-Id`` header in native form): the
router hashes each tenant apart, the instances share the KV.

``hotdocs``: few hot documents on instances that run few sequences at once
(issue 12's independent-simulator case): 10 documents of 7,600-8,400 tokens
with Zipf popularity s = 1.1 (the top one ~37 % of requests, 2.6 instances'
shares on 7; the second ~17 %), then a ~50-token question, as ``long``; its
fleet runs 4 sequences at once an instance (``max_num_seqs``), so a hot
document's home fills long before the default ConcurrencyThreshold of 10.

``hotslots``: the same shape on real engines' scale (issue 12's llama.cpp
case): 9 documents of ~1,200 tokens (1,100-1,300), Zipf s = 1.1, a ~30-token
question, 3 instances of one sequence at a time whose cache holds about one
prompt (llama.cpp's single-slot prompt cache, approximately), 64 output
tokens.

``agent``: a catalogue of 28 tools (~6,500 tokens of JSON schema) and a
1,000-token instruction, then a task; a task runs 1-12 steps (geometric, mean
4), each adding the assistant's tool call and a tool result (log-normal, mean
1,000 tokens) to the history; 128 output tokens a step; the next step follows
the previous one's output by an exponential tool latency of mean 1 s.

Calibration (``FLEET``)
-----------------------
One fleet serves every workload: the simulator's 70B timing (10,000 prefill
tokens/s, 20 ms a request, 25 ms an output token, see
``simserver.model.Timing``), 16-token blocks, and 75,000 blocks (1.2 M
tokens) of KV an instance, what 8 x H100 hold for Llama-3.1-70B (see
``simserver.app.SimConfig``). Workloads differ in their rate only. Figures
from ``python -m loadtests.offline --workload W --duration 3600`` (7
instances, seed 1); "busy" is the share of time an instance spends in
prefill, the model's serialised resource.

``long``, 7 requests/s: RANDOM sends every document everywhere; an instance
holds ~150 of the 1,000 and keeps the recently used ones, so its hit rate is
26 % (AWS: ~25 %) and it is busy 62 % of the time (cold 8,000-token prefills
take 0.8 s), where queueing shows but does not run away. PREFIX_AWARE gives an
instance ~143 documents: they fit, and its misses are mostly each document's
first request (25,000 requests over 1,000 documents). The regime matches the
AWS table: a baseline hit rate set by cache pressure, one set by cold misses.
Fewer documents or a steeper Zipf raise RANDOM's hit rate (popular documents
stay resident everywhere); at 10 requests/s RANDOM is 87 % busy and its P50
TTFT 2.6 s.

``short``, 30 requests/s (~9 conversations start each second): prompts
average ~1,500 tokens; RANDOM hits on the shared system prompt everywhere and
on a conversation's history one turn in seven: 32 % (AWS: ~30 %), busy 53 %.
The cache is not what limits here (the histories of the ~900 conversations alive
at a time fit in the fleet); the routing is. Two consequences for PREFIX_AWARE, both
measured in ``offline.py``'s notes: replies stream for ~8 s, so ~37 requests
are in flight per instance, above the default ConcurrencyThreshold of 10; and
the simulator caches no generated tokens, so a turn can hit at most on the
previous turn's prompt, not its reply (~73 % at best).

``sysprompt``, ``tenants``, 20 requests/s: the 3,000-token instruction is
computed once per instance and stays cached whatever the routing (RANDOM:
~98 % hits); cached prefills are ~30 ms, so instances are only ~8 % busy in
prefill. The rate was set by streams instead: ~9 in flight per instance, near
the default ConcurrencyThreshold, so that the threshold's overflow shows.
These two are about spreading one key, not about hits.

``hotdocs``, 3 requests/s, 4 sequences and 2,560 blocks (40,960 tokens: four
contexts of 10,240) an instance: an instance holds ~4 of the 10 documents, so
RANDOM hits on the popular ones only (71 %); a request holds its slot for its
128 output tokens (3.2 s), so 7 instances serve ~8.7 requests/s at most and
RANDOM fills ~35 % of the slots. The top document alone (~1.1 requests/s) is
~90 % of what one instance serves (~1.25/s): on its home, with the hash's
other documents, it queues. Offline, one model hour: the default
(IN_FLIGHT, ConcurrencyThreshold 10) puts 39 % of requests on one instance
and its P90 TTFT is 3.7 s against RANDOM's 0.84 s.

``hotslots``, 0.6 requests/s on 3 instances (``FleetParams.instances`` 3,
``offline``'s default for it), one sequence and 96 blocks (1,536 tokens, one
prompt) an instance, a small model's timing (1,000 prefill tokens/s, 10 ms a
request, 20 ms an output token): a request holds the slot ~2.5 s cold, ~1.3 s
warm; 300 s of arrivals is ~180 requests, the issue's run. Offline, every
prefix-aware setting puts 53-57 % of them on one instance, as the issue's
real engines did (49-56 %).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from .simserver.wire import render_chat

__all__ = [
    "FLEET",
    "MODEL",
    "NAMES",
    "TENANT_HEADER",
    "FleetParams",
    "Request",
    "build",
    "encode",
]

MODEL = "sim-llama-3.1-70b"  # the simulator's default served model name
TENANT_HEADER = "X-Amzn-SageMaker-Prefix-Aware-Id"


def encode(body: dict[str, Any]) -> bytes:
    """The bytes of a body as the benchmarks send them (compact JSON, field order kept).

    Native keys are raw bytes, so the offline and live benchmarks must encode
    bodies the same way to route them the same way.
    """
    return msgspec.json.encode(body)


@dataclass(frozen=True, slots=True)
class Request:
    at: float  # arrival, seconds from the start (Poisson process)
    group: str  # shared-prefix id: "doc-3", "conv-17", "sys", "tenant-5", "task-4"
    messages: tuple[dict[str, Any], ...]  # OpenAI chat messages
    tools: tuple[dict[str, Any], ...] | None = None
    tenant: str | None = None  # prompt_cache_key (OpenAI) / tenant header (native)
    max_tokens: int = 64

    def chat_body(self, *, stream: bool = True, model: str = MODEL) -> dict[str, Any]:
        """``POST /v1/chat/completions`` body."""
        body: dict[str, Any] = {"model": model, "messages": list(self.messages)}
        if self.tools is not None:
            body["tools"] = list(self.tools)
        body["max_tokens"] = self.max_tokens
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.tenant:
            body["prompt_cache_key"] = self.tenant
        return body

    def prompt_text(self) -> str:
        """The prompt as the simulator renders this chat: template, tools, messages."""
        return render_chat(list(self.messages), list(self.tools) if self.tools else None)

    def native_body(self, *, stream: bool = True) -> dict[str, Any]:
        """``POST /invocations`` body; ``inputs`` first, so the key is the shared part."""
        return {
            "inputs": self.prompt_text(),
            "parameters": {"max_new_tokens": self.max_tokens},
            "stream": stream,
        }

    def native_headers(self) -> dict[str, str]:
        return {TENANT_HEADER: self.tenant} if self.tenant else {}


# ---------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class FleetParams:
    """A simulated fleet and the load a workload was calibrated for (module docstring)."""

    capacity_blocks: int  # KV cache per instance, in blocks
    default_rate: float  # requests/s offered to ``instances`` instances
    default_max_tokens: int = 128  # output tokens a request (``short``: the cap of a reply)
    block_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    request_overhead_s: float = 0.020
    decode_s_per_token: float = 0.025
    max_num_seqs: int = 256
    instances: int = 7

    def timing_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``simserver.model.Timing`` (add ``time_scale`` live)."""
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "request_overhead_s": self.request_overhead_s,
            "decode_s_per_token": self.decode_s_per_token,
            "max_num_seqs": self.max_num_seqs,
        }

    def rate_for(self, instances: int) -> float:
        """The same load per instance on another fleet size."""
        return self.default_rate * instances / self.instances

    def sim_args(self) -> list[str]:
        """``python -m loadtests.simserver`` flags for this fleet (add --count, --time-scale)."""
        return [
            f"--prefill-tokens-per-s={self.prefill_tokens_per_s:g}",
            f"--overhead-ms={self.request_overhead_s * 1000:g}",
            f"--decode-ms={self.decode_s_per_token * 1000:g}",
            f"--max-num-seqs={self.max_num_seqs}",
            f"--block-size={self.block_size}",
            f"--capacity-blocks={self.capacity_blocks}",
            f"--default-max-tokens={self.default_max_tokens}",
        ]


# One fleet for every workload: 75,000 blocks x 16 = 1.2 M tokens of KV an
# instance, what 8 x H100 hold for Llama-3.1-70B (see ``simserver.app.SimConfig``).
CAPACITY_BLOCKS = 75_000

FLEET: dict[str, FleetParams] = {
    "long": FleetParams(CAPACITY_BLOCKS, default_rate=7.0),
    "short": FleetParams(CAPACITY_BLOCKS, default_rate=30.0, default_max_tokens=1024),
    "sysprompt": FleetParams(CAPACITY_BLOCKS, default_rate=20.0),
    "tenants": FleetParams(CAPACITY_BLOCKS, default_rate=20.0),
    "agent": FleetParams(CAPACITY_BLOCKS, default_rate=18.0),
    "hotdocs": FleetParams(2_560, default_rate=3.0, max_num_seqs=4),
    "hotslots": FleetParams(
        96,
        default_rate=0.6,
        default_max_tokens=64,
        prefill_tokens_per_s=1_000.0,
        request_overhead_s=0.010,
        decode_s_per_token=0.020,
        max_num_seqs=1,
        instances=3,
    ),
}

# ---------------------------------------------------------------- shapes

LONG_DOCUMENTS = 1_000
LONG_ZIPF = 0.55
LONG_DOC_TOKENS = (7_600, 8_400)
QUESTION_TOKENS = 50

SHORT_SYSTEM_TOKENS = 150
SHORT_MEAN_TURNS = 3.51
SHORT_MAX_TURNS = 30
SHORT_USER_MEAN = 161
SHORT_REPLY_MEAN = 338
SHORT_SIGMA = 1.0
SHORT_THINK_MEAN_S = 30.0
WARMUP_S = 900.0  # conversations and tasks start this long before 0: a steady state at 0

SYSPROMPT_TOKENS = 3_000
TENANTS = 48
TENANT_ZIPF = 1.0

HOTDOCS_DOCUMENTS = 10
HOTDOCS_ZIPF = 1.1
HOTSLOTS_DOCUMENTS = 9
HOTSLOTS_DOC_TOKENS = (1_100, 1_300)
HOTSLOTS_QUESTION_TOKENS = 30

AGENT_TOOLS = 28
AGENT_INSTRUCTION_TOKENS = 1_000
AGENT_MEAN_STEPS = 4.0
AGENT_MAX_STEPS = 12
AGENT_RESULT_MEAN = 1_000
AGENT_TOOL_LATENCY_MEAN_S = 1.0

# The reply of the previous turn has streamed by the time the user answers.
_DECODE_S = FLEET["short"].decode_s_per_token

# ---------------------------------------------------------------- text


def _vocabulary() -> tuple[str, ...]:
    # Fixed, whatever the seed: 4,096 pseudo-words of one to four syllables.
    rng = random.Random("prefix-router vocabulary")
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"] + ["an", "el", "or", "is"]
    words: set[str] = set()
    while len(words) < 4096:
        words.add("".join(rng.choices(syllables, k=rng.choice((1, 2, 2, 3, 3, 4)))))
    return tuple(sorted(words))


_VOCABULARY = _vocabulary()


class _Text:
    """Seeded synthetic prose; ``tokens`` always means 4 ASCII characters a token."""

    def __init__(self, rng: random.Random, pool_chars: int = 1 << 21) -> None:
        self.rng = rng
        self._pool = self.prose_chars(pool_chars)
        self._starts: set[int] = set()

    def prose_chars(self, chars: int) -> str:
        """Fresh sentences, exactly ``chars`` characters long."""
        rng = self.rng
        words = rng.choices(_VOCABULARY, k=chars // 5 + 16)
        sentences: list[str] = []
        size = i = 0
        while size < chars:
            k = rng.randint(6, 18)
            sentence = " ".join(words[i : i + k]).capitalize() + "."
            sentences.append(sentence)
            size += len(sentence) + 1
            i += k
            if i >= len(words):
                words = rng.choices(_VOCABULARY, k=chars // 5 + 16)
                i = 0
        return " ".join(sentences)[: chars - 1] + "."

    def prose(self, tokens: int) -> str:
        return self.prose_chars(4 * tokens)

    def excerpt(self, tokens: int, *, fresh_start: bool = False) -> str:
        """``tokens`` tokens of text cut from the pool at a random word.

        Cheap, for the bulk of conversations; ``fresh_start`` guarantees that no
        other fresh excerpt of this generator starts at the same place, so the
        texts that open a conversation never share a prefix by accident.
        """
        pool = self._pool
        chars = 4 * tokens
        while True:
            start = pool.find(" ", self.rng.randrange(len(pool) - chars - 64)) + 1
            if not fresh_start or start not in self._starts:
                break
        if fresh_start:
            self._starts.add(start)
        return pool[start : start + chars]

    def question(self, serial: int, tokens: int = QUESTION_TOKENS) -> str:
        head = f"Question {serial}: "
        return head + self.prose_chars(4 * tokens - len(head) - 1)[:-1] + "?"


def _lognormal(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def _geometric(rng: random.Random, mean: float, cap: int) -> int:
    """1, 2, ... with P(n) = p (1-p)^(n-1), p = 1/mean, cut at ``cap``."""
    p = 1 / mean
    n = 1
    while n < cap and rng.random() >= p:
        n += 1
    return n


def _capped_geometric_mean(mean: float, cap: int) -> float:
    q = 1 - 1 / mean
    return (1 - q**cap) / (1 - q)


def _arrivals(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    times: list[float] = []
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return times
        times.append(t)


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    cumulative = list(itertools.accumulate(1 / (k + 1) ** s for k in range(n)))
    total = cumulative[-1]

    def pick() -> int:
        return min(bisect.bisect_right(cumulative, rng.random() * total), n - 1)

    return pick


# ---------------------------------------------------------------- workloads

_LONG_INSTRUCTION = (
    "You are a careful analyst. Answer the user's question using only the document "
    "below. Quote the passage you rely on, and say so when the document does not "
    "contain the answer."
)


def _long(rng: random.Random, duration: float, rate: float) -> list[Request]:
    return _documents(rng, duration, rate, "long", LONG_DOCUMENTS, LONG_ZIPF, LONG_DOC_TOKENS)


def _hotdocs(rng: random.Random, duration: float, rate: float) -> list[Request]:
    return _documents(
        rng, duration, rate, "hotdocs", HOTDOCS_DOCUMENTS, HOTDOCS_ZIPF, LONG_DOC_TOKENS
    )


def _hotslots(rng: random.Random, duration: float, rate: float) -> list[Request]:
    return _documents(
        rng,
        duration,
        rate,
        "hotslots",
        HOTSLOTS_DOCUMENTS,
        HOTDOCS_ZIPF,
        HOTSLOTS_DOC_TOKENS,
        question_tokens=HOTSLOTS_QUESTION_TOKENS,
    )


def _documents(
    rng: random.Random,
    duration: float,
    rate: float,
    name: str,
    documents: int,
    zipf: float,
    doc_tokens: tuple[int, int],
    *,
    question_tokens: int = QUESTION_TOKENS,
) -> list[Request]:
    """Documents of ``doc_tokens`` tokens with Zipf popularity, a question each."""
    text = _Text(rng)
    low, high = doc_tokens
    systems = []
    for i in range(documents):
        # Cut from the shared pool: documents overlap in wording at other offsets,
        # which neither a prefix cache nor a prefix key can see.
        body = text.excerpt(rng.randint(low, high), fresh_start=True)
        content = f'{_LONG_INSTRUCTION}\n\n<document id="doc-{i}">\n{body}\n</document>'
        systems.append({"role": "system", "content": content})
    pick = _zipf_picker(rng, documents, zipf)
    max_tokens = FLEET[name].default_max_tokens
    out = []
    for serial, at in enumerate(_arrivals(rng, rate, 0.0, duration)):
        doc = pick()
        question = {"role": "user", "content": text.question(serial, question_tokens)}
        out.append(Request(at, f"doc-{doc}", (systems[doc], question), max_tokens=max_tokens))
    return out


_SHORT_SYSTEM_HEAD = (
    "You are a helpful, honest assistant. Answer clearly and concisely, use markdown "
    "for code, and ask a clarifying question when the request is ambiguous. "
)


def _short(rng: random.Random, duration: float, rate: float) -> list[Request]:
    text = _Text(rng)
    system_text = _SHORT_SYSTEM_HEAD + text.prose_chars(
        4 * SHORT_SYSTEM_TOKENS - len(_SHORT_SYSTEM_HEAD)
    )
    system = {"role": "system", "content": system_text}
    cap = FLEET["short"].default_max_tokens
    starts = rate / _capped_geometric_mean(SHORT_MEAN_TURNS, SHORT_MAX_TURNS)
    out = []
    for conv, start in enumerate(_arrivals(rng, starts, -WARMUP_S, duration)):
        history: tuple[dict[str, Any], ...] = (system,)
        at = start
        for turn in range(_geometric(rng, SHORT_MEAN_TURNS, SHORT_MAX_TURNS)):
            user_tokens = _lognormal(rng, SHORT_USER_MEAN, SHORT_SIGMA, 4, 4096)
            reply_tokens = _lognormal(rng, SHORT_REPLY_MEAN, SHORT_SIGMA, 8, cap)
            user = {"role": "user", "content": text.excerpt(user_tokens, fresh_start=turn == 0)}
            history = (*history, user)
            if at >= duration:
                break
            if at >= 0:
                out.append(Request(at, f"conv-{conv}", history, max_tokens=reply_tokens))
            history = (*history, {"role": "assistant", "content": text.excerpt(reply_tokens)})
            at += reply_tokens * _DECODE_S + rng.expovariate(1 / SHORT_THINK_MEAN_S)
    out.sort(key=lambda r: r.at)
    return out


def _support_instruction(text: _Text) -> str:
    head = (
        "You are the support assistant of Kalorin Systems. Follow the policies below "
        "exactly; never invent order numbers, prices or dates.\n\n"
    )
    return head + text.prose_chars(4 * SYSPROMPT_TOKENS - len(head))


def _sysprompt(rng: random.Random, duration: float, rate: float) -> list[Request]:
    text = _Text(rng, pool_chars=1)
    system = {"role": "system", "content": _support_instruction(text)}
    max_tokens = FLEET["sysprompt"].default_max_tokens
    return [
        Request(at, "sys", (system, {"role": "user", "content": text.question(serial)}),
                max_tokens=max_tokens)
        for serial, at in enumerate(_arrivals(rng, rate, 0.0, duration))
    ]  # fmt: skip


def _tenants(rng: random.Random, duration: float, rate: float) -> list[Request]:
    text = _Text(rng, pool_chars=1)
    system = {"role": "system", "content": _support_instruction(text)}
    pick = _zipf_picker(rng, TENANTS, TENANT_ZIPF)
    max_tokens = FLEET["tenants"].default_max_tokens
    out = []
    for serial, at in enumerate(_arrivals(rng, rate, 0.0, duration)):
        tenant = f"tenant-{pick()}"
        user = {"role": "user", "content": text.question(serial)}
        out.append(Request(at, tenant, (system, user), tenant=tenant, max_tokens=max_tokens))
    return out


def _tool_catalogue(text: _Text) -> tuple[dict[str, Any], ...]:
    rng = text.rng
    tools = []
    for i in range(AGENT_TOOLS):
        verb, noun = rng.choice(_VOCABULARY), rng.choice(_VOCABULARY)
        properties = {
            f"{rng.choice(_VOCABULARY)}_{k}": {
                "type": rng.choice(("string", "integer", "boolean", "number")),
                "description": text.prose(rng.randint(8, 20)),
            }
            for k in range(rng.randint(3, 7))
        }
        required = sorted(properties)[: rng.randint(1, len(properties))]
        function = {
            "name": f"{verb}_{noun}_{i}",
            "description": text.prose(rng.randint(40, 80)),
            "parameters": {"type": "object", "properties": properties, "required": required},
        }
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _agent(rng: random.Random, duration: float, rate: float) -> list[Request]:
    text = _Text(rng)
    tools = _tool_catalogue(text)
    head = "You are an operations agent. Call tools to complete the task, one step at a time.\n\n"
    system = {
        "role": "system",
        "content": head + text.prose_chars(4 * AGENT_INSTRUCTION_TOKENS - len(head)),
    }
    max_tokens = FLEET["agent"].default_max_tokens
    starts = rate / _capped_geometric_mean(AGENT_MEAN_STEPS, AGENT_MAX_STEPS)
    out = []
    for task, start in enumerate(_arrivals(rng, starts, -WARMUP_S, duration)):
        task_text = f"Task {task}: " + text.excerpt(rng.randint(40, 200), fresh_start=True)
        history: tuple[dict[str, Any], ...] = (system, {"role": "user", "content": task_text})
        at = start
        for step in range(_geometric(rng, AGENT_MEAN_STEPS, AGENT_MAX_STEPS)):
            if at >= duration:
                break
            if at >= 0:
                out.append(Request(at, f"task-{task}", history, tools, max_tokens=max_tokens))
            tool = tools[rng.randrange(len(tools))]["function"]["name"]
            call_id = f"call_{task}_{step}"
            arguments = json.dumps({"query": text.excerpt(rng.randint(5, 20))})
            call = {"id": call_id, "type": "function",
                    "function": {"name": tool, "arguments": arguments}}  # fmt: skip
            result = text.excerpt(_lognormal(rng, AGENT_RESULT_MEAN, 1.0, 16, 4096))
            history = (
                *history,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
            )
            at += max_tokens * _DECODE_S + rng.expovariate(1 / AGENT_TOOL_LATENCY_MEAN_S)
    out.sort(key=lambda r: r.at)
    return out


_BUILDERS: dict[str, Callable[[random.Random, float, float], list[Request]]] = {
    "long": _long,
    "short": _short,
    "sysprompt": _sysprompt,
    "tenants": _tenants,
    "agent": _agent,
    "hotdocs": _hotdocs,
    "hotslots": _hotslots,
}
NAMES: tuple[str, ...] = ("long", "short", "sysprompt", "tenants", "agent", "hotdocs", "hotslots")


def build(name: str, *, seed: int, duration: float, rate: float) -> list[Request]:
    """The requests of workload ``name`` in ``[0, duration)``, sorted by arrival."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")
    if not (duration > 0 and rate > 0):
        raise ValueError("duration and rate must be > 0")
    return _BUILDERS[name](random.Random(f"{name}:{seed}"), duration, rate)
