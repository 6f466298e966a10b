"""Routing keys: what part of a request decides where it goes.

Contract (the README's "Routing key" section says the same for users):

- Native requests (any POST outside the OpenAI paths): the key is the first
  ``PrefixLength`` bytes of the raw body, exactly as sent.  The data plane
  hashes them in place; nothing here is involved.
- OpenAI requests: ``decode_openai`` reads the fields routing needs and
  ``prompt_text`` renders the text the model will see, in order, cut at
  ``PrefixLength`` characters:

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
- Two bounds keep the cost of a key proportional to ``PrefixLength``, not to
  the body (they change keys only for shapes no client sends):
  * the text ends after the ``PrefixLength``-th content part (all messages
    counted), even if it is shorter than ``PrefixLength``: empty text parts
    add no characters, so without this a body of millions of them would be
    read to the end;
  * a tool whose JSON text, as sent, is longer than ``TOOL_CANONICAL_BYTES``
    (64 KiB) enters the list as that text (UTF-8, invalid bytes replaced by
    U+FFFD), not re-encoded: canonical JSON would mean building every value
    of it.  Whitespace and key order inside such a tool do change the key.
- Token-id prompts (``/v1/completions`` with a list of ints) are keyed by
  their first ``PrefixLength // 4`` ids packed as unsigned 32-bit ints (a
  token is about four characters of text).
- The key is the UTF-8 encoding of the rendered text (lone surrogates pass
  through), so ``PrefixLength`` counts characters here and bytes on native
  requests, as in SageMaker.
- Cost: a body up to ``FAST_BODY_BYTES`` (64 KiB) is decoded whole into
  ``OpenAIRequest``.  A larger one (or a small one that does not decode that
  way) becomes a ``BoundedRequest``: one pass of msgspec at C speed checks the
  JSON syntax of the whole body and keeps only the first elements of
  ``messages``/``input`` (``ceil(PrefixLength / 2)``: each message adds at
  least two characters), ``tools`` (``PrefixLength // 2 + 1``) and ``prompt``
  (``PrefixLength // 4``) as raw JSON; the key then decodes what it reads:
  message contents stop at the key's last part and long strings are decoded
  only up to the characters the key still needs.  No object is built per
  element of the rest.  Both give the same key for the same body.
- Type checks: the fields routing reads are checked, with OpenAI-style errors
  naming the field (``param`` such as ``messages[0].content``): the
  top-level types of ``messages``, ``input``, ``prompt``, ``instructions``,
  ``tools``, ``prompt_cache_key``, ``stream``, ``previous_response_id`` (not
  part of the key: ``router.responses`` routes by it), ``conversation`` (an id
  or an object with a string ``id``: ``router.sessions`` may route by it);
  each message and part the key
  reads (role, content, part type and text); the first ``ceil(PrefixLength /
  2)`` messages are objects with a string role; the first ``PrefixLength //
  4`` prompt elements are ints, strings or arrays (ints in ``prompt[0]``);
  each tool the key reads is valid JSON with representable numbers.  What the
  key does not read (later messages and parts, later batch prompts, the
  tools past the prefix, every other field) is only checked to be JSON
  syntax: the backend validates it.  Strings routing does not decode are not
  checked for valid UTF-8.
- ``cache_salt`` is kept as raw JSON, unchecked: only whether a body has one
  matters (``router.cachesalt``).
- ``model`` is kept as raw JSON (``Raw``), unchecked: ``model_name`` reads it
  (a string, or absent/null) only where the fleet declares models, so a fleet
  that does not pays no check and forwards any ``model`` as before.  Either
  way the body is decoded once.
- ``decode_openai(body, limit)`` sizes its reading for ``limit``, the
  ``PrefixLength`` the key will use (default 4,096, the default
  PrefixLength): the element counts above, and so the extent of the type
  checks, follow it.  ``prompt_key`` with a larger limit reads the body
  again if a head was cut.  Heads are sized for at most ``HEAD_LIMIT``
  (4,096; built at import, ~10 us per element): past it, a body whose key
  needs more than 2,048 messages, 2,049 tools or 1,024 token ids is decoded
  whole as a small one is (every routing field type-checked, cost in
  proportion to the body: the old bound, for PrefixLength above 4,096 only).
- Strings at the top level (``prompt``, ``input``, ``instructions``) are
  decoded whole in the one pass, at C speed (unlike message contents).
- Errors: ``BadRequest`` with an OpenAI-style message naming what was wrong
  (invalid JSON or UTF-8, wrong types, nesting too deep).  Type errors of the
  parts read for the key may come from ``prompt_key``/``prompt_text``, not
  only from ``decode_openai``: callers handle both.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
from msgspec import UNSET, Raw, UnsetType

__all__ = [
    "FAST_BODY_BYTES",
    "OPENAI_PATHS",
    "TOOL_CANONICAL_BYTES",
    "BadRequest",
    "BoundedRequest",
    "OpenAIRequest",
    "conversation_id",
    "decode_openai",
    "has_cache_salt",
    "key_source",
    "model_name",
    "prompt_key",
    "prompt_text",
]

OPENAI_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/responses"})

RS, US, GS = "\x1e", "\x1f", "\x1d"
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})

FAST_BODY_BYTES = 64 * 1024  # decoded whole: at most ~4 ms of objects for any shape
TOOL_CANONICAL_BYTES = 64 * 1024  # re-encoding a tool this size costs at most ~5 ms
MIN_PREFIX_LENGTH = 1024  # config's lower bound: reading sized for it is a subset of any
HEAD_LIMIT = 4096  # the largest PrefixLength heads are sized for (see _reader)
_TOOLS_OPEN = 8  # len(RS + "tools" + US + "[")
_NULL = Raw(b"null")


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


class Conversation(msgspec.Struct):
    """The Responses API ``conversation`` as an object; only its id routes."""

    id: str


class OpenAIRequest(msgspec.Struct):
    """The routing view of an OpenAI request; every other field is skipped unread."""

    messages: list[Message] | None = None
    prompt: str | list[int | str | list[int]] | None = None
    input: str | list[Message] | None = None
    instructions: str | None = None
    tools: list[msgspec.Raw] | None = None
    prompt_cache_key: str | None = None
    stream: bool | None = None
    previous_response_id: str | None = None  # Responses API follow-ups (router.responses)
    conversation: str | Conversation | None = None  # a session key (router.sessions)
    cache_salt: Raw = _NULL  # whether the client sent one (router.cachesalt)
    model: Raw = _NULL  # read only where the fleet declares models (``model_name``)


_decoder = msgspec.json.Decoder(OpenAIRequest)
_any_decoder = msgspec.json.Decoder()
_str_decoder = msgspec.json.Decoder(str)
_content_decoder = msgspec.json.Decoder(str | list[ContentPart] | None)
_canonical = msgspec.json.Encoder(order="sorted")


def _invalid(exc: msgspec.ValidationError, prefix: str = "$") -> BadRequest:
    """``BadRequest`` from a msgspec error, its path rooted at ``prefix``."""
    message = str(exc)
    if prefix != "$":  # a sub-document: its ``$`` is ``prefix`` of the body
        if " - at `$" in message:
            message = message.replace(" - at `$", f" - at `{prefix}", 1)
        else:
            message = f"{message} - at `{prefix}`"
    param = message.rpartition("at `$.")[2].rstrip("`") if "at `$." in message else None
    return BadRequest(f"invalid request body: {message}", param)


class _Malformed(BadRequest):
    """Not JSON at all (syntax, UTF-8, depth), whatever the types."""


def _malformed(exc: msgspec.MsgspecError | RecursionError, where: str = "") -> BadRequest:
    if isinstance(exc, RecursionError):
        return _Malformed("request body is not valid JSON: nesting too deep")
    return _Malformed(f"request body is not valid JSON: {exc}{where}")


# -- the bounded reading -------------------------------------------------------


def _head(name: str, size: int, kind: Any, first: Any = None) -> Any:
    """An array-like Struct holding the first ``size`` elements of a JSON array.

    msgspec fills these fields and skips any further elements at C speed,
    checking their syntax but building nothing.
    """
    fields = [("f0", (kind if first is None else first) | UnsetType, UNSET)]
    fields += [(f"f{i}", kind | UnsetType, UNSET) for i in range(1, size)]
    return msgspec.defstruct(name, fields, array_like=True, gc=False)


class _MessageHead(msgspec.Struct, gc=False):
    """A message as pass one reads it: its content stays raw JSON."""

    role: str = ""
    content: Raw = _NULL


_AnyArray = msgspec.defstruct("_AnyArray", [], array_like=True, gc=False)  # syntax only


class _Reader:
    """Pass one for one ``PrefixLength``: a decoder of the body's routing fields."""

    def __init__(self, limit: int):
        self.limit = limit
        self.messages = (limit + 1) // 2  # every message adds RS and US
        self.tools = limit // 2 + 1  # past RS tools US [, every tool adds ",x" at least
        self.ids = max(1, limit // 4)
        messages = _head(f"_Messages{limit}", self.messages, _MessageHead)
        ids = _head(f"_Ids{limit}", self.ids, int)
        prompt = _head(f"_Prompt{limit}", self.ids, int | str | _AnyArray, int | str | ids)
        tools = _head(f"_Tools{limit}", self.tools, Raw)
        self.envelope = msgspec.defstruct(
            f"_Envelope{limit}",
            [
                ("messages", messages | None, None),
                ("prompt", str | prompt | None, None),
                ("input", str | messages | None, None),
                ("instructions", str | None, None),
                ("tools", tools | None, None),
                ("prompt_cache_key", str | None, None),
                ("stream", bool | None, None),
                ("previous_response_id", str | None, None),
                ("conversation", str | Conversation | None, None),
                ("cache_salt", Raw, _NULL),
                ("model", Raw, _NULL),
            ],
            gc=False,
        )
        self.decoder = msgspec.json.Decoder(self.envelope)

    def read(self, body: bytes | bytearray | memoryview) -> BoundedRequest:
        try:
            envelope = self.decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise _invalid(exc) from None
        except (msgspec.DecodeError, RecursionError) as exc:
            raise _malformed(exc) from None
        return BoundedRequest(self, body, envelope)


_readers: dict[int, _Reader] = {}


def _reader(limit: int) -> _Reader:
    """The reader sized for ``limit``, at most ``HEAD_LIMIT``: a struct of n fields
    costs ~10 us per field to build (65,536 would take over a second, once)."""
    limit = min(limit, HEAD_LIMIT)
    reader = _readers.get(limit)
    if reader is None:
        if len(_readers) >= 16:  # a handful of PrefixLengths in practice; bound it anyway
            _readers.clear()
        reader = _readers[limit] = _Reader(limit)
    return reader


def _elements(head: Any) -> Iterator[Any]:
    """The elements a head holds, in order."""
    for name in head.__struct_fields__:
        value = getattr(head, name)
        if value is UNSET:
            return
        yield value


def _full(head: Any) -> bool:
    """Whether a head (or any other value) holds as many elements as it can."""
    if not isinstance(head, msgspec.Struct) or not head.__struct_fields__:
        return False
    return getattr(head, head.__struct_fields__[-1]) is not UNSET


class BoundedRequest:
    """An OpenAI body read in one bounded pass (see the module contract)."""

    __slots__ = (
        "_body",
        "_envelope",
        "_reader",
        "cache_salt",
        "conversation",
        "model",
        "previous_response_id",
        "prompt_cache_key",
        "stream",
    )

    def __init__(self, reader: _Reader, body: bytes | bytearray | memoryview, envelope: Any):
        self._reader = reader
        self._body = body
        self._envelope = envelope
        self.prompt_cache_key: str | None = envelope.prompt_cache_key
        self.stream: bool | None = envelope.stream
        self.previous_response_id: str | None = envelope.previous_response_id
        self.conversation: str | Conversation | None = envelope.conversation
        self.cache_salt: Raw = envelope.cache_salt
        self.model: Raw = envelope.model

    def envelope_for(self, limit: int) -> Any:
        """Pass one's result for ``limit``: read again if it was sized for a smaller
        limit and cut; an ``OpenAIRequest`` (the whole decode) past ``HEAD_LIMIT``."""
        while limit > self._reader.limit and self._cut():
            if self._reader.limit >= HEAD_LIMIT:
                try:
                    return _decoder.decode(self._body)
                except msgspec.ValidationError as exc:
                    raise _invalid(exc) from None
            request = _reader(limit).read(self._body)
            self._reader, self._envelope = request._reader, request._envelope
        return self._envelope

    def _cut(self) -> bool:
        """Whether some array was longer than its head."""
        envelope = self._envelope
        prompt = envelope.prompt
        return (
            _full(envelope.messages)
            or _full(envelope.input)
            or _full(envelope.tools)
            or _full(prompt)
            or (prompt is not None and _full(getattr(prompt, "f0", None)))
        )


_reader(MIN_PREFIX_LENGTH), _reader(HEAD_LIMIT)  # built at import, not on the loop


class _Enough(Exception):
    """Raised inside a decode once the key has what it needs: stops reading."""


class _Budget(threading.local):
    def __init__(self) -> None:
        self.parts: list[_Part] = []
        self.max_parts = 0
        self.chars = 0
        self.max_chars = 0


_budget = _Budget()


class _Part(msgspec.Struct, gc=False):
    """A content part read by the bounded path; decoding stops at the key's last part."""

    type: str = ""
    text: str | None = None

    def __post_init__(self) -> None:
        budget = _budget
        budget.parts.append(self)
        text = self.text if self.type in TEXT_PARTS else None
        budget.chars += 1 + len(self.type) if text is None else len(text)
        if len(budget.parts) >= budget.max_parts or budget.chars >= budget.max_chars:
            raise _Enough


_parts_decoder = msgspec.json.Decoder(list[_Part])


def _read_parts(raw: Raw, max_parts: int, max_chars: int, where: str) -> list[_Part]:
    budget = _budget
    budget.parts, budget.max_parts = [], max_parts
    budget.chars, budget.max_chars = 0, max_chars
    try:
        _parts_decoder.decode(raw)
    except _Enough:
        pass
    except msgspec.ValidationError as exc:
        raise _invalid(exc, where) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _malformed(exc, f" - at `{where}`") from None
    finally:
        parts, budget.parts = budget.parts, []
    return parts


def _read_string(raw: Raw, room: int, where: str) -> str:
    """A JSON string of raw JSON, or at least its first ``room`` characters.

    A character takes at most 12 bytes of JSON (a surrogate pair escaped), so
    a long string is decoded from a prefix closed by a quote: the first cut
    that decodes (not inside an escape or a UTF-8 sequence) holds at least
    ``room`` whole characters before anything the cut could change.
    """
    try:
        cut = 12 * room + 24
        if len(raw) > cut + 16:
            view = memoryview(raw)
            for end in range(cut, cut - 13, -1):
                with_quote = bytes(view[:end]) + b'"'
                try:
                    return _str_decoder.decode(with_quote)
                except msgspec.DecodeError:
                    continue
        return _str_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, where) from None
    except msgspec.DecodeError as exc:
        raise _malformed(exc, f" - at `{where}`") from None


