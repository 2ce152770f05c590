"""build_app(): the Starlette app with TGI's routes (router/src/server.rs) plus the OpenAI ones."""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import lora_routes, messages, openai_routes, openapi, pooling_routes, responses, sse
from engine.server.reasoning import reasoning_format
from engine.server.response_store import ResponseStore
from engine.server.routing import ExactRoute
from engine.server.auth import ApiKeyMiddleware
from engine.server.errors import EXCEPTION_HANDLERS, UnhealthyError, ValidationError
from engine.server.grammar import prepare_grammars
from engine.structured import spec
from engine.server.infer import Generation, Infer, StreamEvent
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.openai_requests import prefetch_images
from engine.server.protocol import (BestOfSequence, CompatGenerateRequest, Details, GenerateRequest,
                                    GenerateResponse, Info, PrefillToken, SimpleToken, StreamDetails,
                                    StreamResponse, Token, TokenizeRequest, dump)
from engine.server.state import ServerState
from engine.server.streaming import open_stream, unless_disconnected
from engine.server.validation import Limits, ValidRequest, Validator, parse_body

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, config: EngineConfig) -> Starlette:
    state = _build_state(engine, config)
    spec.LIMITS.max_bytes, spec.LIMITS.timeout_s = config.max_grammar_bytes, config.grammar_timeout_s
    # every path answers exactly the methods /api-doc/openapi.json declares; others get 405
    routes = [
        ExactRoute("/", compat_generate, methods=["POST"]),
        ExactRoute("/generate", generate, methods=["POST"]),
        ExactRoute("/generate_stream", generate_stream, methods=["POST"]),
        ExactRoute("/tokenize", tokenize, methods=["POST"]),
        ExactRoute("/health", health, methods=["GET"]),
        ExactRoute("/info", info, methods=["GET"]),
        ExactRoute("/metrics", metrics, methods=["GET"]),
        ExactRoute("/docs", openapi.docs, methods=["GET"]),
        ExactRoute("/api-doc/openapi.json", openapi.spec, methods=["GET"]),
        *openai_routes.ROUTES,
        *pooling_routes.ROUTES,
        ExactRoute("/v1/messages", messages.messages, methods=["POST"]),
        ExactRoute("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        ExactRoute("/v1/responses", responses.create_response, methods=["POST"]),
        ExactRoute("/v1/load_lora_adapter", lora_routes.load_lora_adapter, methods=["POST"]),
        ExactRoute("/v1/unload_lora_adapter", lora_routes.unload_lora_adapter, methods=["POST"]),
    ]
    routes = pooling_routes.guard(routes, pooling_routes.task_of(state))  # one engine serves one task
    middleware = [Middleware(CORSMiddleware, allow_origins=list(config.cors_allow_origin), allow_methods=["*"],
                             allow_headers=["*"])] if config.cors_allow_origin else []
    if config.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers=EXCEPTION_HANDLERS)  # type: ignore[arg-type]
    app.state.server = state
    app.state.responses = ResponseStore()      # previous_response_id's conversations, bounded
    app.state.runtime_lora = _runtime_lora(engine, config)
    return app


def _runtime_lora(engine: AsyncEngine, config: EngineConfig) -> Any:
    """--enable-runtime-lora: the engine's adapter slots, loaded and unloaded through /v1/*_lora_adapter."""
    if not config.enable_runtime_lora or not hasattr(engine.engine, "adapter_in_use"):
        return None
    from engine.lora.runtime import RuntimeAdapters
    return RuntimeAdapters(engine.engine, config.served_model_name or config.model_id, config.max_lora_rank)


def _build_state(engine: AsyncEngine, config: EngineConfig) -> ServerState:
    llm = engine.engine
    limits = Limits(max_best_of=config.max_best_of, max_stop_sequences=config.max_stop_sequences,
                    max_top_n_tokens=config.max_top_n_tokens, max_input_tokens=llm.max_input_tokens,
                    max_total_tokens=llm.max_total_tokens, max_new_tokens_default=config.max_new_tokens_default,
                    vocab_size=getattr(llm, "vocab_size", None))
    metrics = ServerMetrics(engine.stats)
    validator = Validator(llm.tokenizer, limits, tuple(name for name, _ in config.lora_adapters),
                          config.served_model_name or config.model_id)
    thinks = reasoning_format(config.reasoning_parser, getattr(llm.tokenizer, "chat_template", None))
    validator.skip_special_tokens = thinks is None or thinks.name != "gpt_oss"   # harmony's markers are special
    model_config = getattr(llm, "model_config", None)
    if getattr(model_config, "image_token_id", None) is not None:
        validator.vision = vision_processor(model_config, config)
    elif hasattr(model_config, "text_only_reason"):
        validator.text_only = model_config.text_only_reason()
    grammars = getattr(llm, "grammars", None)
    if grammars is not None:    # the token table is checked (and a refusal logged) at start-up
        grammars.prepare_in_background()
        validator.grammar_unavailable = lambda: grammars.unavailable
    return ServerState(engine=engine, config=config, tokenizer=llm.tokenizer, validator=validator,
                       infer=Infer(engine, metrics, config.max_concurrent_requests),
                       metrics=metrics, info=_build_info(llm, config))


