"""Pooling routes: OpenAI /v1/embeddings, TEI's /embed /rerank /predict, /v1/rerank (Cohere/Jina) and /v1/score.

Each input becomes one engine request (token ids, plus token types for a cross-encoder pair); the engine
(engine/pooling/engine.py) batches them and answers the pooled vector or the logits, and normalization,
Matryoshka `dimensions`, scores and ordering are done here. A route the served model cannot answer is a 422
that names the routes it does serve, both ways (`guard` wraps the generation routes of a pooling server).
"""
from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from engine.async_engine import EngineDeadError, RequestFailedError
from engine.pooling.engine import PoolingParams
from engine.pooling.pooler import normalize
from engine.pooling.spec import resolve_prompt
from engine.server.errors import GenerationError, ValidationError
from engine.server.infer import _gather_or_cancel
from engine.server.pooling_protocol import (CohereRerankRequest, CohereRerankResponse, EmbeddingData, EmbeddingRequest,
                                            EmbeddingResponse, EmbedRequest, PoolingUsage, Prediction, PredictRequest,
                                            Rank, RerankDocument, RerankRequest, RerankResult, RerankUsage, ScoreData,
                                            ScoreRequest, ScoreResponse)
from engine.server.protocol import dump
from engine.server.routing import ExactRoute
from engine.server.state import ServerState
from engine.server.streaming import unless_disconnected
from engine.server.validation import parse_body

