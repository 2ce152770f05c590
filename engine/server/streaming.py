"""A request's life against its client's connection: SSE streams that abort on disconnect, and the same for
non-streaming work (vLLM's `with_cancellation`)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.server import sse
from engine.server.errors import ClientDisconnectedError, GenerationError, ServerError
from engine.server.infer import StreamEvent
from engine.server.protocol import GenerateRequest
from engine.server.state import ServerState
from engine.server.validation import ValidRequest

T = TypeVar("T")
Renderer = Callable[[StreamEvent, ValidRequest], list[bytes]]
logger = logging.getLogger(__name__)


class EventStream(StreamingResponse):
    """SSE response that always closes its generator (so the engine request is aborted at once when
    the client leaves) and then runs `on_close` (releases the admission permit)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await a non-streaming request's work, cancelling it (so the engine aborts the request and frees
    its blocks) when the client disconnects first, as vLLM's `with_cancellation` does."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnectedError()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # the body has been read, so the next ASGI message can only be the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def open_stream(state: ServerState, req: GenerateRequest, arrival: float, render: Renderer, *, openai: bool = False,
                add_special_tokens: bool = True, prompt_token_ids: list[int] | None = None,
                max_new_tokens_default: int | None = None) -> EventStream:
    """Admit and validate now (so 429/422 are real statuses), then stream `render(event)` chunks.

    Once the stream is open an error can only be its last event; OpenAI streams end with [DONE].
    """
    valid, release = admit(state, lambda: state.validator.validate(
        req, stream=True, add_special_tokens=add_special_tokens, prompt_token_ids=prompt_token_ids,
        max_new_tokens_default=max_new_tokens_default))
    return EventStream(_events(state, valid, arrival, render, openai), on_close=release)


def admit(state: ServerState, validate: Callable[[], T]) -> tuple[T, Callable[[], None]]:
    """Take a permit now (a real 429) and run `validate` (a real 422): the permit goes back if validation
    fails; otherwise the stream that follows gives it back by calling the returned function when it closes."""
    stack = contextlib.ExitStack()
    stack.enter_context(state.infer.permit())
    try:
        return validate(), stack.close
    except ServerError:
        stack.close()
        raise


async def _events(state: ServerState, valid: ValidRequest, arrival: float, render: Renderer,
                  openai: bool) -> AsyncIterator[bytes]:
    held: list[bytes] = []   # the events of outputs that were waiting together go out in one write
    try:
        async with contextlib.aclosing(state.infer.stream(valid, arrival)) as events:
            async for ev in events:
                held += render(ev, valid)
                if ev.flush:
                    yield b"".join(held)
                    held.clear()
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a traceback
        held.append(stream_error(state, exc, space=openai))
    if held:
        yield b"".join(held)
    if openai:
        yield sse.DONE


def stream_error(state: ServerState, exc: Exception, *, space: bool) -> bytes:
    """The error event that ends a stream, counted in /metrics; unexpected errors are logged with their
    traceback (call it from the `except` block)."""
    if isinstance(exc, ServerError):
        state.metrics.failure(exc.error_type)
        return sse.encode_error(exc, space=space)
    logger.exception("stream failed")
    state.metrics.failure("generation")
    return sse.encode_error(GenerationError(type(exc).__name__), space=space)
