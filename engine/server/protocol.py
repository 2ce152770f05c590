"""Wire types: TGI's names (router/src/lib.rs) and the OpenAI subset we serve. No engine types here."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

FinishReason = Literal["length", "eos_token", "stop_sequence"]
MAX_SEED = 2**64 - 1        # TGI's u64; torch.Generator.manual_seed takes no more


class _Wire(BaseModel):
    # unknown fields are ignored, as serde does for TGI's request types; no type coercion ("5" is not an int),
    # so the server accepts exactly what /api-doc/openapi.json declares
    model_config = ConfigDict(extra="ignore", strict=True)


def _min(value: int) -> Any:
    # declared in the schema, checked by the Validator with TGI's own message
    return {"minimum": value}


def _omitted_when_empty() -> Any:
    """A field TGI and OpenAI leave out of the JSON when it is empty or absent (`top_tokens`, `tool_calls`...):
    the rule lives on the field, so `dump` and `sse.encode_model` (pydantic-core's direct JSON) both follow it."""
    return Field(default=None, exclude_if=_empty)


def _empty(value: Any) -> bool:
    return not value


# --- TGI requests -------------------------------------------------------------------------------

class GenerateParameters(_Wire):
    best_of: int | None = Field(default=None, gt=0)
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = Field(default=None, ge=0, json_schema_extra=_min(1))
    return_full_text: bool | None = None
    stop: list[str] | None = Field(default_factory=list)   # null is [] (the validator below)
    truncate: int | None = Field(default=None, ge=0)
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    top_n_tokens: int | None = Field(default=None, ge=0)
    grammar: Any | None = None
    adapter_id: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _null_stop(cls, value: Any) -> Any:
        return [] if value is None else value


def _default_parameters() -> GenerateParameters:
    # TGI samples when a request has no `parameters` object at all (lib.rs default_parameters)
    return GenerateParameters(do_sample=True)


class GenerateRequest(_Wire):
    inputs: str = Field(json_schema_extra={"minLength": 1})   # TGI refuses an empty prompt
    parameters: GenerateParameters = Field(default_factory=_default_parameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class TokenizeRequest(_Wire):
    inputs: str = Field(json_schema_extra={"minLength": 1})
    parameters: dict[str, Any] | None = None    # what a GenerateRequest carries: accepted and not used


# --- TGI responses ------------------------------------------------------------------------------

class Token(_Wire):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class PrefillToken(_Wire):
    id: int
    text: str
    logprob: float | None = None


class BestOfSequence(_Wire):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = _omitted_when_empty()


class Details(_Wire):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = _omitted_when_empty()
    best_of_sequences: list[BestOfSequence] | None = _omitted_when_empty()


class GenerateResponse(_Wire):
    generated_text: str
    details: Details | None = None


class StreamDetails(_Wire):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    input_length: int


class StreamResponse(_Wire):
    index: int
    token: Token
    top_tokens: list[Token] | None = _omitted_when_empty()
    generated_text: str | None = None
    details: StreamDetails | None = None


class SimpleToken(_Wire):
    id: int
    text: str
    start: int
    stop: int


class ErrorResponse(_Wire):
    error: str
    error_type: str


class Info(_Wire):
    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None = "text-generation"
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    max_top_n_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_client_batch_size: int = 1
    max_new_tokens_default: int = 0      # when a request sets no limit; 0 = all the room left (TGI)
    prefix_caching: bool = True
    validation_workers: int = 1
    num_shard: int
    attention_backend: str
    attention_checks: dict[str, str] = Field(default_factory=dict)  # each candidate tried: "ok" or why not
    linear_backend: str = "unknown"
    elementwise_backend: str = "unknown"  # "fused" (kernels/cpu_elementwise.py) | "triton" (kernels/triton_elementwise.py) | "aten"
    decode_step: str = "eager"  # CPU: "fused (...)" (engine/cpu_decode_step.py) or "eager (why not)"
    sampler_backend: str = "torch"  # CPU logits' log_softmax + greedy pick: "fused" (kernels/cpu_log_softmax.py) or "torch (why not)"
    # quantized kernels on CUDA: "gemm"/"gemv" (W4A16/W8A16 Triton), "fp8_scaled_mm" -> "ok" or why not;
    # "gemv_layers" -> "N of M" layers that take the GEMV at decode
    quant_kernels: dict[str, str] = Field(default_factory=dict)
    model_impl: str = "native"      # "native" (engine/models/) | "transformers" (--model-impl)
    cuda_graphs: list[int] = []
    piecewise_graphs: list[int] = []   # step token counts replayed as graphs cut at attention (piecewise_graphs.py)
    async_scheduling: bool = False     # batches launched ahead of the host (async_scheduling.py)
    block_size: int
    speculate: int = 0      # n-gram draft tokens per step (--speculate); 0 = off
    # LoRA: the --lora-adapters names a request may pick (adapter_id / OpenAI model), and how they run
    lora_adapters: list[str] = []
    lora_backend: str = "none"
    lora_checks: dict[str, str] = Field(default_factory=dict)  # each LoRA backend tried: "ok" or why not
    # structured output: `parameters.grammar` types, OpenAI response_format / tools
    grammar_support: bool = True
    grammar_types: list[str] = ["json", "regex"]
    grammar_backend: str = "llguidance"
    router: str = "tgi-hpc-engine"
    version: str
    sha: str | None = None
    docker_label: str | None = None
    task: str = "generate"          # "generate" | "embed" | "classify" (engine/pooling/)
    pooling: str | None = None      # an embedder's pooling: mean, cls, lasttoken, ...


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict with TGI's omissions: empty/absent `top_tokens` and `best_of_sequences` are left out."""
    data = model.model_dump(mode="json")
    _drop_empty(data)
    return data


def _drop_empty(data: Any) -> None:
    if isinstance(data, dict):
        for key in ("top_tokens", "best_of_sequences", "tool_calls", "reasoning_content"):
            if key in data and not data[key]:
                del data[key]
        for value in data.values():
            _drop_empty(value)
    elif isinstance(data, list):
        for value in data:
            _drop_empty(value)


# --- OpenAI requests ----------------------------------------------------------------------------

class StreamOptions(_Wire):
    include_usage: bool = False


class ImageURL(_Wire):
    url: str                        # data:image/...;base64,... or http(s)://...
    detail: str | None = None       # accepted, unused: the model's processor decides the resolution


class ChatContentPart(_Wire):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None   # type "image_url" (vision-language models)


class ChatMessage(_Wire):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None      # an assistant turn that called tools
    tool_call_id: str | None = None                     # a `tool` turn: the result of that call

    def text(self) -> str:
        """Plain text of the message; list content keeps its `text` parts (images became markdown upstream)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


class OpenAIRequest(_Wire):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)       # choices per prompt (the server's cap: /info)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None     # extra template variables, e.g. enable_thinking
    max_reasoning_tokens: int | None = Field(default=None, ge=1)   # a reasoning model's span is cut there


TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
# one prompt, several, one as token ids, several as token ids (lm-evaluation-harness sends those)
Prompt = StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | TokenIds | \
    Annotated[list[TokenIds], Field(min_length=1)]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)    # legacy: the top-k alternatives per token
    best_of: int | None = Field(default=None, ge=1)     # sampled per prompt; the n best are returned
    response_format: dict[str, Any] | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: of strings, or of token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]


# --- OpenAI responses ---------------------------------------------------------------------------

class PromptTokensDetails(_Wire):
    cached_tokens: int = 0      # prompt tokens read from the prefix cache instead of computed


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(_Wire):
    token: str
    logprob: float


class ChatLogprob(_Wire):
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Wire):
    content: list[ChatLogprob]


class FunctionCall(_Wire):
    name: str
    arguments: str          # JSON text


class ChatToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(_Wire):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ChatToolCall] | None = _omitted_when_empty()
    reasoning_content: str | None = _omitted_when_empty()   # a reasoning model's <think> span (--reasoning-parser)


class ChatCompletionChoice(_Wire):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatDelta(_Wire):
    role: str = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = _omitted_when_empty()  # OpenAI's pieces: index, then id/type/name once, arguments
    reasoning_content: str | None = _omitted_when_empty()


class ChatChunkChoice(_Wire):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Wire):
    """The legacy completions format: one entry per token of the choice's text (prompt first with echo);
    the prompt's first token has no logprob (null), as in OpenAI."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Wire):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str
    task: str = "generate"          # "generate" | "embed" | "classify"


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- runtime LoRA (vLLM's shape; engine/server/lora_routes.py) ------------------------------------

class LoadLoraAdapterRequest(_Wire):
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoraAdapterRequest(_Wire):
    lora_name: StrictStr
    lora_int_id: int | None = None      # vLLM's; this server goes by names
