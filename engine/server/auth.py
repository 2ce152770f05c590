"""API key check (Authorization: Bearer KEY, or Anthropic's x-api-key: KEY) for the routes that generate or
tokenize."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.errors import UnauthorizedError, error_response


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware) so streams and disconnects pass through untouched.

    Like TGI, /health, /info, /metrics and the docs stay open: probes and scrapers carry no token.
    Unlike TGI, /v1/models is protected with the rest of /v1, and the key is compared exactly and in
    constant time (TGI lower-cases both sides); only the "Bearer" scheme is case-insensitive.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope["method"], scope["path"]) and not self._ok(scope):
            await error_response(UnauthorizedError())(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        if b"x-api-key" in headers:     # Anthropic's clients send the key so
            return hmac.compare_digest(headers[b"x-api-key"].strip(), self.key)
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return hmac.compare_digest(scheme.lower() + b" " + token.strip(), self.expected)


def is_protected(method: str, path: str) -> bool:
    if method == "OPTIONS":  # CORS preflights carry no credentials
        return False
    return (path in ("/generate", "/generate_stream", "/tokenize") or path.startswith("/v1/")
            or (path == "/" and method == "POST"))