def _bounded_content(raw: Raw, room: int, parts_left: int, where: str) -> Any:
    """A message's content as the key reads it: at most ``room`` characters' worth."""
    first = bytes(memoryview(raw)[:1])
    if first == b'"':
        return _read_string(raw, room, where)
    if first == b"[":
        return _read_parts(raw, parts_left, room, where)
    if first == b"n":
        return None
    try:  # a wrong type: let msgspec word the error
        _content_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, where) from None
    raise AssertionError("unreachable: content of an unexpected type decoded")


# -- rendering -----------------------------------------------------------------


def _tool_text(tool: Raw, index: int, room: int) -> str:
    if len(tool) > TOOL_CANONICAL_BYTES:
        # Its text as sent: 4 bytes per character at most, plus one more
        # character so that a cut UTF-8 sequence falls past the key.
        return bytes(memoryview(tool)[: 4 * room + 4]).decode("utf-8", "replace")
    try:
        return _canonical.encode(_any_decoder.decode(tool)).decode()
    except (msgspec.MsgspecError, RecursionError) as exc:
        # e.g. 1e400: valid JSON syntax, no float to hold it
        raise BadRequest(f"invalid tools[{index}]: {exc}", "tools") from None


def _render_tools(parts: list[str], tools: Iterable[Raw], limit: int) -> int:
    """Append the tools list; stop once past the limit.  Returns the size."""
    parts += (RS, "tools", US, "[")
    size = _TOOLS_OPEN
    for index, tool in enumerate(tools):
        canonical = _tool_text(tool, index, limit - size)
        parts += ("," if index else "", canonical)
        size += len(canonical) + (1 if index else 0)
        if size >= limit:
            return size
    parts.append("]")
    return size + 1


