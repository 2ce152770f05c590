"""Typed server errors and the one place that turns them into TGI's {"error", "error_type"} body."""
from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)


class ServerError(Exception):
    """An error with an HTTP status and TGI's `error_type`; the message is safe to show clients."""

    status_code = 500
    error_type = "internal"
    prefix = ""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, str]:
        return {"error": f"{self.prefix}{self.message}", "error_type": self.error_type}


class ValidationError(ServerError):
    status_code = 422
    error_type = "validation"
    prefix = "Input validation error: "


class OverloadedError(ServerError):
    status_code = 429
    error_type = "overloaded"

    def __init__(self, message: str = "Model is overloaded") -> None:
        super().__init__(message)


class GenerationError(ServerError):
    status_code = 424
    error_type = "generation"
    prefix = "Request failed during generation: "


class IncompleteGenerationError(ServerError):
    status_code = 500
    error_type = "incomplete_generation"

    def __init__(self, message: str = "Incomplete generation") -> None:
        super().__init__(message)


class ClientDisconnectedError(ServerError):
    status_code = 499  # nginx's "client closed request"; nobody reads it, the logs and metrics do
    error_type = "client_disconnected"

    def __init__(self, message: str = "Client disconnected") -> None:
        super().__init__(message)


class UnauthorizedError(ServerError):
    status_code = 401
    error_type = "unauthorized"

    def __init__(self, message: str = "Unauthorized") -> None:
        super().__init__(message)


class UnhealthyError(ServerError):
    status_code = 503
    error_type = "healthcheck"

    def __init__(self, message: str = "unhealthy") -> None:
        super().__init__(message)


def error_response(err: ServerError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


async def handle_server_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServerError)
    return error_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    # 404/405 from routing keep the same body shape as everything else
    assert isinstance(exc, HTTPException)
    err_type = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    return JSONResponse({"error": str(exc.detail), "error_type": err_type},
                        status_code=exc.status_code, headers=exc.headers)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # the traceback goes to the log, never to the client
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"error": "Internal server error", "error_type": "internal"}, status_code=500)


EXCEPTION_HANDLERS = {
    ServerError: handle_server_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
