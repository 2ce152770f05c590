"""Seq2SeqEngine: LLMEngine's add_request / abort / step surface over transformers' encoder-decoder class.

A step admits waiting requests (encoded on joining: engine/seq2seq/batch.py), runs one decoder step for all
running requests together, samples their next tokens with the engine's sampler and ends those that stop (EOS, a
stop sequence, the length limit). add_request and abort are thread-safe; the rest belongs to the step thread.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import FinishReason, RequestOutput, TokenInfo
from engine.request_checks import check_request
from engine.sampler import pick_seed, sample
from engine.sampling_params import SamplingParams
from engine.seq2seq.batch import DecoderBatch
from engine.seq2seq.request import Seq2SeqRequest
from engine.stop import StopMatcher
from engine.tokenizer import TokenTexts, load_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_INPUT = 512     # T5's training length (its relative positions have no hard limit)
DEFAULT_MAX_NEW = 512


@dataclass(slots=True)
class Seq2SeqModelInfo:
    """What the server reads from `model_config` (ModelConfig describes decoder-only models)."""
    architecture: str
    model_type: str
    impl: str = "transformers"
    image_token_id: None = None


def is_seq2seq(model_dir: str | Path) -> bool:
    """Whether config.json names an encoder-decoder (read without transformers)."""
    path = Path(model_dir) / "config.json"
    return path.exists() and bool(json.loads(path.read_text()).get("is_encoder_decoder"))


def check_options(config: EngineConfig) -> None:
    """One-line refusals of what this engine does not do."""
    refused = [name for name, on in (("--num-shard > 1", config.num_shard > 1), ("LoRA adapters",
               bool(config.lora_adapters)), ("--quantize", bool(config.quantize)), ("--speculate",
               bool(config.speculate)), ("pipeline parallelism", (config.pipeline_parallel_size or 1) > 1)) if on]
    if refused:
        raise ValueError(f"encoder-decoder models run on one device without {', '.join(refused)}")


class Seq2SeqEngine:
    """One encoder-decoder model; the server reads `tokenizer`, `model_config` and the limits below."""

    def __init__(self, config: EngineConfig, *, tokenizer: Any = None) -> None:
        from transformers import AutoConfig, AutoModelForSeq2SeqLM

        from engine.worker import resolve_device

        check_options(config)
        self.config = config
        hf_config = AutoConfig.from_pretrained(config.model_id)
        dtype_name = config.dtype or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; choose one of {', '.join(_DTYPES)}")
        self.device, self.dtype = resolve_device(config.device, 0), _DTYPES[dtype_name]
        self.tokenizer = tokenizer or load_tokenizer(config.model_id, config.revision, config.trust_remote_code)
        self.model = AutoModelForSeq2SeqLM.from_pretrained(config.model_id, dtype=self.dtype).to(self.device).eval()
        self.model_config = Seq2SeqModelInfo((hf_config.architectures or [type(self.model).__name__])[0],
                                             hf_config.model_type)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = load_eos_token_ids(config.model_id, self.tokenizer)
        self.start_id = self.model.generation_config.decoder_start_token_id
        if self.start_id is None:
            self.start_id = hf_config.decoder_start_token_id if hf_config.decoder_start_token_id is not None \
                else hf_config.pad_token_id
        self.max_input_tokens = config.max_input_tokens or DEFAULT_MAX_INPUT
        self.max_total_tokens = config.max_total_tokens or self.max_input_tokens + DEFAULT_MAX_NEW
        if not 0 < self.max_input_tokens < self.max_total_tokens:
            raise ValueError(f"max_input_tokens ({self.max_input_tokens}) must be >= 1 and < max_total_tokens "
                             f"({self.max_total_tokens})")
        self.max_batch_prefill_tokens = config.max_batch_prefill_tokens or self.max_input_tokens
        self.max_batch_total_tokens = config.max_batch_total_tokens or self.max_total_tokens * 16
        self.max_batch_size = config.max_batch_size or 64
        self.token_texts = TokenTexts(self.tokenizer)
        self._lock = threading.Lock()
        self._pending: list[Seq2SeqRequest] = []
        self._aborted: set[str] = set()
        self._live: set[str] = set()
        self.batch = DecoderBatch(self.model, self.device, self.start_id)
        self._batch_size = self._prompt_total = self._generated_total = 0
        logger.info("encoder-decoder %s on %s: transformers' class, limits %d input / %d total tokens",
                    self.model_config.architecture, self.device, self.max_input_tokens, self.max_total_tokens)

    # requests (any thread)
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    images: Any = None) -> None:
        self._validate(prompt_token_ids, params, images)
        ids = list(prompt_token_ids)
        request = Seq2SeqRequest(request_id, params, ids, len(ids), pick_seed(params),
                           IncrementalDetokenizer(self.tokenizer, len(ids), params.skip_special_tokens),
                           StopMatcher(params.stop), decoder_ids=[self.start_id])
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live.add(request_id)
            self._pending.append(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, images: Any) -> None:
        check_request(prompt_token_ids, params, self.config, max_input_tokens=self.max_input_tokens,
                      vocab_size=self.vocab_size)
        for what, used in (("grammars", params.grammar is not None), ("LoRA adapters", params.adapter_id is not None),
                           ("images", images is not None)):
            if used:
                raise ValueError(f"{self.model_config.architecture} is an encoder-decoder model, which takes no {what}")

    # the step loop (one thread)
    @torch.no_grad()  # not inference_mode: the sampler keeps buffers between steps that LLMEngine writes outside it
    def step(self) -> list[RequestOutput]:
        outputs = self._apply_aborts()
        batch, joined = self.batch, self._admit()
        try:
            if joined:
                self._prompt_total += batch.add(joined)
            if not batch.requests:
                self._batch_size = 0
                return outputs
            logits = batch.next_logits()
        except Exception as exc:  # the step's requests fail, the engine goes on
            logger.exception("encoder-decoder step failed for %d requests", len(batch.requests))
            error = f"model step failed: {type(exc).__name__}: {exc}"
            failed = batch.clear()
            failed += [r for r in joined if all(r is not f for f in failed)]  # joined, not yet in the batch
            return outputs + [self._final(r, [], "", None, error) for r in failed]
        self._batch_size = len(batch.requests)
        result = sample(logits, batch.requests)
        kept = []
        for row, request in enumerate(batch.requests):
            output = self._append(request, result, row)
            outputs.append(output)
            if not output.finished:
                kept.append(row)
        if len(kept) < len(batch.requests):
            batch.keep(kept)
        return outputs

    def _apply_aborts(self) -> list[RequestOutput]:
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            gone = [r for r in self._pending if r.request_id in aborted]
            self._pending = [r for r in self._pending if r.request_id not in aborted]
        if not aborted:
            return []
        rows = self.batch.requests
        if any(r.request_id in aborted for r in rows):
            gone += [r for r in rows if r.request_id in aborted]
            self.batch.keep([i for i, r in enumerate(rows) if r.request_id not in aborted])
        return [self._final(r, [], "", "aborted") for r in gone]

    def _admit(self) -> list[Seq2SeqRequest]:
        """Waiting requests that fit the batch size and the prefill budget, in arrival order."""
        joined: list[Seq2SeqRequest] = []
        tokens = 0
        with self._lock:
            while self._pending and len(self.batch.requests) + len(joined) < self.max_batch_size:
                size = self._pending[0].num_prompt_tokens
                if joined and tokens + size > self.max_batch_prefill_tokens:
                    break
                joined.append(self._pending.pop(0))
                tokens += size
        return joined

    def _append(self, request: Seq2SeqRequest, result: Any, row: int) -> RequestOutput:
        token_id = result.token_ids[row]
        request.token_ids.append(token_id)
        request.decoder_ids.append(token_id)
        self._generated_total += 1
        texts = self.token_texts
        top = [TokenInfo(t, texts.text(t), lp, texts.is_special(t))
               for t, lp in zip(result.top_token_ids[row], result.top_logprobs[row])]
        logprob = result.logprobs[row] if request.params.logprobs else None
        info = TokenInfo(token_id, texts.text(token_id), logprob, texts.is_special(token_id), top)
        piece, stopped = request.stop.feed(request.detokenizer.decode_next(request.token_ids))
        reason = self._finish_reason(request, token_id, stopped)
        if reason is None:
            return self._output(request, [info], piece)
        if reason != "stop_sequence":
            tail, _ = request.stop.feed(request.detokenizer.flush(request.token_ids))
            piece += tail + request.stop.flush()
        return self._final(request, [info], piece, reason)

    def _finish_reason(self, request: Seq2SeqRequest, token_id: int, stopped: bool) -> FinishReason | None:
        if stopped:
            return "stop_sequence"
        if token_id in self.eos_token_ids and not request.params.ignore_eos:
            return "eos_token"
        generated = len(request.token_ids) - request.num_prompt_tokens
        if generated >= request.params.max_new_tokens or len(request.token_ids) >= self.max_total_tokens:
            return "length"
        return None

    def _output(self, request: Seq2SeqRequest, tokens: list[TokenInfo], text: str) -> RequestOutput:
        return RequestOutput(request.request_id, tokens, text, num_prompt_tokens=request.num_prompt_tokens,
                             num_generated_tokens=len(request.token_ids) - request.num_prompt_tokens,
                             seed=request.seed, token_texts=[text] if tokens else None)

    def _final(self, request: Seq2SeqRequest, tokens: list[TokenInfo], text: str, reason: FinishReason | None,
               error: str | None = None) -> RequestOutput:
        output = self._output(request, tokens, text)
        output.finished, output.finish_reason, output.error = True, reason, error
        output.generated_text, output.stop_text = request.stop.text, request.stop.cut
        with self._lock:
            self._live.discard(request.request_id)
        return output

    # offline use
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Run token-id prompts to completion; one RequestOutput per prompt, in order, with every token."""
        ids = [f"seq2seq-generate-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        tokens: dict[str, list[TokenInfo]] = {rid: [] for rid in ids}
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for output in self.step():
                tokens[output.request_id] += output.tokens
                if output.finished:
                    finals[output.request_id] = output
        for rid in ids:
            finals[rid].tokens, finals[rid].text = tokens[rid], finals[rid].generated_text or ""
        return [finals[rid] for rid in ids]

    def stats(self) -> Any:
        from engine.llm_engine import EngineStats
        return EngineStats(len(self._pending), len(self.batch.requests), 0, 0, 0, 1, self._batch_size,
                           "transformers (encoder-decoder)", self._prompt_total, self._generated_total)

    def close(self) -> None:
        self.batch.clear()

    def __enter__(self) -> Seq2SeqEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