def _render_parts(
    parts: list[str], content: Iterable[ContentPart | _Part], size: int, limit: int, left: int
) -> tuple[int, int]:
    """Append content parts; returns the size and the parts left (0: the text ends)."""
    for part in content:
        text = part.text if part.type in TEXT_PARTS else None
        if text is None:
            text = GS + part.type
        parts.append(text)
        size += len(text)
        left -= 1
        if left == 0 or size >= limit:
            break
    return size, left


def _join(parts: list[str], size: int, limit: int) -> str:
    text = "".join(parts)
    return text[:limit] if size > limit else text


def prompt_text(request: OpenAIRequest | BoundedRequest, limit: int) -> str:
    """Render the prompt as the model will see it, cut at ``limit`` characters."""
    if isinstance(request, BoundedRequest):
        envelope = request.envelope_for(limit)
        if not isinstance(envelope, OpenAIRequest):
            return _bounded_text(envelope, limit)
        request = envelope
    if request.prompt is not None and request.messages is None and request.input is None:
        prompt = request.prompt
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        return prompt[:limit]
    parts: list[str] = []
    size = 0
    if request.tools:
        size = _render_tools(parts, request.tools, limit)
    if size < limit and request.instructions is not None:
        parts += (RS, "instructions", US, request.instructions)
        size += 14 + len(request.instructions)
    messages = request.messages if request.messages is not None else request.input
    if isinstance(messages, str):
        messages = [Message("user", messages)]
    left = limit  # content parts the text may still hold
    for message in messages or ():
        if size >= limit:
            break
        role, content = message.role, message.content
        if isinstance(content, str):  # the common case, in one step
            parts += (RS, role, US, content)
            size += 2 + len(role) + len(content)
            continue
        parts += (RS, role, US)
        size += 2 + len(role)
        if content:
            size, left = _render_parts(parts, content, size, limit, left)
            if left == 0:
                break
    return _join(parts, size, limit)


