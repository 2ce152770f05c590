"""The OpenAI request and answer steps that the HTTP routes and the offline batch (engine/offline/) share.

A chat request becomes a prompt through the model's chat template; a completion request is checked and each
prompt validated; a finished Generation becomes a chat or completion choice. The routes (openai_routes.py,
completions.py, messages.py, responses.py) and `engine.offline.requests` import these, so a batch line is
answered by the same code as a request. Each function reads only `tokenizer`, `validator` and `config` of the
state it is given (a ServerState, or the batch's OfflineState).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.server.errors import ValidationError
from engine.server.infer import Generation
from engine.server.legacy_logprobs import completion_logprobs
from engine.server.openai_common import check_common, finish
from engine.multimodal.processor import markdown_image
from engine.server.protocol import (ChatCompletionChoice, ChatCompletionMessage, ChatCompletionRequest,
                                    ChatContentPart, ChatLogprob, ChatLogprobs, ChatToolCall, CompletionChoice,
                                    CompletionRequest, FunctionCall, GenerateParameters, GenerateRequest, TopLogprob)
from engine.server.answer_text import read_answer
from engine.server.reasoning import ReasoningFormat
from engine.server.tools import ToolUse, new_call_id, template_inputs
from engine.server.validation import ValidRequest

logger = logging.getLogger(__name__)

COMPLETIONS_MAX_TOKENS = 16     # OpenAI's documented default for /v1/completions (vLLM's too)


# --- chat ---------------------------------------------------------------------------------------

def apply_chat_template(state: Any, req: ChatCompletionRequest, use: ToolUse | None) -> str:
    if not getattr(state.tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template; use /v1/completions or /generate")
    req = images_as_markdown(state, req)
    messages, tools = template_inputs(req, state.tokenizer, use, state.config.tool_call_parser)
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
    reserved = sorted(set(extra) & {"messages", "conversation", "tools", "tokenize", "add_generation_prompt",
                                    "return_dict", "continue_final_message", "chat_template"})
    if reserved:
        raise ValidationError(f"`chat_template_kwargs` cannot set {', '.join(reserved)}: the server sets them")
    try:
        if tools:
            extra["tools"] = tools
        return str(state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra))
    except Exception as exc:  # jinja errors (e.g. "roles must alternate") are the caller's to fix
        raise ValidationError(f"chat template error: {exc}") from None


async def prefetch_images(state: Any, prompt: str, add_special_tokens: bool = True) -> None:
    """A vision-language model's images are fetched, decoded and processed in a thread before the (synchronous)
    validation, which then finds them ready: a slow image server or a large image does not stall the other
    requests' streams. `add_special_tokens` must be the one validation will use."""
    vision = getattr(state.validator, "vision", None)
    if vision is not None and vision.has_images(prompt):
        await asyncio.to_thread(vision.prefetch, prompt, add_special_tokens)


def images_as_markdown(state: Any, req: ChatCompletionRequest) -> ChatCompletionRequest:
    """`image_url` parts become TGI's markdown images `![](URL)` in the text, which validation loads and expands
    (engine/multimodal); a model without a vision processor gets a 422, as does any other part type."""
    vision = getattr(state.validator, "vision", None)
    messages = []
    for message in req.messages:
        if not isinstance(message.content, list) or all(p.type == "text" for p in message.content):
            messages.append(message)
            continue
        parts = []
        for part in message.content:
            if part.type == "image_url":
                if vision is None:
                    raise ValidationError(f"{state.validator.text_only} (image_url parts)")
                if part.image_url is None:
                    raise ValidationError("an `image_url` part needs `image_url.url`")
                try:
                    part = ChatContentPart(type="text", text=markdown_image(part.image_url.url))
                except ValueError as exc:
                    raise ValidationError(str(exc)) from None
            elif part.type != "text":
                raise ValidationError(f"content parts of type {part.type!r} are not supported (text, image_url)")
            parts.append(part)
        messages.append(message.model_copy(update={"content": parts}))
    return req.model_copy(update={"messages": messages})


def chat_logprobs(tokens: list[Any]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatLogprob(token=t.text, logprob=t.logprob or 0.0,
                    top_logprobs=[TopLogprob(token=a.text, logprob=a.logprob or 0.0) for a in t.top_tokens])
        for t in tokens])


def chat_choice(gen: Generation, use: ToolUse | None, logprobs: bool, index: int,
                thinks: ReasoningFormat | None = None) -> ChatCompletionChoice:
    answer = read_answer(gen.text, use, thinks, gen.finish_reason == "length")
    if not answer.calls and use is not None and not use.allow_text:
        # the grammar forced a call: only a cut-off (length) or a grammar failure gets here
        logger.warning("tool_choice required/named answered without a complete call (finish %s): %r",
                       gen.finish_reason, gen.text[:300])
    message = ChatCompletionMessage(content=answer.content, reasoning_content=answer.reasoning)
    if answer.calls:
        message = ChatCompletionMessage(content=None, reasoning_content=answer.reasoning, tool_calls=[
            ChatToolCall(id=new_call_id(use.fmt if use else None),
                         function=FunctionCall(name=call.name, arguments=call.arguments)) for call in answer.calls])
    called = bool(answer.calls) and gen.finish_reason != "length"
    return ChatCompletionChoice(index=index, message=message, finish_reason="tool_calls" if called else finish(gen),
                                logprobs=chat_logprobs(gen.tokens) if logprobs else None)


# --- completions --------------------------------------------------------------------------------

def check_completion(state: Any, req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix:
        raise ValidationError("Suffix is not supported and can be achieved by preprocessing the prompt.")
    if req.logprobs is not None and req.logprobs > state.config.max_top_n_tokens:
        raise ValidationError(f"`logprobs` must be <= {state.config.max_top_n_tokens}. Given: {req.logprobs}")
    if req.max_tokens == 0 and not req.echo:
        raise ValidationError("`max_tokens` 0 generates nothing: it needs `echo` (scoring the prompt)")
    if req.echo and req.stream:
        raise ValidationError("`echo` is not supported when streaming")
    if req.stream and (req.best_of or 1) > (req.n or 1):
        raise ValidationError("`best_of` must equal `n` when streaming (the best are known only at the end)")


def _generate_request(state: Any, prompt: str | list[int], params: GenerateParameters) -> GenerateRequest:
    if isinstance(prompt, str):
        return GenerateRequest(inputs=prompt, parameters=params)
    # a token-id prompt's text is only shown by `echo`; ids outside the vocabulary never reach the tokenizer
    text = state.tokenizer.decode(state.validator.check_token_ids(prompt), skip_special_tokens=True)
    return GenerateRequest(inputs=text, parameters=params)


def validate_prompt(state: Any, prompt: str | list[int], params: GenerateParameters, default: int,
                    stream: bool = False) -> ValidRequest:
    """One completion prompt (text or token ids) validated as a request; `default`: max_tokens when unset."""
    ids = None if isinstance(prompt, str) else prompt
    return state.validator.validate(_generate_request(state, prompt, params), prompt_token_ids=ids,
                                    max_new_tokens_default=default, stream=stream)


def completion_choice(state: Any, req: CompletionRequest, valid: ValidRequest, gen: Generation,
                      prefill: list[Any], index: int, scoring: bool) -> CompletionChoice:
    generated = [] if scoring else gen.tokens
    text = (valid.inputs if req.echo else "") + ("" if scoring else gen.text)
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, valid.prompt_token_ids, prefill if req.echo else None,
                                       generated)
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason="length" if scoring else finish(gen))