def vision_processor(model_config: Any, config: EngineConfig) -> Any:
    """The model's own processor under the server's image limits (a vision-language model)."""
    from engine.multimodal.image_source import ImageLimits
    from engine.multimodal.processor import VisionProcessor

    limits = ImageLimits(max_bytes=config.max_image_bytes, fetch_timeout_s=config.image_fetch_timeout_s,
                         fetch_urls=config.image_fetch == "allow")
    return VisionProcessor.from_pretrained(model_config.source, model_config.image_token_id, limits,
                                           config.max_images_per_request)


def _build_info(llm: Any, config: EngineConfig) -> Info:
    stats = llm.stats()
    runner = getattr(llm, "runner", llm)  # LLMEngine keeps dtype/device on its model runner
    try:
        version = importlib.metadata.version("tgi-hpc")
    except importlib.metadata.PackageNotFoundError:
        version = "0.1.0"
    return Info(
        model_id=config.served_model_name or config.model_id,
        model_sha=config.revision, model_dtype=str(getattr(runner, "dtype", None) or config.dtype),
        model_device_type=str(getattr(getattr(runner, "device", None), "type", None) or config.device or "cpu"),
        max_concurrent_requests=config.max_concurrent_requests, max_best_of=config.max_best_of,
        max_stop_sequences=config.max_stop_sequences, max_input_tokens=llm.max_input_tokens,
        max_total_tokens=llm.max_total_tokens, max_top_n_tokens=config.max_top_n_tokens,
        max_batch_prefill_tokens=llm.max_batch_prefill_tokens, max_batch_total_tokens=llm.max_batch_total_tokens,
        num_shard=config.num_shard, attention_backend=str(stats.attention_backend),
        attention_checks=dict(getattr(runner, "attention_checks", {})),
        linear_backend=str(getattr(runner, "linear_backend", "unknown")),
        elementwise_backend=str(getattr(runner, "elementwise_backend", "unknown")),
        decode_step=str(getattr(runner, "decode_step_report", "eager")),
        sampler_backend=str(getattr(llm, "sampler_backend", "torch")),
        quant_kernels=dict(getattr(runner, "quant_checks", {})),
        model_impl=str(getattr(getattr(llm, "model_config", None), "impl", "native")),
        cuda_graphs=list(getattr(runner, "cuda_graph_sizes", [])),
        piecewise_graphs=list(getattr(runner, "piecewise_graph_sizes", [])), block_size=stats.block_size,
        async_scheduling=bool(getattr(llm, "schedules_ahead", False)),
        lora_adapters=[name for name, _ in config.lora_adapters],
        lora_backend=str(getattr(runner, "lora_backend", "none")), lora_checks=dict(getattr(runner, "lora_checks", {})),
        speculate=config.speculate,
        grammar_backend=f"llguidance {importlib.metadata.version('llguidance')}", version=version,
        max_new_tokens_default=config.max_new_tokens_default, prefix_caching=config.prefix_caching,
        **_task_info(llm, config))


def _task_info(llm: Any, config: EngineConfig) -> dict[str, Any]:
    """What /info says about the task: generation, or a pooling model's (engine/pooling/)."""
    spec = getattr(llm, "spec", None)
    if spec is None:
        return {"task": "generate"}
    return {"task": spec.task, "model_pipeline_tag": spec.pipeline_tag, "pooling": spec.pooling,
            "max_client_batch_size": config.max_client_batch_size}


def server_state(request: Request) -> ServerState:
    return request.app.state.server  # type: ignore[no-any-return]


# --- TGI routes ---------------------------------------------------------------------------------

async def generate(request: Request) -> Response:
    state = server_state(request)
    with state.request() as arrival, state.infer.permit():
        body = await request.body()
        await prepare_grammars(body, state.engine)   # before parsing: a huge schema is refused unparsed
        req = parse_body(GenerateRequest, body)
        await prefetch_images(state, req.inputs)
        return await unless_disconnected(request, _generate(state, req, arrival, wrap_in_list=False))


async def generate_stream(request: Request) -> Response:
    state = server_state(request)
    with state.request() as arrival:
        body = await request.body()
        await prepare_grammars(body, state.engine)   # before parsing: a huge schema is refused unparsed
        req = parse_body(GenerateRequest, body)
        await prefetch_images(state, req.inputs)
        return _generate_stream(state, req, arrival)