def _bounded_text(envelope: Any, limit: int) -> str:
    """``prompt_text`` of a ``BoundedRequest``: decodes only what it renders."""
    prompt = envelope.prompt
    if prompt is not None and envelope.messages is None and envelope.input is None:
        if not isinstance(prompt, str):
            first = prompt.f0
            prompt = first if isinstance(first, str) else ""
        return prompt[:limit]
    parts: list[str] = []
    size = 0
    if envelope.tools is not None and envelope.tools.f0 is not UNSET:
        size = _render_tools(parts, _elements(envelope.tools), limit)
    if size < limit and envelope.instructions is not None:
        parts += (RS, "instructions", US, envelope.instructions)
        size += 14 + len(envelope.instructions)
    field = "messages" if envelope.messages is not None else "input"
    messages = envelope.messages if envelope.messages is not None else envelope.input
    if isinstance(messages, str):
        room = max(0, limit - size - 6)
        return _join([*parts, RS, "user", US, messages[:room]], size + 6 + len(messages), limit)
    left = limit
    for index, message in enumerate(_elements(messages) if messages is not None else ()):
        if size >= limit:
            break
        role = message.role
        parts += (RS, role, US)
        size += 2 + len(role)
        where = f"$.{field}[{index}].content"
        content = _bounded_content(message.content, max(1, limit - size), left, where)
        if type(content) is str:
            parts.append(content)
            size += len(content)
        elif content:
            size, left = _render_parts(parts, content, size, limit, left)
            if left == 0:
                break
    return _join(parts, size, limit)


