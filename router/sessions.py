"""Session keys: where a request's affinity key comes from.

Contract (the README's "Session keys" says the same for users):
- ``PrefixAwareRoutingConfig.SessionKeys`` lists the sources in precedence
  order (default ``prompt_cache_key, header, conversation, prefix``; ``prefix``
  last, config checks it).  The first source a request carries decides its
  affinity key, which is then salted with the tenant key exactly as before
  (``prompt_cache_key``, else the tenant header) and hashed onto the ring:
  * ``prompt_cache_key``: the body has one -> the prompt prefix, salted by it
    (OpenAI's meaning, and the router's before session keys existed);
  * ``header``: the session header (``SessionHeader``, default
    ``X-Session-Id``) is present and not empty -> RS "header" US <value>;
  * ``conversation``: the Responses API ``conversation`` (an id, or an object
    with an ``id``) -> RS "conversation" US <id>;
  * ``prefix``: the prompt prefix (native requests: the body's first bytes).
  RS/US (U+001E/U+001F) keep a session key apart from any prompt text.
- A session key pins the whole session to one backend: every request of it
  has one hash whatever its prompt.  Nothing else changes: the bounded walk,
  TRAFFIC placement and hot-key replicas treat it as any key.
- Native requests have no body fields to read: ``header`` (when listed)
  then ``prefix``.  With a session header a native request is routed at its
  head, its body streamed without being hashed.
- Stateless: the key is a function of the request and the config, so every
  worker (``--workers N``) and replica (``--etcd``) computes the same one;
  the ring and the placements they share do the rest.
- Each routed request's source (``SOURCES``) is counted by the recorder and
  written to the access log (``key_source``); requests routed by no key
  (passthroughs, Responses API ids) have none.
- The header is read in the one pass over the head (``router.heads``); it is
  forwarded unchanged.  A repeated session header is refused (400), as the
  tenant header is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import PrefixAwareRoutingConfig

__all__ = [
    "CONVERSATION",
    "HEADER",
    "PREFIX",
    "PROMPT_CACHE_KEY",
    "SOURCES",
    "SessionRule",
    "conversation_key",
    "header_key",
]

PROMPT_CACHE_KEY = "prompt_cache_key"
HEADER = "header"
CONVERSATION = "conversation"
PREFIX = "prefix"
SOURCES = (PROMPT_CACHE_KEY, HEADER, CONVERSATION, PREFIX)

_HEADER_TAG = b"\x1eheader\x1f"
_CONVERSATION_TAG = b"\x1econversation\x1f"


def header_key(value: bytes) -> bytes:
    """The affinity key of a session header's value."""
    return _HEADER_TAG + value


def conversation_key(conversation: str) -> bytes:
    """The affinity key of a Responses API conversation id."""
    return _CONVERSATION_TAG + conversation.encode("utf-8", "surrogatepass")


class SessionRule:
    """``SessionKeys`` and ``SessionHeader`` resolved once per config change."""

    __slots__ = ("header", "native_header", "order")

    def __init__(self, config: PrefixAwareRoutingConfig):
        self.order: tuple[str, ...] = tuple(config.session_keys)
        # Matched against header names as llhttp gives them, lowered once.
        self.header = config.session_header.lower().encode("ascii")
        self.native_header = HEADER in self.order

    def openai_source(
        self, prompt_cache_key: str | None, session: bytes | None, conversation: str | None
    ) -> str:
        """The source that decides an OpenAI request's key."""
        for source in self.order:
            if source == PROMPT_CACHE_KEY:
                if prompt_cache_key is not None:
                    return PROMPT_CACHE_KEY
            elif source == HEADER:
                if session:
                    return HEADER
            elif source == CONVERSATION:
                if conversation is not None:
                    return CONVERSATION
            else:
                return PREFIX
        return PREFIX  # unreachable while config keeps prefix last
