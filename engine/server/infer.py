"""Infer: admission (max_concurrent_requests), one request or best_of, collected or streamed, with timings.

The server's only link to the engine: it turns AsyncEngine outputs into Generation/StreamEvent and
engine failures into GenerationError; the routes turn those into wire types.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from engine.outputs import RequestOutput, TokenInfo
from engine.server.errors import GenerationError, IncompleteGenerationError, OverloadedError, ValidationError
from engine.server.metrics import ServerMetrics
from engine.server.validation import ValidRequest


@dataclass(slots=True)
class Timings:
    arrival: float                      # request received
    queued: float = 0.0                 # handed to the engine
    start: float | None = None          # first engine output (prefill done)
    end: float = 0.0

    @property
    def validation_s(self) -> float:
        return self.queued - self.arrival

    @property
    def queue_s(self) -> float:
        return (self.start or self.end) - self.queued

    @property
    def inference_s(self) -> float:
        return self.end - (self.start or self.end)

    @property
    def total_s(self) -> float:
        return self.end - self.arrival


@dataclass(slots=True)
class Generation:
    """One finished sequence."""

    text: str
    finish_reason: str
    tokens: list[TokenInfo]
    prefill: list[TokenInfo]
    seed: int | None
    input_length: int
    timings: Timings
    stop_text: str = ""   # cut from `text` by a stop sequence: TGI's generated_text includes it, OpenAI's not
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache

    @property
    def tgi_text(self) -> str:
        return self.text + self.stop_text

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_logprob(self) -> float:
        # TGI's best_of criterion (infer/mod.rs generate_best_of): mean, so length is not penalised
        return sum(t.logprob or 0.0 for t in self.tokens) / max(len(self.tokens), 1)

    @property
    def cumulative_logprob(self) -> float:
        # OpenAI's best_of criterion
        return sum(t.logprob or 0.0 for t in self.tokens)


@dataclass(slots=True)
class StreamEvent:
    """One generated token with the text it completes; `end` is set on the last one. `flush`: no further event of
    this request is ready yet (the last of the outputs that were waiting), so a stream writes what it holds."""

    index: int
    token: TokenInfo
    text: str
    end: Generation | None = None
    flush: bool = True


@dataclass(slots=True)
class Collector:
    """A request's engine outputs gathered into its Generation (the routes' and the offline batch's)."""

    input_length: int
    timings: Timings
    tokens: list[TokenInfo] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    prefill: list[TokenInfo] = field(default_factory=list)
    seed: int | None = None
    num_cached_tokens: int = 0
    started: asyncio.Event | None = None    # set on the first output: the prompt's KV blocks are cached

    def add(self, out: RequestOutput) -> Generation | None:
        if self.timings.start is None:
            self.timings.start = time.monotonic()
            self.num_cached_tokens = out.num_cached_tokens
            if self.started is not None:
                self.started.set()
        self.tokens.extend(out.tokens)
        self.texts.append(out.text)
        if out.prefill_tokens:
            self.prefill = list(out.prefill_tokens)
        if out.seed is not None:
            self.seed = out.seed
        if not out.finished:
            return None
        if out.finish_reason in (None, "aborted"):  # the engine ended it, not the client: it ended early
            raise IncompleteGenerationError()
        self.timings.end = time.monotonic()
        text = out.generated_text if out.generated_text is not None else "".join(self.texts)
        return Generation(text, out.finish_reason, self.tokens, self.prefill, self.seed,
                          self.input_length, self.timings, out.stop_text, self.num_cached_tokens)