# -- the API ---------------------------------------------------------------------


def decode_openai(
    body: bytes | bytearray | memoryview, limit: int = HEAD_LIMIT
) -> OpenAIRequest | BoundedRequest:
    """Decode the routing fields of an OpenAI body, or raise ``BadRequest``.

    ``limit`` is the ``PrefixLength`` the key will be cut at (see the contract).
    """
    wrong_type = None
    if len(body) <= FAST_BODY_BYTES:
        try:
            return _decoder.decode(body)
        except msgspec.ValidationError as exc:
            wrong_type = exc  # the bounded reading decides whether the key reads it
        except (msgspec.DecodeError, RecursionError):
            pass  # the bounded reading words it, as for a body of any size
    try:
        return _reader(max(limit, MIN_PREFIX_LENGTH)).read(body)
    except _Malformed:
        if wrong_type is None:
            raise
        # Both are wrong; the type error comes first in the body (e.g. an array
        # nested too deep where an object belongs): say that, as before.
        raise _invalid(wrong_type) from None


def _token_ids(request: OpenAIRequest | BoundedRequest, limit: int) -> list[Any] | None:
    """The token ids a prompt is keyed by, or None for a text prompt."""
    count = limit // 4
    if isinstance(request, BoundedRequest):
        envelope = request.envelope_for(limit)
        if isinstance(envelope, OpenAIRequest):
            return _token_ids(envelope, limit)
        prompt = envelope.prompt
        if prompt is None or isinstance(prompt, str) or envelope.messages is not None:
            return None
        if envelope.input is not None:
            return None
        first = prompt.f0
        if isinstance(first, int):
            return list(_elements(prompt))[:count]
        if first is UNSET or isinstance(first, str):
            return None
        return list(_elements(first))[:count]
    prompt = request.prompt
    if (
        isinstance(prompt, list)
        and prompt
        and isinstance(prompt[0], int | list)
        and request.messages is None
        and request.input is None
    ):
        ids: list[Any] = prompt[0] if isinstance(prompt[0], list) else prompt
        return ids[:count]
    return None


