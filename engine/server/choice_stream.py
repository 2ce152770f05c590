"""One SSE response for several sequences (OpenAI `n` > 1, several prompts): their events interleaved as they
come, each tagged with its choice index, then one closing part (usage) once all have ended."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from engine.server import sse
from engine.server.infer import Generation, StreamEvent
from engine.server.state import ServerState
from engine.server.streaming import EventStream, stream_error
from engine.server.validation import ValidRequest

# (choice index, event) -> SSE chunks; the closer gets every sequence's end, by prompt, in order
ChoiceRenderer = Callable[[int, StreamEvent], list[bytes]]
Closer = Callable[[list[list[Generation]]], list[bytes]]


def open_choice_stream(state: ServerState, groups: list[list[ValidRequest]], arrival: float,
                       render: ChoiceRenderer, close: Closer, permit: contextlib.ExitStack) -> EventStream:
    """`groups` are validated (so errors were real statuses) and `permit` holds the admission permit."""
    return EventStream(_events(state, groups, arrival, render, close), on_close=permit.close)


async def _events(state: ServerState, groups: list[list[ValidRequest]], arrival: float, render: ChoiceRenderer,
                  close: Closer) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[int, StreamEvent | None] | BaseException] = asyncio.Queue()
    tasks = _start(state, groups, arrival, queue)
    ends: dict[int, Generation] = {}
    try:
        num_done = 0
        while num_done < len(tasks):
            items = [await queue.get()]
            while not queue.empty():        # the events already waiting go out in one write
                items.append(queue.get_nowait())
            held: list[bytes] = []
            for item in items:
                if isinstance(item, BaseException):
                    if held:
                        yield b"".join(held)
                    raise item
                index, ev = item
                if ev is None:
                    num_done += 1
                    continue
                if ev.end is not None:
                    ends[index] = ev.end
                held += render(index, ev)
            if held:
                yield b"".join(held)
        index = 0
        by_prompt = []
        for group in groups:
            by_prompt.append([ends[i] for i in range(index, index + len(group))])
            index += len(group)
        for chunk in close(by_prompt):
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a traceback
        yield stream_error(state, exc, space=True)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    yield sse.DONE


def _start(state: ServerState, groups: list[list[ValidRequest]], arrival: float,
           queue: asyncio.Queue) -> list[asyncio.Future]:
    """One task per sequence; a prompt's later sequences start once its first has prefilled (prefix cache)."""
    share = state.config.prefix_caching

    async def pump(index: int, valid: ValidRequest, started: asyncio.Event, first: bool) -> None:
        try:
            if share and not first:
                await started.wait()
            async with contextlib.aclosing(state.infer.stream(valid, arrival)) as events:
                async for ev in events:
                    started.set()
                    queue.put_nowait((index, ev))
            queue.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the response, which ends the stream with it
            queue.put_nowait(exc)

    tasks, index = [], 0
    for group in groups:
        started = asyncio.Event()
        for j, valid in enumerate(group):
            tasks.append(asyncio.ensure_future(pump(index, valid, started, j == 0)))
            index += 1
    return tasks
