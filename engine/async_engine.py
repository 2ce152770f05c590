"""AsyncEngine: LLMEngine.step() in a background thread, one asyncio queue per request."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.deferred_outputs import DeferredRows
from engine.deferred_text import fill
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.offload import prepare_matcher

T = TypeVar("T")
logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step thread has stopped (crashed or closed); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed one request (RequestOutput.error) or died while it ran."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Drive any object with LLMEngine's add_request/abort/step/has_unfinished_requests from asyncio.

    The step loop runs in one thread (`start()`: a daemon thread; `run_here()`: the caller's, which
    the launcher uses for the main thread); outputs are handed to the owning event loop with
    call_soon_threadsafe. Leaving `generate()` early (client gone, task cancelled) aborts the
    request in the engine, which frees its KV blocks. An engine with `defer_text` (LLMEngine) leaves the text of
    sequences no text can end to the loop, which decodes each output as it delivers it (engine/deferred_text.py):
    on a GPU that runs while the step thread waits for the device.
    """

    def __init__(self, engine: Any, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        if hasattr(engine, "defer_text"):
            engine.defer_text = True
        self.idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._streams: dict[str, _Stream] = {}
        self._loops: dict[asyncio.AbstractEventLoop, int] = {}     # event loop -> its streams
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._keep_running: Callable[[], bool] = lambda: True
        self._health_lock: asyncio.Lock | None = None
        self._calls: list[tuple[Callable[[], Any], asyncio.Future]] = []     # run in the step thread (call())

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def run_here(self, keep_running: Callable[[], bool]) -> None:
        """Run the step loop in the calling thread until keep_running() is False or close().

        For the main thread: torch's CPU kernels measured ~20% slower when called from a secondary
        thread (OpenMP thread teams), so the launcher keeps the model here and HTTP in a thread.
        """
        self._thread, self._keep_running = threading.current_thread(), keep_running
        self._run()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout_s)
        self.engine.close()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> Any:
        return self.engine.stats()

    # --- requests ---------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       images: Any = None) -> AsyncIterator[RequestOutput]:
        """Yield the engine's incremental outputs for one request until the finished one; `images`: the
        prompt's engine.multimodal.MultiModalPrompt, if any."""
        async with contextlib.aclosing(self.generate_runs(request_id, prompt_token_ids, params, images)) as runs:
            async for run in runs:
                for out in run:
                    yield out

    async def generate_runs(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            images: Any = None) -> AsyncIterator[list[RequestOutput]]:
        """As `generate`, but each yield is every output already waiting (one step's, or several when the event
        loop fell behind the steps): a stream can then write them to its socket at once."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            self._loops[stream.loop] = self._loops.get(stream.loop, 0) + 1
        finished = False
        try:
            if params.grammar is not None:   # compiled off the event loop (the server prepared most already)
                await prepare_matcher(getattr(self.engine, "grammars", None), params.grammar)
            if images is None:
                self.engine.add_request(request_id, prompt_token_ids, params)
            else:
                self.engine.add_request(request_id, prompt_token_ids, params, images)
            self._wakeup.set()
            while not finished:
                run = [await stream.queue.get()]
                while not stream.queue.empty():
                    run.append(stream.queue.get_nowait())
                ready: list[RequestOutput] = []
                failed: BaseException | None = None
                for item in run:
                    if isinstance(item, BaseException):
                        failed = RequestFailedError(f"engine stopped: {item}")
                        failed.__cause__ = item
                        break
                    if item.error is not None:
                        finished = True
                        failed = RequestFailedError(item.error)
                        break
                    ready.append(item)
                    if item.finished:
                        finished = True
                        break
                if ready:       # what came before a failure still reaches the stream, as one output at a time did
                    yield ready
                if failed is not None:
                    raise failed
        finally:
            with self._lock:
                if self._streams.pop(request_id, None) is not None:
                    self._loops[stream.loop] -= 1
                    if not self._loops[stream.loop]:
                        del self._loops[stream.loop]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # an engine that already forgot the id is fine
            logger.debug("abort of %s failed", request_id, exc_info=True)
        self._wakeup.set()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the step thread between two steps (runtime LoRA changes the weights a step reads)."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason())
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._calls.append((fn, future))
        self._wakeup.set()
        return await future

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                result, error = fn(), None
            except Exception as exc:  # noqa: BLE001 - the caller's to handle
                result, error = None, exc
            try:
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass

    # --- health -----------------------------------------------------------------------------------

    async def check_health(self, timeout_s: float = 30.0, recent_s: float = 5.0) -> bool:
        """True when the engine can generate: recent progress while busy, else a one-token probe."""
        if not self.is_alive:
            return False
        if self._streams and time.monotonic() - self.last_step_time < recent_s:
            return True
        if self._health_lock is None:
            self._health_lock = asyncio.Lock()
        async with self._health_lock:
            return await self._probe(timeout_s)

    async def _probe(self, timeout_s: float) -> bool:
        params = SamplingParams(max_new_tokens=1, logprobs=False, ignore_eos=True)
        request_id = f"health-{uuid.uuid4().hex}"

        async def run() -> bool:
            async for out in self.generate(request_id, [self._probe_token_id()], params):
                if out.finished:
                    return True
            return False

        try:
            return await asyncio.wait_for(run(), timeout_s)
        except (asyncio.TimeoutError, RequestFailedError, EngineDeadError) as exc:
            logger.warning("health probe failed: %s", exc)
            return False

    def _probe_token_id(self) -> int:
        tokenizer = getattr(self.engine, "tokenizer", None)
        for token_id in (getattr(tokenizer, "bos_token_id", None), *getattr(self.engine, "eos_token_ids", [])):
            if token_id is not None:
                return int(token_id)
        return 0

    # --- step thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        device = getattr(getattr(self.engine, "runner", None), "device", None)
        if getattr(device, "type", None) == "cuda":     # a new thread starts on GPU 0 whatever --device said
            import torch

            torch.cuda.set_device(device)
        while not self._stop.is_set() and self._keep_running():
            self._wakeup.clear()
            if self._calls:
                self._run_calls()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(self.idle_wait_s)
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # the thread dies; health turns 503 and every stream fails
                logger.exception("engine step failed; the engine is stopped")
                self.error = exc
                self._fail_all(exc)
                return
            self.last_step_time = time.monotonic()
            self._dispatch_step(outputs)
        self._fail_all(EngineDeadError("engine closed"))

    def _dispatch_step(self, outputs: list[Any]) -> None:
        """One wake-up of each event loop per step, not one per request: on a small CPU box every
        wake-up competes with the model's threads for the same cores. A DeferredRows (the step's plain decode
        rows, engine/deferred_outputs.py) goes whole to every loop that has streams: each builds and delivers the
        outputs of its own streams' rows, after the step's other outputs for it."""
        batches: dict[Any, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        noted: DeferredRows | None = None
        with self._lock:
            for out in outputs:
                if type(out) is DeferredRows:
                    noted = out
                    continue
                stream = self._streams.get(out.request_id)
                if stream is not None:  # else the client left; its abort is already on its way
                    batches.setdefault(stream.loop, []).append((stream.queue, out))
            loops = set(batches) if noted is None else set(batches) | set(self._loops)
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._deliver_step, batches.get(loop, ()), noted, loop)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass

    def _deliver_step(self, items: Any, noted: DeferredRows | None, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`'s thread: the step's outputs for its streams, then the outputs of its streams' noted rows."""
        _deliver(items)
        if noted is None:
            return
        with self._lock:
            streams = [self._streams.get(seq.request_id) for seq in noted.seqs]
        for i, stream in enumerate(streams):
            if stream is not None and stream.loop is loop:   # else the client left, or another loop's
                try:
                    out = noted.output(i)
                except Exception as error:  # noqa: BLE001 - that request ends with it; the other rows go on
                    logger.exception("building an output of request %s failed", noted.seqs[i].request_id)
                    out = RequestOutput(noted.seqs[i].request_id, [], "", finished=True,
                                        error=f"building the output failed: {type(error).__name__}: {error}")
                    self.abort(out.request_id)      # the engine still runs it: its stream ends here
                fill(out)
                stream.queue.put_nowait(out)

    def _dispatch(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Deliver one item (used for failures; steps go through _dispatch_step)."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:  # the client left; its abort is already on its way
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass

    def fail(self, error: BaseException) -> None:
        """The engine is dead (noticed outside the step loop, whose thread may be stuck in a collective):
        health turns 503 and every request in flight ends with `error` now. Any thread."""
        if self.error is None:
            self.error = error
        self._stop.set()
        self._fail_all(error)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self._dispatch(request_id, exc)

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"engine stopped after an error: {type(self.error).__name__}: {self.error}"
        return "engine is not running"


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        if getattr(item, "pending", None) is not None:     # a RequestOutput whose text is ours to decode
            fill(item)
        queue.put_nowait(item)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():       # the caller gave up (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