def prompt_key(request: OpenAIRequest | BoundedRequest, limit: int) -> bytes:
    """The routing key bytes of an OpenAI request (see the module contract)."""
    ids = _token_ids(request, limit)
    if ids is not None:
        try:
            return array("I", ids).tobytes()
        except (TypeError, OverflowError):
            raise BadRequest("prompt token ids must be non-negative integers", "prompt") from None
    return prompt_text(request, limit).encode("utf-8", "surrogatepass")


def key_source(request: OpenAIRequest | BoundedRequest, limit: int) -> str:
    """What ``prompt_key`` keys ``request`` by: "token ids" or "prompt text"."""
    return "token ids" if _token_ids(request, limit) is not None else "prompt text"


def conversation_id(conversation: str | Conversation | None) -> str | None:
    """The id of a Responses API ``conversation`` (a string, or an object's ``id``)."""
    if conversation is None or isinstance(conversation, str):
        return conversation
    return conversation.id


def has_cache_salt(request: OpenAIRequest | BoundedRequest) -> bool:
    """Whether the body has a ``cache_salt`` (null counts as none)."""
    return request.cache_salt != _NULL


def model_name(raw: bytes | Raw) -> str | None:
    """The ``model`` of a body (its raw JSON as decoded): None when absent or null."""
    try:
        return _model_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, "$.model") from None
    except msgspec.DecodeError as exc:
        raise _malformed(exc, " - at `$.model`") from None


_model_decoder = msgspec.json.Decoder(str | None)
