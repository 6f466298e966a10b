"""Reading admin requests: JSON bodies and query parameters, with precise errors.

Contract:
- A request body must be JSON: ``Content-Type: application/json`` or any
  ``application/*+json``, in UTF-8.  A request with no ``Content-Type`` at all is
  read as JSON too (``curl --data-binary @file`` style clients forget it; nothing
  else could be meant).  Any other type is 415.
- Bodies are capped at ``MAX_BODY`` bytes (413): the largest legitimate one, a
  routing document, is a few hundred bytes.
- Malformed JSON, including an empty body and JSON nested too deep, is 400;
  JSON whose values are wrong for the target type is 422 with the offending
  field's path (see ``errors``).
- Query parameters are strict: a bad or repeated value is 422 with path ``?name``;
  unknown parameters are ignored, as HTTP APIs customarily do.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec
from aiohttp import hdrs, web

from .errors import (
    BadRequest,
    FieldError,
    PayloadTooLarge,
    UnsupportedMediaType,
    ValidationFailed,
    fields_from,
)

__all__ = [
    "MAX_BODY",
    "convert",
    "decode",
    "parse",
    "query_bool",
    "query_int",
    "query_seconds",
    "read_json",
]

MAX_BODY = 64 * 1024
# Untyped, msgspec raises RecursionError (not a DecodeError) for JSON nested past
# Python's recursion limit: well under MAX_BODY, ``[`` * 1,000 does it.  (A typed
# decode refuses the first value of the wrong type long before.)
_TOO_DEEP = "request body is not valid JSON: nesting too deep"

T = TypeVar("T")


async def read_json(request: web.Request) -> bytes:
    """The raw body of a JSON request, after the content-type and size checks."""
    if hdrs.CONTENT_TYPE in request.headers:
        media = request.content_type  # lower-cased, without parameters
        is_json = media == "application/json" or (
            media.startswith("application/") and media.endswith("+json")
        )
        if not is_json:
            raise UnsupportedMediaType(f"request body must be application/json, not {media[:80]!r}")
        charset = request.charset
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            raise UnsupportedMediaType(f"request body must be UTF-8, not {charset[:40]!r}")
    # Refuse a declared oversize body before reading any of it; aiohttp's own
    # client_max_size check (same limit) covers chunked bodies as they arrive.
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise PayloadTooLarge(f"request body is larger than {MAX_BODY} bytes")
    body = await request.read()
    if not body.strip():
        raise BadRequest("request body is empty: expected a JSON object")
    return body


def decode(body: bytes, type: type[T], *, root_field: str | None = None) -> T:
    """Decode ``body`` as ``type``: 400 if it is not JSON, 422 if the values are wrong."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        raise ValidationFailed(fields_from(exc, root_field=root_field)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def parse(body: bytes) -> Any:
    """Decode ``body`` as untyped JSON (400 if it is not JSON)."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None


def convert(data: Any, type: type[T], *, root_field: str | None = None) -> T:
    """Validate already-decoded JSON ``data`` as ``type`` (422 on wrong values)."""
    try:
        return msgspec.convert(data, type)
    except msgspec.ValidationError as exc:
        raise ValidationFailed(fields_from(exc, root_field=root_field)) from None


def _one(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise ValidationFailed([FieldError(f"?{name}", f"{name} must be given at most once")])
    return values[0] if values else None


def query_bool(request: web.Request, name: str, default: bool) -> bool:
    text = _one(request, name)
    if text is None:
        return default
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise ValidationFailed([FieldError(f"?{name}", f"{name} must be true or false")])
    return value


def query_seconds(
    request: web.Request, name: str, default: float, *, low: float, high: float
) -> float:
    text = _one(request, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # also false for NaN, so "nan" and "inf" are refused
        raise ValidationFailed(
            [FieldError(f"?{name}", f"{name} must be a number of seconds from {low:g} to {high:g}")]
        )
    return value


def query_int(request: web.Request, name: str, default: int, *, low: int, high: int) -> int:
    text = _one(request, name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and low <= int(text) <= high):
        raise ValidationFailed(
            [FieldError(f"?{name}", f"{name} must be a whole number from {low} to {high}")]
        )
    return int(text)
