"""Grammar work off the event loop, bounded in time: specs in a worker process, matchers in a thread.

A 2 MB JSON schema takes about a minute to check on a 2-core box, most of it pure Python (jsonschema) that holds
the GIL: in a thread it would still stall the event loop and the model's thread at every GIL hand-over. So the
spec (engine/structured/spec.py) is built in one long-lived spawned process, killed and replaced when a build
outlasts LIMITS.timeout_s. The matcher (engine/structured/compiler.py, bound to the tokenizer and not
picklable) is compiled in a thread: llguidance drops the GIL while it builds.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from typing import Any

from engine.structured.spec import FIELD, LIMITS, GrammarError, GrammarSpec, build_entry, cached_entry, store_entry

logger = logging.getLogger(__name__)


def _serve(conn: Connection) -> None:
    """The worker process: (kind, text) in, spec or error message out, until the pipe closes."""
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            entry: GrammarSpec | str = build_entry(kind, text)
        except Exception as exc:  # noqa: BLE001 - any failure is the request's 422, never a dead worker
            entry = f"`{FIELD}` cannot be compiled: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        conn.send(("spec", entry.kind, entry.grammar) if isinstance(entry, GrammarSpec) else ("error", entry))


class SpecWorker:
    """One spawned process building specs, one at a time; started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Connection | None = None

    def build(self, kind: str, text: str, timeout_s: float) -> GrammarSpec | str:
        """Blocking (call it from a thread). TimeoutError after timeout_s; the worker is then killed."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            assert self._conn is not None
            self._conn.send((kind, text))
            if not self._conn.poll(timeout_s):
                self._kill()
                raise TimeoutError
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                self._kill()
                return f"`{FIELD}` could not be compiled: the grammar worker died"
        return GrammarSpec(reply[1], reply[2]) if reply[0] == "spec" else reply[1]

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child,), name="tgi-engine-grammar", daemon=True)
        self._process.start()
        child.close()

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def close(self) -> None:
        with self._lock:
            self._kill()


_worker = SpecWorker()


async def prepare_spec(kind: str, text: str) -> None:
    """Build and cache the spec of `text` off the event loop, unless cached; a build slower than
    LIMITS.timeout_s is cached as its error. Size is the caller's check (spec.check_size)."""
    if cached_entry(kind, text) is not None:
        return
    try:
        entry = await asyncio.to_thread(_worker.build, kind, text, LIMITS.timeout_s)
    except TimeoutError:
        logger.warning("a %s grammar of %d bytes took more than %g s to check: refused", kind, len(text),
                       LIMITS.timeout_s)
        entry = (f"`{FIELD}` took more than {LIMITS.timeout_s:g} s to compile, this server's limit "
                 "(--grammar-timeout / GRAMMAR_TIMEOUT); simplify it")
    store_entry(kind, text, entry)


async def prepare_matcher(compiler: Any, spec: GrammarSpec) -> None:
    """Compile (and cache) the model-bound matcher of `spec` in a thread; GrammarError if it fails or outlasts
    LIMITS.timeout_s (the thread then finishes in the background and caches its result)."""
    if compiler is None or compiler.is_cached(spec):
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(compiler.matcher, spec), LIMITS.timeout_s)
    except asyncio.TimeoutError:
        raise GrammarError(f"the {spec.kind} grammar took more than {LIMITS.timeout_s:g} s to compile for this "
                           "model, this server's limit (--grammar-timeout / GRAMMAR_TIMEOUT); simplify it") from None
