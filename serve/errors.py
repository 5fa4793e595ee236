"""Every failure answers with OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`.

400 bad input (FastAPI's 422 validation errors included: malformed JSON, wrong types, values out of
range), 401 bad key, 404 unknown model or route, 405 wrong method. Anything unexpected is a 500 with the
same envelope, logged; bad input never reaches that branch (tests/test_server.py sends a table of it).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from looped_lm.engine.engine import InvalidRequest
from looped_lm.serve.protocol import ErrorInfo, ErrorResponse, FieldError

log = logging.getLogger("looped_lm.serve")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answer: raised by handlers, turned into the envelope by the app."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or _TYPES.get(status, "invalid_request_error")

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> "APIError":
        """A 400 whose message starts with the field it names (as validation errors do)."""
        if param and not re.match(rf"{re.escape(param)}\b", message):
            message = f"{param}: {message}"
        return cls(400, message, param)

    @classmethod
    def from_invalid(cls, e: InvalidRequest) -> "APIError":
        return cls.bad_request(str(e), e.param)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


BODY_SHAPE = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})  # no body, or not an object


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as one line, and the body field it names."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', msg)}", None
    msg = msg.removeprefix("Value error, ")
    cause = first.get("ctx", {}).get("error")
    if not loc and isinstance(cause, FieldError):
        return f"{cause.field}: {cause}", cause.field
    if not loc:
        if first.get("type") in BODY_SHAPE:
            return "the request body must be a JSON object", None
        return msg, None  # a check on the whole body (each field's own check names its field instead)
    return f"{'.'.join(loc)}: {msg}", loc[0]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return APIError.from_invalid(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return APIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()  # 405: Allow

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", type="server_error").response()