GENERATION_PATHS = ("/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions",
                    "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
GENERATION_ROUTES = "/generate, /generate_stream, /v1/completions or /v1/chat/completions"
DEFAULT_MAX_CLIENT_BATCH = 2048   # inputs per request (OpenAI's limit); --max-client-batch-size


def task_of(state: ServerState) -> str:
    return str(getattr(state.engine.engine, "task", "generate"))


def _state(request: Request) -> ServerState:
    return request.app.state.server  # type: ignore[no-any-return]


def _need(state: ServerState, route: str, *tasks: str) -> Any:
    """The pooling engine, when it serves one of `tasks`; else a 422 naming the routes it does serve."""
    llm = state.engine.engine
    task = task_of(state)
    if task in tasks:
        return llm
    wanted = " or ".join({"embed": "an embedding", "classify": "a cross-encoder or classifier"}[t] for t in tasks)
    if task == "generate":
        serves = f"it serves text generation: use {GENERATION_ROUTES}"
    else:
        serves = f"it serves {task}: use {', '.join(llm.spec.routes())}"
    raise ValidationError(f"{route} needs {wanted} model, and {state.model_name!r} is not one; {serves}")


# --- inputs -> token ids --------------------------------------------------------------------------

def _texts(value: str | list[str], field: str, limit: int) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise ValidationError(f"`{field}` cannot be empty")
    if len(texts) > limit:
        raise ValidationError(f"`{field}` has {len(texts)} inputs, more than the {limit} a request may have")
    for i, text in enumerate(texts):
        if not text:
            raise ValidationError(f"`{field}[{i}]` is an empty string" if len(texts) > 1 else f"`{field}` is empty")
    return texts


def _limit(state: ServerState) -> int:
    return int(getattr(state.config, "max_client_batch_size", DEFAULT_MAX_CLIENT_BATCH))


def _tokenize(state: ServerState, field: str, first: list[str], second: list[str] | None = None, *,
              truncate: bool = False, direction: str = "right", max_length: int | None = None,
              ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids (and token types for pairs) with special tokens; too long without truncation is a 422."""
    llm = state.engine.engine
    limit = llm.max_input_tokens
    length = min(max_length, limit) if max_length else limit
    if llm.spec.do_lower_case:
        first = [t.lower() for t in first]
        second = [t.lower() for t in second] if second is not None else None
    tok = state.tokenizer
    side = tok.truncation_side
    tok.truncation_side = direction.lower()  # the HTTP thread alone tokenizes, one request at a time
    try:
        enc = tok(first, second, add_special_tokens=True, truncation=truncate or bool(max_length),
                  max_length=length if truncate or max_length else None, return_token_type_ids=second is not None)
    finally:
        tok.truncation_side = side
    ids = [list(x) for x in enc["input_ids"]]
    for i, seq in enumerate(ids):
        if len(seq) > limit:
            raise ValidationError(f"`{field}[{i}]` has {len(seq)} tokens, more than the {limit} this model takes; "
                                  "shorten it or set `truncate` (`truncate_prompt_tokens` on the OpenAI routes)")
        if not seq:
            raise ValidationError(f"`{field}[{i}]` has no tokens")
    types = [list(x) for x in enc["token_type_ids"]] if second is not None and "token_type_ids" in enc else None
    return ids, types


def _token_arrays(state: ServerState, value: list[int] | list[list[int]], limit: int) -> list[list[int]]:
    seqs = [value] if value and isinstance(value[0], int) else list(value)  # type: ignore[list-item]
    if not seqs:
        raise ValidationError("`input` cannot be empty")
    if len(seqs) > limit:
        raise ValidationError(f"`input` has {len(seqs)} inputs, more than the {limit} a request may have")
    llm = state.engine.engine
    for i, seq in enumerate(seqs):
        if len(seq) > llm.max_input_tokens:
            raise ValidationError(f"`input[{i}]` has {len(seq)} tokens, more than the {llm.max_input_tokens} "
                                  "this model takes")
        if max(seq) >= llm.vocab_size:
            raise ValidationError(f"`input[{i}]` has token id {max(seq)}, outside the vocabulary "
                                  f"(0..{llm.vocab_size - 1})")
    return seqs  # type: ignore[return-value]


def _with_prompt(state: ServerState, texts: list[str], prompt_name: str | None,
                 input_type: str | None = None) -> tuple[list[str], int]:
    """The texts with the prompt sentence-transformers would put first (engine/pooling/spec.resolve_prompt), and
    how many leading tokens the pooling leaves out (the prompt's, without a trailing special token, when the
    model's Pooling has include_prompt: false; else 0)."""
    spec = state.engine.engine.spec
    try:
        prompt = resolve_prompt(spec, prompt_name, input_type)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    if not prompt:
        return texts, 0
    skip = 0
    if not spec.include_prompt:
        tok = state.tokenizer
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        skip = len(ids) - (1 if ids and ids[-1] in set(tok.all_special_ids) else 0)
    return [prompt + t for t in texts], skip


def _prompt_tokens(n: int | None, limit: int) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the last N tokens (-1: as many as the model takes)."""
    if n is None:
        return None
    if n == 0:
        raise ValidationError("`truncate_prompt_tokens` must be >= 1, or -1 for the model's limit")
    if n > limit:
        raise ValidationError(f"`truncate_prompt_tokens` must be <= {limit} (the model's limit). Given: {n}")
    return limit if n == -1 else n


# --- running ----------------------------------------------------------------------------------------

async def _run(state: ServerState, seqs: list[list[int]], types: list[list[int]] | None = None,
               skip: int = 0) -> torch.Tensor:
    """One engine request per sequence, all at once; the rows in order."""
    async def one(ids: list[int], tt: list[int] | None) -> torch.Tensor:
        async for out in state.engine.generate(f"pool-{uuid.uuid4().hex}", ids, PoolingParams(tt, skip)):
            if out.finished:
                return out.data
        raise GenerationError("the engine ended the request without a result")

    try:
        rows = await _gather_or_cancel([one(s, types[i] if types else None) for i, s in enumerate(seqs)])
    except (RequestFailedError, EngineDeadError) as exc:
        raise GenerationError(str(exc)) from None
    return torch.stack(rows)


async def _admitted(request: Request, work: Callable[[ServerState], Awaitable[Response]]) -> Response:
    state = _state(request)
    with state.request(), state.infer.permit():
        return await unless_disconnected(request, work(state))


def _vectors(pooled: torch.Tensor, norm: bool, dimensions: int | None) -> torch.Tensor:
    if dimensions is not None:
        if dimensions > pooled.shape[-1]:
            raise ValidationError(f"`dimensions` must be <= {pooled.shape[-1]} (the model's). Given: {dimensions}")
        pooled = pooled[:, :dimensions]
    return normalize(pooled) if norm else pooled


def _scores(logits: torch.Tensor, raw: bool) -> torch.Tensor:
    """Single-label cross-encoders: sigmoid (sentence-transformers' CrossEncoder default); else softmax."""
    if raw:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


async def _pair_scores(state: ServerState, route: str, queries: list[str], docs: list[str], truncate: bool,
                       direction: str = "right", max_length: int | None = None,
                       raw: bool = False) -> tuple[list[float], int]:
    """Relevance of each (query, doc): a cross-encoder's score, or the cosine of an embedder's vectors."""
    llm = _need(state, route, "classify", "embed")
    if llm.task == "classify":
        if llm.spec.num_labels != 1:
            raise ValidationError(f"{route} needs a single-label cross-encoder; this one has {llm.spec.num_labels} "
                                  "labels: use /predict")
        ids, types = _tokenize(state, "documents", queries, docs, truncate=truncate, direction=direction,
                               max_length=max_length)
        logits = await _run(state, ids, types)
        return _scores(logits, raw)[:, 0].tolist(), sum(map(len, ids))
    # an embedder: queries as encode_query, documents as encode_document (their prompts, if the model has them)
    vectors, tokens = [], 0
    for kind, texts in (("query", list(dict.fromkeys(queries))), ("document", list(dict.fromkeys(docs)))):
        prompted, skip = _with_prompt(state, texts, None, kind)
        ids, _ = _tokenize(state, "documents", prompted, truncate=truncate, direction=direction,
                           max_length=max_length)
        vectors.append(dict(zip(texts, normalize(await _run(state, ids, skip=skip)))))
        tokens += sum(map(len, ids))
    scores = [float(vectors[0][q] @ vectors[1][d]) for q, d in zip(queries, docs)]
    return scores, tokens


# --- OpenAI /v1/embeddings -----------------------------------------------------------------------

def embedding_inputs(state: ServerState, req: EmbeddingRequest) -> tuple[list[list[int]], int]:
    """The token ids of each input of an embeddings request, and how many leading prompt tokens the pooling
    leaves out (include_prompt: false); a 422 when the model embeds nothing, or an input is empty, too long or
    out of the vocabulary. Offline batches call it too (engine/offline/requests.py)."""
    llm = _need(state, "/v1/embeddings", "embed")
    limit = _limit(state)
    if isinstance(req.input, str) or (req.input and isinstance(req.input[0], str)):
        texts, skip = _with_prompt(state, _texts(req.input, "input", limit),  # type: ignore[arg-type]
                                   req.prompt_name, req.input_type)
        max_length = _prompt_tokens(req.truncate_prompt_tokens, llm.max_input_tokens)
        seqs, _ = _tokenize(state, "input", texts, truncate=req.truncate and max_length is None,
                            direction="left" if max_length else "right", max_length=max_length)
        return seqs, skip
    return _token_arrays(state, req.input, limit), 0  # type: ignore[arg-type]  # token ids: no prompt


def embedding_response(state: ServerState, req: EmbeddingRequest, pooled: torch.Tensor,
                       seqs: list[list[int]]) -> EmbeddingResponse:
    """The body of /v1/embeddings from the pooled rows of `embedding_inputs(req)`, in order."""
    llm = state.engine.engine
    vectors = _vectors(pooled, llm.spec.normalize or req.dimensions is not None, req.dimensions)
    data = [EmbeddingData(index=i, embedding=_b64(v) if req.encoding_format == "base64" else v.tolist())
            for i, v in enumerate(vectors)]
    tokens = sum(map(len, seqs))
    return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=int(time.time()),
                             model=req.model or state.model_name, data=data,
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def embeddings(request: Request) -> Response:
    async def work(state: ServerState) -> Response:
        req = parse_body(EmbeddingRequest, await request.body())
        seqs, skip = embedding_inputs(state, req)
        return JSONResponse(dump(embedding_response(state, req, await _run(state, seqs, skip=skip), seqs)))
    return await _admitted(request, work)


def _b64(vector: torch.Tensor) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


# --- TEI ---------------------------------------------------------------------------------------------

async def embed(request: Request) -> Response:
    async def work(state: ServerState) -> Response:
        req = parse_body(EmbedRequest, await request.body())
        _need(state, "/embed", "embed")
        texts, skip = _with_prompt(state, _texts(req.inputs, "inputs", _limit(state)), req.prompt_name,
                                   req.input_type)
        seqs, _ = _tokenize(state, "inputs", texts, truncate=bool(req.truncate), direction=req.truncation_direction)
        vectors = _vectors(await _run(state, seqs, skip=skip), req.normalize, req.dimensions)
        return JSONResponse(vectors.tolist())
    return await _admitted(request, work)


async def rerank(request: Request) -> Response:
    async def work(state: ServerState) -> Response:
        req = parse_body(RerankRequest, await request.body())
        _need(state, "/rerank", "classify")
        query = _texts(req.query, "query", 1)[0]
        docs = _texts(req.texts, "texts", _limit(state))
        scores, _ = await _pair_scores(state, "/rerank", [query] * len(docs), docs, bool(req.truncate),
                                       req.truncation_direction, raw=req.raw_scores)
        ranks = [Rank(index=i, score=s, text=docs[i] if req.return_text else None) for i, s in enumerate(scores)]
        ranks.sort(key=lambda r: -r.score)
        return JSONResponse([r.model_dump(exclude_none=True) for r in ranks])
    return await _admitted(request, work)


async def predict(request: Request) -> Response:
    async def work(state: ServerState) -> Response:
        req = parse_body(PredictRequest, await request.body())
        llm = _need(state, "/predict", "classify")
        single = isinstance(req.inputs, str) or all(isinstance(x, str) for x in req.inputs)
        items: list[Any] = [req.inputs] if single else list(req.inputs)
        if not items or len(items) > _limit(state):
            raise ValidationError(f"`inputs` must hold 1 to {_limit(state)} inputs")
        pairs = [[x] if isinstance(x, str) else list(x) for x in items]
        if any(len(p) not in (1, 2) for p in pairs):
            raise ValidationError("`inputs`: each input is a text or a [text, text_pair] pair")
        if len({len(p) for p in pairs}) != 1:
            raise ValidationError("`inputs`: a batch holds only texts or only pairs")
        first = _texts([p[0] for p in pairs], "inputs", len(pairs))
        second = _texts([p[1] for p in pairs], "inputs", len(pairs)) if len(pairs[0]) == 2 else None
        ids, types = _tokenize(state, "inputs", first, second, truncate=bool(req.truncate),
                               direction=req.truncation_direction)
        scores = _scores(await _run(state, ids, types), req.raw_scores)
        labels = llm.spec.id2label
        out = [sorted(({"score": float(s), "label": labels.get(j, f"LABEL_{j}")} for j, s in enumerate(row)),
                      key=lambda p: -p["score"]) for row in scores]
        body = [[Prediction(**p).model_dump() for p in row] for row in out]
        return JSONResponse(body[0] if single else body)
    return await _admitted(request, work)


# --- Cohere / Jina rerank and vLLM score ---------------------------------------------------------------

async def rerank_v1(request: Request) -> Response:
    async def work(state: ServerState) -> Response:
        req = parse_body(CohereRerankRequest, await request.body())
        llm = _need(state, "/v1/rerank", "classify", "embed")
        query = _texts(req.query, "query", 1)[0]
        docs = _texts([d if isinstance(d, str) else d.text for d in req.documents], "documents", _limit(state))
        max_length = _prompt_tokens(req.truncate_prompt_tokens, llm.max_input_tokens)
        scores, tokens = await _pair_scores(state, "/v1/rerank", [query] * len(docs), docs, False, "left",
                                            max_length)
        results = sorted((RerankResult(index=i, relevance_score=s,
                                       document=RerankDocument(text=docs[i]) if req.return_documents else None)
                          for i, s in enumerate(scores)), key=lambda r: -r.relevance_score)
        results = results[:req.top_n] if req.top_n else results
        return JSONResponse(dump(CohereRerankResponse(id=f"rerank-{uuid.uuid4().hex}",
                                                      model=req.model or state.model_name,
                                                      usage=RerankUsage(total_tokens=tokens), results=results)))
    return await _admitted(request, work)


async def score(request: Request) -> Response:
    async def work(state: ServerState) -> Response:
        req = parse_body(ScoreRequest, await request.body())
        llm = _need(state, "/v1/score", "classify", "embed")
        limit = _limit(state)
        left, right = _texts(req.text_1, "text_1", limit), _texts(req.text_2, "text_2", limit)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ValidationError(f"`text_1` has {len(left)} texts and `text_2` {len(right)}: give one `text_1`, "
                                  "or as many as `text_2`")
        max_length = _prompt_tokens(req.truncate_prompt_tokens, llm.max_input_tokens)
        scores, tokens = await _pair_scores(state, "/v1/score", left, right, False, "left", max_length)
        return JSONResponse(dump(ScoreResponse(
            id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=req.model or state.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))))
    return await _admitted(request, work)


ROUTES: list[BaseRoute] = [
    ExactRoute("/v1/embeddings", embeddings, methods=["POST"]),
    ExactRoute("/embed", embed, methods=["POST"]),
    ExactRoute("/rerank", rerank, methods=["POST"]),
    ExactRoute("/predict", predict, methods=["POST"]),
    ExactRoute("/v1/rerank", rerank_v1, methods=["POST"]),
    ExactRoute("/v1/score", score, methods=["POST"]),
]


def guard(routes: list[BaseRoute], task: str) -> list[BaseRoute]:
    """For a pooling model: its generation routes answer a 422 naming the routes it serves, except `POST /`,
    which is TEI's route for the model's own task (embed, or predict for a classifier)."""
    if task == "generate":
        return routes
    guarded: list[BaseRoute] = []
    for route in routes:
        path = getattr(route, "path", None)
        if path == "/":
            guarded.append(ExactRoute("/", embed if task == "embed" else predict, methods=["POST"]))
        elif path in GENERATION_PATHS:
            guarded.append(ExactRoute(path, _wrong_task, methods=sorted(getattr(route, "methods", ["POST"]))))
        else:
            guarded.append(route)
    return guarded


async def _wrong_task(request: Request) -> Response:
    state = _state(request)
    with state.request():
        llm = state.engine.engine
        kind = "an embedding" if llm.task == "embed" else "a cross-encoder / classifier"
        raise ValidationError(f"{request.url.path} needs a text-generation model, and {state.model_name!r} is "
                              f"{kind} model: use {', '.join(llm.spec.routes())}")
