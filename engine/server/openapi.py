"""OpenAPI 3.1 description of the routes, built from the wire models' JSON schemas, and a /docs page."""
from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from engine.server import protocol as p

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "422": "Input validation error", "424": "Generation error", "429": "Model is overloaded",
    "500": "Incomplete generation", "401": "Missing or wrong API key (when the server has one)",
}

# (method, path, summary, request model, response model or media type)
_ROUTES: list[tuple[str, str, str, type[BaseModel] | None, Any]] = [
    ("post", "/", "Generate (stream=true gives SSE); non-stream answers a list", p.CompatGenerateRequest,
     p.GenerateResponse),
    ("post", "/generate", "Generate tokens", p.GenerateRequest, p.GenerateResponse),
    ("post", "/generate_stream", "Generate a stream of tokens (server-sent events)", p.GenerateRequest,
     p.StreamResponse),
    ("post", "/tokenize", "Tokenize inputs", p.TokenizeRequest, p.SimpleToken),
    ("post", "/v1/chat/completions", "OpenAI chat completions", p.ChatCompletionRequest, p.ChatCompletion),
    ("post", "/v1/completions", "OpenAI completions", p.CompletionRequest, p.Completion),
    ("get", "/v1/models", "Served model", None, p.ModelList),
    ("get", "/info", "Model and server limits", None, p.Info),
    ("get", "/health", "200 when a one-token generation succeeds, 503 otherwise", None, None),
    ("get", "/metrics", "Prometheus metrics (text format)", None, "text/plain"),
]

_MODELS: list[type[BaseModel]] = [
    p.GenerateRequest, p.CompatGenerateRequest, p.TokenizeRequest, p.GenerateResponse, p.StreamResponse,
    p.SimpleToken, p.ErrorResponse, p.Info, p.ChatCompletionRequest, p.ChatCompletion, p.ChatCompletionChunk,
    p.CompletionRequest, p.Completion, p.ModelList,
]


@functools.cache
def build_spec(version: str) -> dict[str, Any]:
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, request, response in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": _ok(response, path)}}
        if request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
            op["responses"].update({code: _error(desc) for code, desc in _ERRORS.items()})
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "tgi-hpc engine", "version": version,
                     "description": "Text Generation Inference compatible API, plus OpenAI chat/completions."},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _ok(response: Any, path: str) -> dict[str, Any]:
    if response is None:
        return {"description": "OK"}
    if isinstance(response, str):
        return {"description": "OK", "content": {response: {"schema": {"type": "string"}}}}
    media = "text/event-stream" if path == "/generate_stream" else "application/json"
    return {"description": "OK", "content": {media: {"schema": _ref(response)}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(p.ErrorResponse)}}}


async def spec(request: Request) -> Response:
    return JSONResponse(build_spec(request.app.state.server.info.version))


_DOCS = """<!doctype html>
<html><head><meta charset="utf-8"><title>tgi-hpc engine API</title>
<link rel="stylesheet" href="https://unpkg.com/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"><p>The OpenAPI description is at <a href="/api-doc/openapi.json">/api-doc/openapi.json</a>
(this page loads Swagger UI from unpkg.com).</p></div>
<script src="https://unpkg.com/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>window.onload = () => SwaggerUIBundle({url: "/api-doc/openapi.json", dom_id: "#ui"});</script>
</body></html>
"""


async def docs(request: Request) -> Response:
    return HTMLResponse(_DOCS)
