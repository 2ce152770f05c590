"""PoolingEngine: LLMEngine's add_request / abort / step surface over a PoolingRunner.

A request is its token ids (and, for a cross-encoder pair, token type ids); one step takes the waiting
requests in arrival order up to `max_batch_prefill_tokens` tokens, runs them as packed (or length-sorted padded)
batches and finishes every one of them: one output each, with the pooled vector or the logits. Nothing is kept
after the step. add_request and abort are thread-safe (the HTTP thread calls them; step runs in the model's).
With `workers` N > 1 on CPU (the launcher passes its torch thread count), the engine runs N single-threaded
forwards at once instead of one N-thread forward (engine/pooling/runner.py says why): it sets torch to one
thread, process-wide, and gives the old count back on close().
"""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.pooling.runner import PoolingRunner
from engine.pooling.spec import PoolingSpec, detect

logger = logging.getLogger(__name__)

DEFAULT_STEP_TOKENS = 16384     # tokens one step takes (--max-batch-prefill-tokens overrides)
FORWARD_TOKENS = 1024            # tokens of one forward, each on one CPU thread, or off CPU (see runner.py)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class PoolingParams:
    token_type_ids: list[int] | None = None   # segment ids of a (query, document) pair
    skip: int = 0                             # leading prompt tokens left out of the pooling (include_prompt: false)
    grammar: None = None                      # AsyncEngine reads it on every request (structured output); none here


@dataclass(slots=True)
class PoolingOutput:
    request_id: str
    data: torch.Tensor | None                 # pooled vector (embed) or logits (classify), float32
    num_prompt_tokens: int
    finished: bool = True
    finish_reason: str | None = "stop"
    error: str | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None
    skip: int = 0


def forward_tokens(device: torch.device, workers: int) -> int:
    """Tokens of one forward. On one thread, 1024-token MiniLM forwards were ~1.5x faster than 2048-4096 (they
    fit the cache); a team of N threads on one forward gets N times that. Off CPU: 1024, not tuned."""
    if device.type != "cpu" or workers > 1:
        return FORWARD_TOKENS
    return FORWARD_TOKENS * torch.get_num_threads()


class PoolingEngine:
    """One pooling model; the server reads `spec`, `tokenizer` and the limits below."""

    task: str

    def __init__(self, config: EngineConfig, spec: PoolingSpec | None = None, *, tokenizer: Any = None,
                 workers: int = 1) -> None:
        from engine.tokenizer import load_tokenizer
        from engine.worker import resolve_device

        self.config = config
        self.spec = spec or detect(config.model_id)
        if self.spec is None:
            raise ValueError(f"{config.model_id} is not a pooling model (no sentence-transformers Pooling module, "
                             "no encoder or *ForSequenceClassification architecture)")
        self.task = self.spec.task
        self.tokenizer = tokenizer or load_tokenizer(config.model_id, trust_remote_code=config.trust_remote_code)
        self.device = resolve_device(config.device, 0)
        dtype_name = config.dtype or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; choose one of {', '.join(_DTYPES)}")
        self.dtype = _DTYPES[dtype_name]
        self.max_input_tokens = self._max_input_tokens()
        self.max_total_tokens = self.max_input_tokens
        self.max_batch_prefill_tokens = max(config.max_batch_prefill_tokens or DEFAULT_STEP_TOKENS,
                                            self.max_input_tokens)
        self.max_batch_total_tokens = self.max_batch_prefill_tokens
        self.vocab_size = len(self.tokenizer)
        self.eos_token_ids: list[int] = []
        pad = self.tokenizer.pad_token_id
        workers = workers if self.device.type == "cpu" else 1
        self._threads_before = torch.get_num_threads() if workers > 1 else None
        if workers > 1:
            torch.set_num_threads(1)  # global: each of the workers' ops runs on its own thread
        self.runner = PoolingRunner(
            config.model_id, self.spec, device=self.device, dtype=self.dtype,
            pad_token_id=int(pad) if pad is not None else 0,
            max_batch_tokens=max(forward_tokens(self.device, workers), self.max_input_tokens),
            max_batch_size=config.max_batch_size or 256, trust_remote_code=config.trust_remote_code,
            load_format=config.load_format, cpu_gemm=config.cpu_gemm, workers=workers)
        self.hidden_size = self.runner.hidden_size
        self._waiting: deque[_Request] = deque()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._prompt_tokens_total = 0
        self._last_batch = 0
        logger.info("pooling model: task %s, %s pooling%s, max input %d tokens", self.task, self.spec.pooling,
                    " + normalize" if self.spec.normalize else "", self.max_input_tokens)

    def _max_input_tokens(self) -> int:
        raw = json.loads((Path(self.config.model_id) / "config.json").read_text())
        positions = int(raw.get("max_position_embeddings") or 512)
        if raw.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
            positions -= 2  # positions start after padding_idx
        limits = [positions, self.spec.max_seq_length, self.config.max_input_tokens, self.config.max_total_tokens]
        model_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(model_max, int) and model_max < 1_000_000:
            limits.append(model_max)
        return min(int(x) for x in limits if x)

    # --- LLMEngine's surface ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any = None) -> None:
        """`params` is PoolingParams; anything else (the health probe's SamplingParams) means no token types."""
        types = params.token_type_ids if isinstance(params, PoolingParams) else None
        skip = params.skip if isinstance(params, PoolingParams) else 0
        with self._lock:
            self._waiting.append(_Request(request_id, list(prompt_token_ids), types, skip))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def step(self) -> list[PoolingOutput]:
        batch = self._take()
        if not batch:
            return []
        outputs = []
        try:
            results = self.runner.run([r.token_ids for r in batch], [r.token_type_ids for r in batch],
                                      [r.skip for r in batch])
        except Exception as exc:  # the batch fails, the engine goes on
            logger.exception("pooling forward failed")
            return [PoolingOutput(r.request_id, None, len(r.token_ids), finish_reason=None,
                                  error=f"{type(exc).__name__}: {exc}") for r in batch]
        for req, data in zip(batch, results):
            outputs.append(PoolingOutput(req.request_id, data, len(req.token_ids)))
        self._prompt_tokens_total += sum(len(r.token_ids) for r in batch)
        return outputs

    def _take(self) -> list[_Request]:
        taken: list[_Request] = []
        tokens = 0
        with self._lock:
            while self._waiting:
                req = self._waiting[0]
                if req.request_id in self._aborted:
                    self._aborted.discard(req.request_id)
                    self._waiting.popleft()
                    continue
                if taken and tokens + len(req.token_ids) > self.max_batch_prefill_tokens:
                    break
                taken.append(self._waiting.popleft())
                tokens += len(req.token_ids)
            self._aborted.intersection_update(r.request_id for r in self._waiting)
        self._last_batch = len(taken)
        return taken

    def embed(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Offline: pooled vectors (or logits) for token id lists, without the request queue."""
        return self.runner.run(token_lists)

    def stats(self) -> Any:
        from engine.llm_engine import EngineStats
        backend = "varlen sdpa (transformers)" if self.runner.packed else "sdpa (transformers)"
        return EngineStats(num_waiting=len(self._waiting), num_running=0, num_preempted_total=0, num_free_blocks=0,
                           num_total_blocks=0, block_size=1, batch_size=self._last_batch,
                           attention_backend=backend, num_prompt_tokens_total=self._prompt_tokens_total)

    def close(self) -> None:
        self.runner.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
