"""Request parsing and response shapes of the simulated server's HTTP APIs. Pure.

Contract
--------
``parse_chat``, ``parse_completion`` and ``parse_native`` take a decoded JSON
body (any value) and return a ``GenRequest`` with the prompt's tokens, or raise
``BadRequest(message, param)``, which the app answers with a 400 and OpenAI's
error object. The ``Reply`` classes shape the output of one generation for each
API, as plain dicts ready to be JSON-encoded; they do no I/O and keep no time.

Prompt text
-----------
- Chat: a Llama-3-like chat template. ``<|begin_of_text|>``, then, if ``tools``
  is present, a ``tools`` turn holding them as canonical JSON (sorted keys, no
  spaces), then one turn per message with its role and its text, then the
  opening of the assistant turn. A message's text is its string content, or
  the ``text`` of its ``{"type": "text"}`` parts joined with newlines; other
  parts (images, audio) and fields (``tool_calls``, ``name``) are left out, as
  the router's extraction leaves them out. Content may be absent or null.
- Completions: ``prompt`` is a string, or a list of token ids used as the
  tokens directly. A list holding a single string or a single id list is that
  prompt; a batch of several prompts is a 400 (the simulator answers one
  choice per request).
- Native (``/invocations``): ``inputs`` or ``prompt``, a string.

``max_tokens`` (chat also ``max_completion_tokens``; native
``parameters.max_new_tokens`` or ``parameters.max_tokens``) must be an integer
>= 1; values above the cap are lowered to the cap; absent means the default.
Prompt plus output may not exceed ``max_model_len``, as in vLLM.

Tokenizer endpoints (vLLM's shapes; routers such as vllm-router's cache_aware
policy call them to key their prefix trees on the worker's own token ids)
----------------------------------------------------------------------------
- ``/tokenize``: ``{"prompt": str}`` (the completion form) or ``{"messages":
  [...], "tools"?, "add_generation_prompt"? = true, "continue_final_message"? =
  false}`` (the chat form) -> ``{"count", "max_model_len", "tokens",
  "token_strs"}``. The ids are exactly those the generation endpoints compute
  for the same prompt, so a router keyed on them sees what the cache sees.
  ``add_special_tokens`` is accepted and ignored: this tokenizer has none (the
  chat template writes its markers as text).
- ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": str}``, the inverse of
  ``model.tokenize`` (the zero padding of the last token is dropped).
- ``/v1/chat/completions/render`` and ``/v1/completions/render``: the request
  of the generation endpoint, validated the same way, answered without
  generating with vLLM's ``GenerateRequest`` (``token_ids``,
  ``sampling_params``, ...); the completions form answers a list of one, as
  vLLM answers one entry per prompt.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any

import msgspec

from .model import tokenize, tokens_from_ids

__all__ = [
    "BadRequest",
    "ChatReply",
    "GenRequest",
    "Limits",
    "NativeReply",
    "Reply",
    "TextReply",
    "cache_salt",
    "decode_json",
    "detokenize",
    "error_body",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_native",
    "parse_tokenize",
    "render_chat",
    "render_reply",
    "tokenize_reply",
    "usage",
]


class BadRequest(Exception):
    """A client error; ``param`` names the offending field, as OpenAI's errors do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-instance request limits (vLLM: ``--max-model-len``)."""

    default_max_tokens: int = 16
    max_tokens_cap: int = 1024
    max_model_len: int = 131_072  # Llama 3.1's context window

    def __post_init__(self) -> None:
        if min(self.default_max_tokens, self.max_tokens_cap, self.max_model_len) < 1:
            raise ValueError("max_tokens defaults, caps and max_model_len must be >= 1")


@dataclass(frozen=True, slots=True)
class GenRequest:
    tokens: array[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: bytes = b""  # vLLM's cache_salt, UTF-8; empty: none


# ---------------------------------------------------------------- parsing

_decoder = msgspec.json.Decoder()


def decode_json(raw: bytes) -> Any:
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None


def parse_chat(body: Any, limits: Limits) -> GenRequest:
    body = _object(body)
    text = render_chat(body.get("messages"), body.get("tools"))
    tokens = tokenize(text)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits)
    _check_length(len(tokens), max_tokens, limits, "messages")
    stream, include_usage = _stream(body)
    return GenRequest(tokens, max_tokens, stream, include_usage, cache_salt(body))


def parse_completion(body: Any, limits: Limits) -> GenRequest:
    body = _object(body)
    tokens = _completion_prompt(body.get("prompt"))
    max_tokens = _max_tokens(body, ("max_tokens",), limits)
    _check_length(len(tokens), max_tokens, limits, "prompt")
    stream, include_usage = _stream(body)
    return GenRequest(tokens, max_tokens, stream, include_usage, cache_salt(body))