class Infer:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, max_concurrent_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.num_in_flight = 0

    @contextlib.contextmanager
    def permit(self) -> Iterator[None]:
        """Admission control: refuse up front instead of queueing forever (TGI's semaphore)."""
        if self.num_in_flight >= self.max_concurrent_requests:
            raise OverloadedError()
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    def _observe(self, valid: ValidRequest) -> None:
        self.metrics.input_length.observe(valid.input_length)
        if valid.params.adapter_id is not None:
            self.metrics.adapter_request(valid.params.adapter_id)

    async def generate(self, valid: ValidRequest, arrival: float) -> tuple[Generation, list[Generation]]:
        """Run the request (best_of sampled copies when asked); return the best and the others."""
        self._observe(valid)
        if valid.best_of == 1:
            gen = await self._collect(valid, arrival)
            others: list[Generation] = []
        else:
            gens = await _gather_or_cancel([self._collect(valid, arrival) for _ in range(valid.best_of)])
            gen = max(gens, key=lambda g: g.mean_logprob)
            others = [g for g in gens if g is not gen]
        self._record_success(gen)
        return gen, others

    async def generate_groups(self, groups: list[list[ValidRequest]], arrival: float,
                              share_prefix: bool) -> list[list[Generation]]:
        """Run several prompts, each with several sequences (OpenAI n / best_of); results in order.

        With `share_prefix` (the prefix cache is on), a prompt's first sequence runs alone until its
        prefill is done, so the others find its KV blocks in the prefix cache instead of computing
        the same prompt again; the prompts themselves run side by side.
        """
        for group in groups:
            self._observe(group[0])
        results = await _gather_or_cancel([self._group(g, arrival, share_prefix) for g in groups])
        self._record_success(results[0][0])
        return results

    async def _group(self, group: list[ValidRequest], arrival: float, share_prefix: bool) -> list[Generation]:
        started = asyncio.Event()
        if not share_prefix or len(group) == 1:
            started.set()

        async def after_first(valid: ValidRequest) -> Generation:
            await started.wait()
            return await self._collect(valid, arrival)

        first = self._collect(group[0], arrival, started)
        return await _gather_or_cancel([first, *(after_first(v) for v in group[1:])])

    async def stream(self, valid: ValidRequest, arrival: float) -> AsyncIterator[StreamEvent]:
        """Yield one StreamEvent per generated token; the last carries the finished Generation."""
        self._observe(valid)
        collector = Collector(valid.input_length, Timings(arrival))
        index, last_token = 0, None
        async with contextlib.aclosing(self._runs(valid, collector.timings)) as runs:
            async for run in runs:
                events: list[StreamEvent] = []
                end: Generation | None = None
                for out in run:
                    end = collector.add(out)
                    tokens = list(out.tokens)
                    if end is not None and not tokens and last_token is not None:
                        # the end came without a new token: close on the last token with the remaining text
                        tokens = [replace(last_token, text="")]
                    # several tokens in one step (speculation): one event each, with its own text
                    texts = out.token_texts if out.token_texts is not None and len(out.token_texts) == len(tokens) \
                        else [""] * (len(tokens) - 1) + [out.text]
                    for i, token in enumerate(tokens):
                        index += 1
                        events.append(StreamEvent(index, token, texts[i], end if i == len(tokens) - 1 else None,
                                                  flush=False))
                        last_token = token
                    if end is not None:
                        break
                if events:
                    events[-1].flush = True
                for event in events:
                    yield event
                if end is not None:
                    self._record_success(end)
                    return
        raise IncompleteGenerationError()

    async def _collect(self, valid: ValidRequest, arrival: float, started: asyncio.Event | None = None) -> Generation:
        collector = Collector(valid.input_length, Timings(arrival), started=started)
        async with contextlib.aclosing(self._outputs(valid, collector.timings)) as outputs:
            async for out in outputs:
                end = collector.add(out)
                if end is not None:
                    return end
        raise IncompleteGenerationError()

    async def _outputs(self, valid: ValidRequest, timings: Timings) -> AsyncIterator[RequestOutput]:
        async with contextlib.aclosing(self._runs(valid, timings)) as runs:
            async for run in runs:
                for out in run:
                    yield out

    async def _runs(self, valid: ValidRequest, timings: Timings) -> AsyncIterator[list[RequestOutput]]:
        """The request's engine outputs, as many at a time as are waiting (AsyncEngine.generate_runs)."""
        request_id = uuid.uuid4().hex
        timings.queued = time.monotonic()
        params = replace(valid.params, stop=list(valid.params.stop))
        try:
            async with contextlib.aclosing(self.engine.generate_runs(request_id, valid.prompt_token_ids, params,
                                                                        valid.images)) as runs:
                async for run in runs:
                    yield run
        except (RequestFailedError, EngineDeadError) as exc:
            raise GenerationError(str(exc)) from None
        except ValueError as exc:  # LLMEngine.add_request's own checks on a request we let through
            raise ValidationError(str(exc)) from None

    def _record_success(self, gen: Generation) -> None:
        t = gen.timings
        self.metrics.success(total_s=t.total_s, validation_s=t.validation_s, queue_s=t.queue_s,
                             inference_s=t.inference_s, generated_tokens=gen.generated_tokens)


T = TypeVar("T")


async def _gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """asyncio.gather that cancels (and so aborts) the siblings of a failed or cancelled sub-request."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
