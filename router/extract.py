"""Routing keys: what part of a request decides where it goes.

Contract (the README's "Routing key" section says the same for users):

- Native requests (any POST outside the OpenAI paths): the key is the first
  ``PrefixLength`` bytes of the raw body, exactly as sent.  The data plane
  hashes them in place; nothing here is involved.
- OpenAI requests: the body is decoded once into ``OpenAIRequest``, which
  declares only the fields routing reads, and ``prompt_text`` renders the
  text the model will see, in order, cut at ``PrefixLength`` characters:

    tools (if any)      RS "tools" US <canonical JSON of the tools list>
    each message        RS <role> US <text>
    Responses API       RS "instructions" US <instructions>, then each
                        ``input`` item as a message (a string ``input`` is a
                        user message)
    /v1/completions     <prompt>  (a string; for a batch, the first prompt)

  RS is U+001E and US is U+001F: control characters that natural text does
  not contain, so role, text and message boundaries cannot run together.  A
  message's text is its string content, or its content parts in order: a
  text part contributes its text, any other part GS (U+001D) and its type
  (so an image marks its place but its bytes do not enter the key).
  Canonical JSON is msgspec's compact encoding with keys sorted, so JSON
  whitespace and key order do not change OpenAI keys (they do change native
  keys: those are raw bytes).
- Token-id prompts (``/v1/completions`` with a list of ints) are keyed by
  their first ``PrefixLength // 4`` ids packed as unsigned 32-bit ints (a
  token is about four characters of text).
- The key is the UTF-8 encoding of the rendered text (lone surrogates pass
  through), so ``PrefixLength`` counts characters here and bytes on native
  requests, as in SageMaker.
- Errors: ``BadRequest`` with an OpenAI-style message naming what was wrong
  (invalid JSON or UTF-8, wrong types, nesting too deep).
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

__all__ = [
    "OPENAI_PATHS",
    "BadRequest",
    "OpenAIRequest",
    "decode_openai",
    "prompt_key",
    "prompt_text",
]

OPENAI_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/responses"})

RS, US, GS = "\x1e", "\x1f", "\x1d"
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


class BadRequest(ValueError):
    """A request body routing cannot read; ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContentPart(msgspec.Struct):
    type: str = ""
    text: str | None = None


class Message(msgspec.Struct):
    role: str = ""
    content: str | list[ContentPart] | None = None


class OpenAIRequest(msgspec.Struct):
    """The routing view of an OpenAI request; every other field is skipped unread."""

    messages: list[Message] | None = None
    prompt: str | list[int | str | list[int]] | None = None
    input: str | list[Message] | None = None
    instructions: str | None = None
    tools: list[msgspec.Raw] | None = None
    prompt_cache_key: str | None = None
    stream: bool | None = None


_decoder = msgspec.json.Decoder(OpenAIRequest)
_any_decoder = msgspec.json.Decoder()
_canonical = msgspec.json.Encoder(order="sorted")


def decode_openai(body: bytes | bytearray | memoryview) -> OpenAIRequest:
    """Decode the routing fields of an OpenAI body, or raise ``BadRequest``."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rpartition("at `$.")[2].rstrip("`") if "at `$." in message else None
        raise BadRequest(f"invalid request body: {message}", param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nesting too deep") from None


def prompt_text(request: OpenAIRequest, limit: int) -> str:
    """Render the prompt as the model will see it, cut at ``limit`` characters."""
    if request.prompt is not None and request.messages is None and request.input is None:
        prompt = request.prompt
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        return prompt[:limit]
    parts: list[str] = []
    size = 0
    if request.tools:
        # Each tool is re-encoded canonically; stop once past the limit.
        parts += (RS, "tools", US, "[")
        size = 8
        for index, tool in enumerate(request.tools):
            try:
                canonical = _canonical.encode(_any_decoder.decode(tool)).decode()
            except (msgspec.MsgspecError, RecursionError) as exc:
                # e.g. 1e400: valid JSON syntax, no float to hold it
                raise BadRequest(f"invalid tools[{index}]: {exc}", "tools") from None
            parts += ("," if index else "", canonical)
            size += len(canonical) + (1 if index else 0)
            if size >= limit:
                break
        else:
            parts.append("]")
            size += 1
    if size < limit and request.instructions is not None:
        parts += (RS, "instructions", US, request.instructions)
        size += 14 + len(request.instructions)
    messages = request.messages if request.messages is not None else request.input
    if isinstance(messages, str):
        messages = [Message("user", messages)]
    for message in messages or ():
        if size >= limit:
            break
        role, content = message.role, message.content
        if type(content) is str:  # the common case, in one step
            parts += (RS, role, US, content)
            size += 2 + len(role) + len(content)
            continue
        parts += (RS, role, US)
        size += 2 + len(role)
        if content:
            for part in content:
                text = part.text if part.type in TEXT_PARTS else None
                if text is None:
                    text = GS + part.type
                parts.append(text)
                size += len(text)
    text = "".join(parts)
    return text[:limit] if size > limit else text


def prompt_key(request: OpenAIRequest, limit: int) -> bytes:
    """The routing key bytes of an OpenAI request (see the module contract)."""
    prompt = request.prompt
    if (
        isinstance(prompt, list)
        and prompt
        and isinstance(prompt[0], int | list)
        and request.messages is None
        and request.input is None
    ):
        ids: list[Any] = prompt[0] if isinstance(prompt[0], list) else prompt
        try:
            return array("I", ids[: limit // 4]).tobytes()
        except (TypeError, OverflowError):
            raise BadRequest("prompt token ids must be non-negative integers", "prompt") from None
    return prompt_text(request, limit).encode("utf-8", "surrogatepass")