async def compat_generate(request: Request) -> Response:
    state = server_state(request)
    with state.request() as arrival:
        body = await request.body()
        await prepare_grammars(body, state.engine)   # before parsing: a huge schema is refused unparsed
        req = parse_body(CompatGenerateRequest, body)
        await prefetch_images(state, req.inputs)
        if req.stream:
            return _generate_stream(state, req, arrival)
        with state.infer.permit():
            # api-inference returns a list
            return await unless_disconnected(request, _generate(state, req, arrival, wrap_in_list=True))


async def _generate(state: ServerState, req: GenerateRequest, arrival: float, wrap_in_list: bool) -> Response:
    valid = state.validator.validate(req)
    gen, others = await state.infer.generate(valid, arrival)
    prefix = valid.inputs if valid.return_full_text else ""
    details = None
    if valid.details:
        details = Details(finish_reason=gen.finish_reason, generated_tokens=gen.generated_tokens,
                          seed=gen.seed, prefill=_prefill(gen, valid), tokens=[_token(t) for t in gen.tokens],
                          top_tokens=_top_tokens(gen, valid),
                          best_of_sequences=[_best_of(g, valid, prefix) for g in others] or None)
    body = dump(GenerateResponse(generated_text=prefix + gen.tgi_text, details=details))
    if details is None:  # TGI leaves the key out
        del body["details"]
    headers = _timing_headers(gen, len(valid.inputs), state.info.model_device_type)
    return JSONResponse([body] if wrap_in_list else body, headers=headers)


def _generate_stream(state: ServerState, req: GenerateRequest, arrival: float) -> Response:
    def render(ev: StreamEvent, valid: ValidRequest) -> list[bytes]:
        response = _stream_response(ev, valid)   # TGI leaves an empty top_tokens out (as `dump` does)
        return [sse.encode_model(response)]
    return open_stream(state, req, arrival, render)


def _stream_response(ev: StreamEvent, valid: ValidRequest) -> StreamResponse:
    token = Token(id=ev.token.id, text=ev.text, logprob=ev.token.logprob, special=ev.token.special)
    details = generated_text = None
    if ev.end is not None:
        generated_text = (valid.inputs if valid.return_full_text else "") + ev.end.tgi_text
        if valid.details:
            details = StreamDetails(finish_reason=ev.end.finish_reason, generated_tokens=ev.end.generated_tokens,
                                    seed=ev.end.seed, input_length=ev.end.input_length)
    return StreamResponse(index=ev.index, token=token, top_tokens=[_token(t) for t in ev.token.top_tokens],
                          generated_text=generated_text, details=details)


def _token(t: Any) -> Token:
    return Token(id=t.id, text=t.text, logprob=t.logprob, special=t.special)


def _prefill(gen: Generation, valid: ValidRequest) -> list[PrefillToken]:
    if not valid.decoder_input_details:
        return []
    return [PrefillToken(id=t.id, text=t.text, logprob=t.logprob) for t in gen.prefill]


def _top_tokens(gen: Generation, valid: ValidRequest) -> list[list[Token]] | None:
    if not valid.params.top_n_tokens:
        return None
    return [[_token(t) for t in tok.top_tokens] for tok in gen.tokens]


def _best_of(gen: Generation, valid: ValidRequest, prefix: str) -> BestOfSequence:
    return BestOfSequence(generated_text=prefix + gen.tgi_text, finish_reason=gen.finish_reason,
                          generated_tokens=gen.generated_tokens, seed=gen.seed, prefill=_prefill(gen, valid),
                          tokens=[_token(t) for t in gen.tokens], top_tokens=_top_tokens(gen, valid))


def _timing_headers(gen: Generation, num_chars: int, device_type: str) -> dict[str, str]:
    t = gen.timings
    ms = lambda s: str(int(s * 1000))  # noqa: E731
    return {
        "x-compute-type": "gpu+optimized" if device_type == "cuda" else device_type,
        "x-compute-time": f"{t.total_s:.6f}", "x-compute-characters": str(num_chars),
        "x-total-time": ms(t.total_s), "x-validation-time": ms(t.validation_s), "x-queue-time": ms(t.queue_s),
        "x-inference-time": ms(t.inference_s),
        "x-time-per-token": ms(t.inference_s / max(gen.generated_tokens, 1)),
        "x-prompt-tokens": str(gen.input_length), "x-generated-tokens": str(gen.generated_tokens),
    }


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(TokenizeRequest, await request.body())
    if not req.inputs:
        raise ValidationError("`inputs` cannot be empty")
    enc = state.tokenizer(req.inputs, add_special_tokens=True, return_offsets_mapping=True)
    tokens = [SimpleToken(id=i, text=req.inputs[a:b], start=a, stop=b)
              for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]
    return JSONResponse([t.model_dump() for t in tokens])


# --- service routes -----------------------------------------------------------------------------

async def health(request: Request) -> Response:
    if not await server_state(request).engine.check_health():
        raise UnhealthyError()
    return Response(status_code=200)


async def info(request: Request) -> Response:
    return JSONResponse(server_state(request).info.model_dump())


async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
