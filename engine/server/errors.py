"""Errors a client sees: OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with
the status that fits. Anything else raised while serving is a bug: logged with its traceback,
answered as a 500 with a sentence, never with the traceback."""

from __future__ import annotations

import re

import msgspec

from engine.server.schemas import ErrorBody, ErrorResponse

ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("conflict_error", "session_busy"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "too_many_sessions"),
    500: ("server_error", "internal_error"),
    503: ("overloaded_error", "service_unavailable"),
}


class APIError(Exception):
    """An error answered to the client; ``message`` is a sentence it can act on."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        kind, default_code = ERROR_TYPES.get(self.status, ERROR_TYPES[500])
        return ErrorResponse(ErrorBody(self.message, kind, self.param, self.code or default_code))


_LOCATION = re.compile(r" - at `\$\.?([^`]*)`$")


def from_validation(exc: msgspec.MsgspecError) -> APIError:
    """A body that is not JSON, or does not fit the schema: 400 naming the field."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"the request body is not valid JSON: {text}")
    param = None
    match = _LOCATION.search(text)
    if match:
        param = match.group(1) or None
        text = text[: match.start()]
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", text)
    if unknown:
        param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        return APIError(400, f"unknown or unsupported field {param!r}", param=param)
    where = f" at {param!r}" if param else ""
    return APIError(400, f"invalid request body{where}: {text}", param=param)
