"""GenerateRequest -> ValidRequest: tokenize, apply defaults, check TGI's limits (router/src/validation.rs)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from engine.model_config import TEXT_ONLY
from engine.sampling_params import SamplingParams
from engine.server.errors import ValidationError
from engine.server.grammar import tgi_grammar
from engine.server.protocol import ChatCompletionRequest, GenerateParameters, GenerateRequest


@dataclass(slots=True)
class Limits:
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_new_tokens_default: int = 0     # when a request sets none; 0 = all the room left (TGI)
    vocab_size: int | None = None       # token-id prompts must lie below it


@dataclass(slots=True)
class ValidRequest:
    inputs: str
    prompt_token_ids: list[int]
    params: SamplingParams
    best_of: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    images: Any = None      # engine.multimodal.MultiModalPrompt: the prompt's images, its image tokens in the ids

    @property
    def input_length(self) -> int:
        return len(self.prompt_token_ids)


def parse_body(model: type[pydantic.BaseModel], body: bytes) -> Any:
    """Parse a JSON body into a wire model; malformed JSON and wrong types are 422 validation errors."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise ValidationError(_describe(exc)) from None


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request that another API's route built (Anthropic Messages, Responses); its problems are 422s."""
    try:
        return ChatCompletionRequest.model_validate(body, strict=False)
    except pydantic.ValidationError as exc:
        raise ValidationError(_describe(exc)) from None


_PROMPT_FORMS = ("`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token "
                 "ids, none of them empty")


def _describe(exc: pydantic.ValidationError) -> str:
    errors = exc.errors(include_url=False)
    if any(err["loc"][:1] == ("prompt",) and len(err["loc"]) > 1 for err in errors):
        return _PROMPT_FORMS  # one line instead of one error per member of the union
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"`{where}`: {err['msg']}" if err["type"] != "json_invalid" else f"invalid JSON: {err['msg']}")
    return "; ".join(parts)


