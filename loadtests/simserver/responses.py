"""The Responses API of the simulated instance: requests, shapes and the per-instance store. Pure.

Contract
--------
- ``/v1/responses`` as vLLM serves it with ``VLLM_ENABLE_RESPONSES_API_STORE=1``:
  the instance keeps each finished response (``store`` true, the default) in
  process memory, and only there.  A request with ``previous_response_id``
  continues that conversation (its messages, then its output as an
  assistant message, then the new input; the new ``instructions`` replace
  the old ones, as vLLM does); an id this instance does not hold is a 404
  with vLLM's error (``Response with id '...' not found.``, type
  ``invalid_request_error``, param ``response_id``, code 404).  So a
  follow-up that lands on another instance fails, as it does on vLLM.
- ``GET /v1/responses/{id}`` returns the stored response; ``DELETE``
  forgets it (OpenAI's ``response.deleted`` object; vLLM itself has no
  DELETE); ``POST .../cancel`` answers vLLM's 400 "Cannot cancel a
  synchronous response." (the simulator has no background mode).  Each
  answers the 404 above for an id it does not hold.
- Unlike vLLM's (unbounded), the store is bounded: the ``capacity`` most
  recently stored responses (``SimConfig.responses_stored``).
- Prompt: ``instructions`` as a system message, then the input items as chat
  messages (a string ``input`` is one user message; a part contributes its
  ``text`` when it has one), through the chat template of ``wire``.
- Shapes: vLLM's ``ResponsesResponse`` (``id`` first, ``resp_<instance>-<n>``),
  and its stream of named SSE events (``event: <type>``), the first being
  ``response.created`` with the whole response object, ``id`` first in it;
  no ``[DONE]``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .model import tokenize
from .wire import BadRequest, Ending, GenRequest, Limits, Reply, cache_salt, render_chat

__all__ = [
    "NotFound",
    "ResponseStore",
    "ResponsesReply",
    "Stored",
    "not_found_body",
    "parse_responses",
]

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class NotFound(Exception):
    """A response id this instance does not hold."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


def not_found_body(response_id: str) -> dict[str, Any]:
    """vLLM's error object for an unknown response id (``_make_not_found_error``)."""
    message = f"Response with id '{response_id}' not found."
    error = {"message": message, "type": "invalid_request_error", "param": "response_id"}
    return {"error": {**error, "code": 404}}


@dataclass(frozen=True, slots=True)
class Stored:
    messages: list[dict[str, Any]]  # the conversation before this response's output
    body: dict[str, Any]  # the response object, as GET returns it

    @property
    def output_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.body["output"]
            for part in item["content"]
            if part["type"] == "output_text"
        )


class ResponseStore:
    """One instance's stored responses: the ``capacity`` most recent, by id."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise NotFound(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        if self._items.pop(response_id, None) is None:
            raise NotFound(response_id)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    gen: GenRequest
    messages: list[dict[str, Any]]
    body: dict[str, Any]
    store: bool


def parse_responses(body: Any, limits: Limits, store: ResponseStore) -> ResponsesRequest:
    """A Responses request as a generation; ``NotFound`` for an unknown previous id."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequest("'previous_response_id' must be a string", "previous_response_id")
        stored = store.get(previous)
        earlier = stored.messages
        if earlier and earlier[0]["role"] == "system":
            earlier = earlier[1:]  # the new instructions replace the old ones
        messages += earlier
        messages.append({"role": "assistant", "content": stored.output_text})
    messages += _input_messages(body.get("input"))
    tokens = tokenize(render_chat(messages))
    max_tokens = body.get("max_output_tokens")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    elif type(max_tokens) is not int or max_tokens < 1:
        raise BadRequest("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
    max_tokens = min(max_tokens, limits.max_tokens_cap)
    total = len(tokens) + max_tokens
    if total > limits.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {total} tokens.",
            "input",
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise BadRequest("'store' must be a boolean", "store")
    salt = cache_salt(body)
    gen = GenRequest(tokens, max_tokens, bool(stream), include_usage=True, cache_salt=salt)
    return ResponsesRequest(gen, messages, body, keep)


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty array of items", "input")
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest("each input item must be an object", f"input[{i}]")
        role = item.get("role")
        if not isinstance(role, str):
            continue  # tool calls and their outputs: not part of this template
        content = item.get("content")
        if isinstance(content, list):
            texts = [p["text"] for p in content if isinstance(p, dict) and "text" in p]
            content = "\n".join(t for t in texts if isinstance(t, str))
        elif not isinstance(content, str):
            raise BadRequest("'content' must be a string or an array", f"input[{i}].content")
        messages.append({"role": role, "content": content})
    return messages


class ResponsesReply(Reply):
    """``/v1/responses``: a ``response`` object, or vLLM's named stream events."""

    sse_done = False

    def __init__(
        self, id_: str, model: str, request: ResponsesRequest, store: ResponseStore
    ) -> None:
        self.id = id_
        self.model = model
        self.request = request
        self.store = store
        self.ending: Ending | None = None
        self.created = int(time.time())
        self.sequence = 0
        self.item_id = f"msg_{id_.removeprefix('resp_')}"

    def response(
        self, status: str, text: str | None, usage_: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = self.request.body
        output = [] if text is None else [self._item("completed", [_part(text)])]
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True,
            "temperature": body.get("temperature", 1.0),
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": self.request.gen.max_tokens,
            "previous_response_id": body.get("previous_response_id"),
            "status": status,
            "usage": usage_,
            "user": None,
        }

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def whole(self, text: str, usage_: dict[str, Any]) -> dict[str, Any]:
        """The finished response; stored (``store``) as it is returned."""
        body = self.response("completed", text, _usage(usage_))
        if self.request.store:
            self.store.put(self.id, Stored(self.request.messages, body))
        return body

    def sse(self, event: dict[str, Any]) -> bytes:
        name: str = event["type"]
        return b"event: " + name.encode() + b"\n" + super().sse(event)

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {**fields, "sequence_number": self.sequence, "type": type_}
        self.sequence += 1
        return event

    def _part_event(self, type_: str, **fields: Any) -> dict[str, Any]:
        """An event about the one content part of the one output item."""
        return self._event(type_, content_index=0, item_id=self.item_id, output_index=0, **fields)

    def opening(self) -> list[dict[str, Any]]:
        started = self.response("in_progress", None, None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event(
                "response.output_item.added", item=self._item("in_progress", []), output_index=0
            ),
            self._part_event("response.content_part.added", part=_part("")),
        ]

    def token(self, index: int, piece: str, ending: Ending | None) -> dict[str, Any]:
        self.ending = ending or self.ending
        return self._part_event("response.output_text.delta", delta=piece, logprobs=[])

    def closing(self, usage_: dict[str, Any]) -> list[dict[str, Any]]:
        assert self.ending is not None  # the last token's
        text = self.ending[0]
        return [
            self._part_event("response.output_text.done", logprobs=[], text=text),
            self._part_event("response.content_part.done", part=_part(text)),
            self._event(
                "response.output_item.done",
                item=self._item("completed", [_part(text)]),
                output_index=0,
            ),
            self._event("response.completed", response=self.whole(text, usage_)),
        ]


def _part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def _usage(usage_: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses API's words."""
    return {
        "input_tokens": usage_["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage_["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage_["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage_["total_tokens"],
    }
