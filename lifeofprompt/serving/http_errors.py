"""Every error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, FastAPI's own included.

A typed error of ``lifeofprompt.errors`` carries its HTTP status and OpenAI type; FastAPI's body
validation (its 422), an unknown route (404), a wrong method (405) and a body it cannot read are
turned into the same shape here, with 400 for a body that is not what the schema says. Malformed
JSON says where, as a line and column, in the message. A 503 carries ``Retry-After``.

``document_errors`` makes ``app.openapi()`` say so too: 400 with the error schema where FastAPI
would document its 422, so that a fuzzer's "responses match the schema" means something.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import LifeOfPromptError
from .openai_protocol import ErrorResponse

RETRY_AFTER_S = 1

_TYPES = {401: "invalid_request_error", 413: "request_too_large", 503: "server_overloaded"}


def error_body(message: str, error_type: str, param: str | None = None, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_json(
    status: int, message: str, error_type: str | None = None, param: str | None = None, code: int | str | None = None
) -> JSONResponse:
    error_type = error_type or _TYPES.get(status) or ("internal_error" if status >= 500 else "invalid_request_error")
    headers = {}
    if status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(
        error_body(message, error_type, param, status if code is None else code), status_code=status, headers=headers
    )


def error_response(exc: BaseException) -> JSONResponse:
    """A typed error → its HTTP status and OpenAI's error shape (anything else is a 500)."""
    if isinstance(exc, LifeOfPromptError):
        return error_json(
            exc.http_status, str(exc), exc.error_type, getattr(exc, "param", None), getattr(exc, "code", None)
        )
    return error_json(500, f"{type(exc).__name__}: {exc}", "internal_error")


def stream_error_body(exc: BaseException) -> dict:
    """The error event a stream ends with when the engine failed its request mid-text."""
    if isinstance(exc, LifeOfPromptError):
        return error_body(str(exc), exc.error_type, getattr(exc, "param", None), getattr(exc, "code", exc.http_status))
    return error_body(f"{type(exc).__name__}: {exc}", "internal_error", None, 500)


def where_in_json(doc, pos: int) -> str:
    """``line L, column C`` of character ``pos`` in the document (as Python's json module counts)."""
    if isinstance(doc, bytes):
        doc = doc.decode("utf-8", "replace")
    if not isinstance(doc, str) or not isinstance(pos, int):
        return f"character {pos}"
    line = doc.count("\n", 0, pos) + 1
    column = pos - doc.rfind("\n", 0, pos)
    return f"line {line}, column {column}"


def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        pos = loc[1] if len(loc) > 1 else None
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return error_json(400, f"malformed JSON at {where_in_json(getattr(exc, 'body', None), pos)}: {reason}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = first.get("msg", "invalid request")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    return error_json(400, message, param=".".join(loc) or None)


def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = f"no such route: {request.method} {request.url.path}"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    elif status == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        message = f"the request body is not valid UTF-8 (byte {exc.__cause__.start}): {exc.__cause__.reason}"
    else:
        message = str(exc.detail)
    response = error_json(status, message)
    for name, value in (exc.headers or {}).items():
        response.headers.setdefault(name, value)
    return response


def install_error_handlers(app) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(LifeOfPromptError, lambda request, exc: error_response(exc))
    app.add_exception_handler(Exception, lambda request, exc: error_response(exc))  # a bug: 500, in OpenAI's shape


def error_responses(*statuses: int) -> dict:
    """FastAPI ``responses=`` documenting these statuses with OpenAI's error schema."""
    return {status: {"model": ErrorResponse} for status in statuses}


def document_errors(app) -> None:
    """``app.openapi()`` with 400 (OpenAI's error schema) where FastAPI documents its 422."""

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault(
                            "400",
                            {
                                "description": "Bad Request",
                                "content": {
                                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                                },
                            },
                        )
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