class Validator:
    def __init__(self, tokenizer: Any, limits: Limits, adapters: tuple[str, ...] = (), base_name: str = "") -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.adapters = adapters        # --lora-adapters names
        self.base_name = base_name      # this name (or "tgi", or none) means the base model
        # why grammars are refused on this model (its token table cannot be built), or None
        self.grammar_unavailable: Callable[[], str | None] = lambda: None
        self.skip_special_tokens = True     # off for gpt-oss: its harmony channel markers are special tokens
        self.vision: Any = None     # engine.multimodal.VisionProcessor of a vision-language model
        self.text_only = TEXT_ONLY  # the refusal of images, without `vision` (set from the model's config)

    def adapter(self, adapter_id: str | None) -> str | None:
        """The LoRA adapter a request names (None = the base model); 422 naming the loaded ones if unknown."""
        if adapter_id in (None, "", "tgi", self.base_name):
            return None
        if adapter_id not in self.adapters:
            known = ", ".join(repr(a) for a in self.adapters)
            raise ValidationError(f"unknown adapter {adapter_id!r}: " + (
                f"loaded adapters are {known} (or {self.base_name!r} for the base model)" if self.adapters
                else "this server has no LoRA adapters (start it with --lora-adapters NAME=DIR)"))
        return adapter_id

    def validate(self, req: GenerateRequest, *, stream: bool = False, add_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None, max_new_tokens_default: int | None = None) -> ValidRequest:
        """Check `req`; `prompt_token_ids` (OpenAI token prompts) replace tokenizing `req.inputs`, and
        `max_new_tokens_default` the server's default (an API's own, e.g. 16 on /v1/completions)."""
        p = req.parameters
        best_of = self._check_sampling(p, stream)
        if p.max_new_tokens is not None and p.max_new_tokens <= 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if len(p.stop) > self.limits.max_stop_sequences:
            raise ValidationError(f"`stop` supports up to {self.limits.max_stop_sequences} stop sequences. "
                                  f"Given: {len(p.stop)}")
        top_n = p.top_n_tokens or 0
        if top_n > self.limits.max_top_n_tokens:
            raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {self.limits.max_top_n_tokens}. Given: {top_n}")
        if p.watermark:
            raise ValidationError("`watermark` is not supported by this server")
        grammar = tgi_grammar(p.grammar)
        if grammar is not None and (refusal := self.grammar_unavailable()):
            raise ValidationError(refusal)
        adapter = self.adapter(p.adapter_id)
        if stream and p.decoder_input_details:
            raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
        images = None
        if prompt_token_ids is not None:
            ids = self.check_token_ids(prompt_token_ids)
        elif not req.inputs:
            raise ValidationError("`inputs` cannot be empty")
        elif self.vision is not None and self.vision.has_images(req.inputs):
            ids, images = self._with_images(req.inputs, p.truncate, add_special_tokens)
        else:
            ids = self._tokenize(req.inputs, p.truncate, add_special_tokens)
        if images is None and self.vision is not None and self.vision.image_token_id in ids:
            raise ValidationError(f"the prompt has the image token {self.vision.image_token!r} but no image: send "
                                  "images as image_url parts or markdown ![](URL)")
        max_new_tokens = self._check_lengths(len(ids), p.max_new_tokens, max_new_tokens_default)
        params = SamplingParams(
            do_sample=best_of > 1 or _is_sampling(p), temperature=p.temperature if p.temperature is not None else 1.0,
            top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty, seed=p.seed, max_new_tokens=max_new_tokens,
            stop=list(p.stop), top_n_tokens=top_n, prefill_logprobs=p.decoder_input_details, grammar=grammar,
            adapter_id=adapter, skip_special_tokens=self.skip_special_tokens)
        return ValidRequest(inputs=req.inputs, prompt_token_ids=ids, params=params, best_of=best_of,
                            details=p.details or p.decoder_input_details,
                            decoder_input_details=p.decoder_input_details,
                            return_full_text=bool(p.return_full_text), images=images)

    def _with_images(self, inputs: str, truncate: int | None, add_special_tokens: bool) -> tuple[list[int], Any]:
        """Markdown images `![](URL)` loaded, processed and expanded into image tokens (they count as input)."""
        from engine.multimodal.image_source import ImageError

        if truncate is not None:
            raise ValidationError("`truncate` cannot be used with images (it could cut an image's tokens)")
        try:
            return self.vision.prepare(inputs, add_special_tokens)
        except ImageError as exc:
            raise ValidationError(str(exc)) from None

    def _check_sampling(self, p: GenerateParameters, stream: bool) -> int:
        best_of = p.best_of or 1
        if best_of > self.limits.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {self.limits.max_best_of}. Given: {best_of}")
        if best_of > 1 and stream:
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
        if best_of > 1 and not (p.do_sample or _sets_sampling_param(p)):
            raise ValidationError("you must use sampling when `best_of` is > 1")
        if best_of > 1 and p.seed is not None:
            raise ValidationError("`seed` must not be set when `best_of` > 1")
        if p.temperature is not None and p.temperature <= 0:
            raise ValidationError("`temperature` must be strictly positive")
        if p.repetition_penalty is not None and p.repetition_penalty <= 0:
            raise ValidationError("`repetition_penalty` must be strictly positive")
        if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
            raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        if p.top_p is not None and not 0.0 < p.top_p < 1.0:
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
        if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
            raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
        if p.top_k is not None and p.top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        return best_of

    def _tokenize(self, inputs: str, truncate: int | None, add_special_tokens: bool) -> list[int]:
        limit = self.limits.max_input_tokens
        if truncate is not None and not 0 < truncate <= limit:
            raise ValidationError(f"`truncate` must be strictly positive and less than {limit}. Given: {truncate}")
        ids = list(self.tokenizer.encode(inputs, add_special_tokens=add_special_tokens))
        if truncate is not None and len(ids) > truncate:
            ids = ids[len(ids) - truncate:]  # TGI keeps the end of the prompt
        if not ids:
            raise ValidationError("`inputs` cannot be empty")
        return ids

    def check_token_ids(self, ids: list[int]) -> list[int]:
        vocab = self.limits.vocab_size
        if not ids:
            raise ValidationError("`prompt` cannot be empty")
        if len(ids) > self.limits.max_input_tokens:
            raise ValidationError(f"`inputs` must have less than {self.limits.max_input_tokens} tokens. "
                                  f"Given: {len(ids)}")
        if min(ids) < 0 or (vocab is not None and max(ids) >= vocab):
            bad = next(i for i in ids if i < 0 or (vocab is not None and i >= vocab))
            raise ValidationError(f"`prompt` token ids must be >= 0 and < {vocab} (the vocabulary). Given: {bad}")
        return list(ids)

    def _check_lengths(self, input_length: int, max_new_tokens: int | None, default: int | None) -> int:
        total = self.limits.max_total_tokens
        if max_new_tokens is None:
            # the default, cut to the room the prompt leaves; 0 = all that room (TGI's default)
            room = max(total - input_length, 1)
            default = self.limits.max_new_tokens_default if default is None else default
            max_new_tokens = min(default, room) if default > 0 else room
        if input_length > self.limits.max_input_tokens:
            raise ValidationError(f"`inputs` must have less than {self.limits.max_input_tokens} tokens. "
                                  f"Given: {input_length}")
        if input_length + max_new_tokens > total:
            raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= {total}. "
                                  f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
        return max_new_tokens


def _is_sampling(p: GenerateParameters) -> bool:
    # like TGI's NextTokenChooser: any warper that changes the distribution turns sampling on
    warped = ((p.temperature is not None and p.temperature != 1.0) or p.top_k is not None
              or p.top_p is not None or p.typical_p is not None)
    return p.do_sample or warped


def _sets_sampling_param(p: GenerateParameters) -> bool:
    return any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
