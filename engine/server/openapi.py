"""OpenAPI 3.1 description of the routes, built from the wire models' JSON schemas, and a /docs page."""
from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from engine.server import pooling_protocol as pp
from engine.server import anthropic_protocol as a
from engine.server import protocol as p
from engine.server import responses_protocol as r

_REF = "#/components/schemas/{model}"
_GENERATION_ERRORS = {
    "422": "Input validation error", "424": "Generation error", "429": "Model is overloaded",
    "500": "Incomplete generation", "401": "Missing or wrong API key (when the server has one)",
}
JSON, SSE = "application/json", "text/event-stream"
_POOLING_ERRORS = {"422": "Input validation error, or a model of another task (the message names its routes)",
                   "424": "Inference error", "429": "Model is overloaded", "401": _GENERATION_ERRORS["401"]}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _list_of(model: type[BaseModel]) -> dict[str, Any]:
    return {"type": "array", "items": _ref(model)}


def _events_of(model: type[BaseModel], done: bool = False) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.2's itemSchema layout): `data` is `model` as JSON text, or, as the last
    event, an ErrorResponse when the stream fails; OpenAI streams (`done`) end with `[DONE]`."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": JSON,
                            "contentSchema": {"anyOf": [_ref(model), _ref(p.ErrorResponse)]}}
    if done:
        data = {"anyOf": [data, {"const": "[DONE]"}]}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}, "data": data}}


_LORA_ERRORS = {"404": "Runtime LoRA is off (start with --enable-runtime-lora)",
                "422": "Refused: files, shapes, name, rank or no free slot", "401": "Missing or wrong API key"}

# (method, path, summary, request model, {media type: response schema (a model, or a JSON schema)}, error codes)
_ROUTES: list[tuple[str, str, str, type[BaseModel] | None, dict[str, Any], dict[str, str]]] = [
    ("post", "/", "Generate; `stream: true` answers server-sent events, otherwise a one-element list",
     p.CompatGenerateRequest, {JSON: _list_of(p.GenerateResponse), SSE: _events_of(p.StreamResponse)},
     _GENERATION_ERRORS),
    ("post", "/generate", "Generate tokens", p.GenerateRequest, {JSON: p.GenerateResponse}, _GENERATION_ERRORS),
    ("post", "/generate_stream", "Generate a stream of tokens (server-sent events)", p.GenerateRequest,
     {SSE: _events_of(p.StreamResponse)}, _GENERATION_ERRORS),
    ("post", "/tokenize", "Tokenize inputs", p.TokenizeRequest, {JSON: _list_of(p.SimpleToken)},
     {"422": "Input validation error", "401": _GENERATION_ERRORS["401"]}),
    ("post", "/v1/chat/completions", "OpenAI chat completions (`stream: true`: chunks as server-sent events)",
     p.ChatCompletionRequest, {JSON: p.ChatCompletion, SSE: _events_of(p.ChatCompletionChunk, done=True)},
     _GENERATION_ERRORS),
    ("post", "/v1/completions", "OpenAI completions (`stream: true`: chunks as server-sent events)",
     p.CompletionRequest, {JSON: p.Completion, SSE: _events_of(p.Completion, done=True)}, _GENERATION_ERRORS),
    ("post", "/v1/messages", "Anthropic Messages (`stream: true`: Anthropic's typed server-sent events); errors use "
     "Anthropic's body", a.MessagesRequest, {JSON: a.MessagesResponse, SSE: _events_of(a.MessageStreamEvent)},
     _GENERATION_ERRORS),
    ("post", "/v1/messages/count_tokens", "Anthropic Messages: the prompt's token count", a.CountTokensRequest,
     {JSON: a.CountTokensResponse}, {"422": "Input validation error", "401": _GENERATION_ERRORS["401"]}),
    ("post", "/v1/responses", "OpenAI Responses (`stream: true`: typed server-sent events); `previous_response_id` "
     "continues a stored response", r.ResponsesRequest,
     {JSON: r.ResponseObject, SSE: _events_of(r.ResponseStreamEvent)}, _GENERATION_ERRORS),
    ("post", "/v1/load_lora_adapter", "Load a PEFT LoRA adapter into a free slot (--enable-runtime-lora, else 404)",
     p.LoadLoraAdapterRequest, {"text/plain": {"type": "string"}}, _LORA_ERRORS),
    ("post", "/v1/unload_lora_adapter", "Unload a LoRA adapter once the requests on it have finished "
     "(--enable-runtime-lora, else 404)", p.UnloadLoraAdapterRequest, {"text/plain": {"type": "string"}},
     _LORA_ERRORS),
    ("get", "/v1/models", "Served model", None, {JSON: p.ModelList}, {"401": _GENERATION_ERRORS["401"]}),
    ("get", "/info", "Model and server limits", None, {JSON: p.Info}, {}),
    ("get", "/health", "200 when a one-token generation succeeds, 503 otherwise", None, {},
     {"503": "Unhealthy"}),
    ("get", "/metrics", "Prometheus metrics (text format)", None, {"text/plain": {"type": "string"}}, {}),
    ("get", "/docs", "Swagger UI page for this document", None, {"text/html": {"type": "string"}}, {}),
    ("get", "/api-doc/openapi.json", "This document", None, {JSON: {"type": "object"}}, {}),
    # pooling models (engine/pooling/): a generative model answers these with a 422 naming its routes
    ("post", "/v1/embeddings", "OpenAI embeddings (strings or token ids, `dimensions`, base64)", pp.EmbeddingRequest,
     {JSON: pp.EmbeddingResponse}, _POOLING_ERRORS),
    ("post", "/embed", "TEI: one embedding per input", pp.EmbedRequest, {JSON: pp.EMBED_RESPONSE}, _POOLING_ERRORS),
    ("post", "/rerank", "TEI: texts ranked by a cross-encoder's score for the query", pp.RerankRequest,
     {JSON: _list_of(pp.Rank)}, _POOLING_ERRORS),
    ("post", "/predict", "TEI: a classifier's label scores for a text or a pair", pp.PredictRequest,
     {JSON: pp.PREDICT_RESPONSE}, _POOLING_ERRORS),
    ("post", "/v1/rerank", "Cohere/Jina rerank: documents by relevance (cross-encoder, or an embedder's cosine)",
     pp.CohereRerankRequest, {JSON: pp.CohereRerankResponse}, _POOLING_ERRORS),
    ("post", "/v1/score", "vLLM score: text_1 against each text_2 (cross-encoder, or an embedder's cosine)",
     pp.ScoreRequest, {JSON: pp.ScoreResponse}, _POOLING_ERRORS),
]