def parse_native(body: Any, limits: Limits) -> GenRequest:
    body = _object(body)
    param = "prompt" if "prompt" in body and "inputs" not in body else "inputs"
    prompt = body.get(param)
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'inputs' (or 'prompt') must be a non-empty string", param)
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {}
    elif not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be an object", "parameters")
    tokens = tokenize(prompt)
    max_tokens = _max_tokens(parameters, ("max_new_tokens", "max_tokens"), limits)
    _check_length(len(tokens), max_tokens, limits, param)
    return GenRequest(tokens, max_tokens, _flag(body, "stream"), include_usage=True)


def cache_salt(body: dict[str, Any]) -> bytes:
    """vLLM's ``cache_salt``: absent or null, else a non-empty string (400 otherwise)."""
    salt = body.get("cache_salt")
    if salt is None:
        return b""
    if not isinstance(salt, str) or not salt:
        message = "Parameter 'cache_salt' must be a non-empty string if provided."
        raise BadRequest(message, "cache_salt")
    return salt.encode("utf-8", "surrogatepass")


def render_chat(
    messages: Any,
    tools: Any = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The chat template described in the module docstring; validates as it goes.

    ``add_generation_prompt`` and ``continue_final_message`` are the switches of
    vLLM's chat and tokenize requests: the first opens the assistant turn, the
    second leaves the final message's turn open (no ``<|eot_id|>``) so the model
    continues it. As in vLLM, both at once is an error.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of messages", "messages")
    if add_generation_prompt and continue_final_message:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    parts = ["<|begin_of_text|>"]
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array", "tools")
        canonical = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        parts.append(_turn("tools", canonical))
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest("'role' must be a non-empty string", f"messages[{i}].role")
        parts.append(_turn(role, _message_text(message.get("content"), i)))
    if continue_final_message:
        parts[-1] = parts[-1].removesuffix(_EOT)
    elif add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


_EOT = "<|eot_id|>"


def _turn(role: str, text: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}{_EOT}"


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    param = f"messages[{index}].content"
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or an array of content parts", param)
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRequest("each content part must be an object with a 'type'", param)
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest("a text part needs a string 'text'", param)
            texts.append(text)
    return "\n".join(texts)


def _completion_prompt(prompt: Any) -> array[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise BadRequest(
                f"batched prompts ({len(prompt)} prompts) are not supported; send one", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt:
        try:
            return tokens_from_ids(prompt)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt") from None
    raise BadRequest("'prompt' must be a non-empty string or array of token ids", "prompt")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def _max_tokens(fields: dict[str, Any], names: tuple[str, ...], limits: Limits) -> int:
    for name in names:
        value = fields.get(name)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise BadRequest(f"'{name}' must be an integer >= 1", name)
        return min(value, limits.max_tokens_cap)
    return min(limits.default_max_tokens, limits.max_tokens_cap)


def _check_length(prompt_tokens: int, max_tokens: int, limits: Limits, param: str) -> None:
    total = prompt_tokens + max_tokens
    if total > limits.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} in "
            "the completion).",
            param,
        )


def _flag(fields: dict[str, Any], name: str) -> bool:
    value = fields.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return value


def parse_tokenize(body: Any) -> tuple[array[int], bool]:
    """vLLM's ``/tokenize`` request: ``(tokens, return_token_strs)``."""
    body = _object(body)
    token_strs = _flag(body, "return_token_strs")
    _flag(body, "add_special_tokens")  # validated, no effect: see the module docstring
    if "messages" in body:
        # vLLM's TokenizeChatRequest defaults add_generation_prompt to true.
        add_prompt = body.get("add_generation_prompt") is None or _flag(
            body, "add_generation_prompt"
        )
        text = render_chat(
            body.get("messages"),
            body.get("tools"),
            add_generation_prompt=add_prompt,
            continue_final_message=_flag(body, "continue_final_message"),
        )
        return tokenize(text), token_strs
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' (a string) or 'messages' is required", "prompt")
    return tokenize(prompt), token_strs


def tokenize_reply(tokens: array[int], limits: Limits, token_strs: bool) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``."""
    strs = None
    if token_strs:
        strs = [_token_bytes(t).rstrip(b"\0").decode("utf-8", "replace") for t in tokens]
    return {
        "count": len(tokens),
        "max_model_len": limits.max_model_len,
        "tokens": tokens.tolist(),
        "token_strs": strs,
    }


def parse_detokenize(body: Any) -> array[int]:
    """vLLM's ``/detokenize`` request: its ``tokens``."""
    tokens = _object(body).get("tokens")
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be an array of token ids", "tokens")
    try:
        return tokens_from_ids(tokens)
    except ValueError as exc:
        raise BadRequest(str(exc), "tokens") from None


def detokenize(tokens: array[int]) -> str:
    """The text of ``tokens``: the inverse of ``model.tokenize``.

    Only the last token can carry the tokenizer's zero padding, so only trailing
    NULs are dropped; bytes that are not UTF-8 (ids no text produces) decode to
    U+FFFD.
    """
    raw = b"".join(_token_bytes(t) for t in tokens)
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _token_bytes(token: int) -> bytes:
    return token.to_bytes(4, "little")


def render_reply(
    request_id: str, model: str, gen: GenRequest, body: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest``: what ``/render`` answers for a generation request."""
    return {
        "request_id": request_id,
        "token_ids": gen.tokens.tolist(),
        "features": None,
        "sampling_params": {"max_tokens": gen.max_tokens},
        "model": body.get("model") or model,
        "stream": gen.stream,
        "stream_options": body.get("stream_options") if gen.stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
    }


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return stream, _flag(options, "include_usage")


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


# The end of a generation, given to the event of the last token: (text, usage).
Ending = tuple[str, dict[str, Any]]


class Reply:
    """How one API shapes a generation: one whole body, or a stream of SSE events.

    A stream is ``opening()``, one ``token()`` per output token (the last one gets
    ``ending``), ``closing()``, then ``data: [DONE]`` if ``sse_done``; ``sse``
    writes each event.
    """

    sse_done = True

    def whole(self, text: str, usage_: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        return []

    def token(self, index: int, piece: str, ending: Ending | None) -> dict[str, Any]:
        raise NotImplementedError

    def closing(self, usage_: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def sse(self, event: dict[str, Any]) -> bytes:
        """One event on the wire."""
        return b"data: " + msgspec.json.encode(event) + b"\n\n"


class _OpenAIReply(Reply):
    object_ = ""
    chunk_object = ""

    def __init__(self, id_: str, created: int, model: str, include_usage: bool) -> None:
        self.id = id_
        self.created = created
        self.model = model
        self.include_usage = include_usage

    def _envelope(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object)
        chunk["choices"] = [choice]
        if self.include_usage:  # OpenAI sends "usage": null on every chunk but the last
            chunk["usage"] = None
        return chunk

    def closing(self, usage_: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        chunk = self._envelope(self.chunk_object)
        chunk["choices"] = []
        chunk["usage"] = usage_
        return [chunk]


class ChatReply(_OpenAIReply):
    """``/v1/chat/completions``: ``chat.completion`` / ``chat.completion.chunk``."""

    object_ = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def whole(self, text: str, usage_: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.object_)
        message = {"role": "assistant", "content": text}
        body["choices"] = [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        ]
        body["usage"] = usage_
        return body

    def opening(self) -> list[dict[str, Any]]:
        # vLLM and OpenAI open a chat stream with the role and empty content.
        delta = {"role": "assistant", "content": ""}
        return [self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]

    def token(self, index: int, piece: str, ending: Ending | None) -> dict[str, Any]:
        finish = "length" if ending is not None else None
        delta = {"content": piece}
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})


class TextReply(_OpenAIReply):
    """``/v1/completions``: ``text_completion`` bodies and chunks."""

    object_ = "text_completion"
    chunk_object = "text_completion"

    def whole(self, text: str, usage_: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.object_)
        body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]
        body["usage"] = usage_
        return body

    def token(self, index: int, piece: str, ending: Ending | None) -> dict[str, Any]:
        finish = "length" if ending is not None else None
        return self._chunk({"index": 0, "text": piece, "logprobs": None, "finish_reason": finish})


class NativeReply(Reply):
    """``/invocations``: ``{"generated_text", "usage"}``, or TGI-style token events.

    Like TGI, the stream has no ``[DONE]``: its last event carries
    ``generated_text`` (null before) and, here, ``usage``.
    """

    sse_done = False

    def whole(self, text: str, usage_: dict[str, Any]) -> dict[str, Any]:
        return {"generated_text": text, "usage": usage_}

    def token(self, index: int, piece: str, ending: Ending | None) -> dict[str, Any]:
        event: dict[str, Any] = {
            "index": index,
            "token": {"id": index, "text": piece, "special": False},
            "generated_text": None,
        }
        if ending is not None:
            event["generated_text"], event["usage"] = ending
        return event
