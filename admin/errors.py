"""Admin API errors: one JSON shape, one small tree, translated at the boundary.

Contract:
- Every error answer is ``{"error": {"message", "type", "fields"?}}`` (``ErrorBody``);
  ``fields`` is present on 422 only and lists ``{"path", "message"}`` pairs.
  A ``path`` names where the bad value is: ``$.weight`` (a JSONPath into the
  request body, as msgspec writes it) or ``?timeout`` (a query parameter).
- ``RequestError`` and its subclasses are what the admin code raises for bad
  input; ``router.control.ControlError`` subclasses and aiohttp's own
  ``HTTPException`` s (404 unknown path, 405, 413) are translated by
  ``error_for`` in the app's outermost middleware, so no handler builds an
  error response by hand.
- Messages never contain a credential: the auth layer says what is wrong
  ("missing", "invalid") and never what was sent.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

import msgspec

__all__ = [
    "STATUS_TYPES",
    "BadRequest",
    "ErrorBody",
    "ErrorDetail",
    "ErrorType",
    "FieldError",
    "PayloadTooLarge",
    "RequestError",
    "Unauthorized",
    "UnsupportedMediaType",
    "ValidationFailed",
    "fields_from",
]

ErrorType = Literal[
    "bad_request",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "conflict",
    "payload_too_large",
    "unsupported_media_type",
    "expectation_failed",
    "validation_error",
    "internal_error",
]

# The ``type`` each status is reported with; statuses not listed (other aiohttp
# HTTPExceptions, which no route of ours raises) fall back to bad_request/internal_error.
STATUS_TYPES: dict[int, ErrorType] = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    417: "expectation_failed",
    422: "validation_error",
    500: "internal_error",
}


class FieldError(msgspec.Struct, frozen=True):
    path: str
    message: str


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: ErrorType
    fields: list[FieldError] | msgspec.UnsetType = msgspec.UNSET  # 422 only


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


class RequestError(Exception):
    """A request the admin API refuses; ``status`` and ``type`` go into the answer."""

    status: ClassVar[int] = 400
    type: ClassVar[ErrorType] = "bad_request"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type))


class BadRequest(RequestError):
    """The body cannot be read as JSON at all (as opposed to JSON with bad values: 422)."""


class Unauthorized(RequestError):
    status = 401
    type = "unauthorized"


class PayloadTooLarge(RequestError):
    status = 413
    type = "payload_too_large"


class UnsupportedMediaType(RequestError):
    status = 415
    type = "unsupported_media_type"


class ValidationFailed(RequestError):
    status = 422
    type = "validation_error"

    def __init__(self, fields: list[FieldError]) -> None:
        # The first field's message is the summary: msgspec stops at the first error,
        # so there is usually exactly one.
        super().__init__(fields[0].message if fields else "invalid request")
        self.fields = fields

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.fields))


# msgspec writes "<message> - at `$.a.b[0]`", or just "<message>" for the root.
_AT = re.compile(r"^(?P<message>.*) - at `(?P<path>\$[^`]*)`$", re.DOTALL)
# A missing or unknown field is reported on its parent object; point at the field.
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<field>[^`]+)`$")


def fields_from(exc: msgspec.ValidationError, *, root_field: str | None = None) -> list[FieldError]:
    """The field list for a msgspec validation error.

    ``root_field`` is where an error msgspec reports on the whole object, without a
    field (a ``__post_init__`` check), belongs; the caller knows which field that
    check looks at, msgspec does not.
    """
    text = str(exc)
    match = _AT.match(text)
    message, path = (match["message"], match["path"]) if match else (text, "$")
    named = _NAMED.match(message)
    if named:
        path = f"{path}.{named['field']}"
    elif match is None and root_field is not None and not message.startswith("Expected "):
        path = f"$.{root_field}"
    return [FieldError(path, message)]