_MODELS: list[type[BaseModel]] = [
    p.GenerateRequest, p.CompatGenerateRequest, p.TokenizeRequest, p.GenerateResponse, p.StreamResponse,
    p.SimpleToken, p.ErrorResponse, p.Info, p.ChatCompletionRequest, p.ChatCompletion, p.ChatCompletionChunk,
    p.CompletionRequest, p.Completion, p.ModelList, p.LoadLoraAdapterRequest, p.UnloadLoraAdapterRequest,
    pp.EmbeddingRequest, pp.EmbeddingResponse, pp.EmbedRequest, pp.RerankRequest, pp.Rank, pp.PredictRequest,
    pp.Prediction, pp.CohereRerankRequest, pp.CohereRerankResponse, pp.ScoreRequest, pp.ScoreResponse,
    a.MessagesRequest, a.MessagesResponse, a.MessageStreamEvent, a.CountTokensRequest, a.CountTokensResponse,
    a.AnthropicErrorResponse, r.ResponsesRequest, r.ResponseObject, r.ResponseStreamEvent,
]


@functools.cache
def build_spec(version: str) -> dict[str, Any]:
    """Every route with its request schema, its success responses by media type and its error responses."""
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, request, ok, errors in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": _ok(ok)}}
        if request is not None:
            op["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(request)}}}
        op["responses"].update({code: _error(desc) for code, desc in errors.items()})
        if path.startswith("/v1/messages"):     # 401 comes from the auth middleware, in TGI's body
            op["responses"].update({code: _error(desc, a.AnthropicErrorResponse) for code, desc in errors.items()
                                    if code != "401"})
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "tgi-hpc engine", "version": version,
                     "description": "Text Generation Inference compatible API, plus OpenAI chat/completions. "
                                    "Each path answers only the methods listed here (others: 405)."},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}


def _ok(content: dict[str, Any]) -> dict[str, Any]:
    if not content:
        return {"description": "OK"}
    schemas = {media: _ref(s) if isinstance(s, type) else s for media, s in content.items()}
    return {"description": "OK", "content": {media: {"schema": schema} for media, schema in schemas.items()}}


def _error(description: str, model: type[BaseModel] = p.ErrorResponse) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(model)}}}


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
