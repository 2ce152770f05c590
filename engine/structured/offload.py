"""Grammar work off the event loop, bounded in time: specs in a worker process, matchers in a thread.

A 2 MB JSON schema takes about a minute to check on a 2-core box, most of it pure Python (jsonschema) that holds
the GIL: in a thread it would still stall the event loop and the model's thread at every GIL hand-over. So the
spec (engine/structured/spec.py) is built in one long-lived spawned process, killed and replaced when a build
outlasts LIMITS.timeout_s. The matcher (engine/structured/compiler.py, bound to the tokenizer and not
picklable) is compiled in a thread: llguidance drops the GIL while it builds.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from engine.structured.spec import (FIELD, LIMITS, GrammarError, GrammarSpec, build_entry, cached_entry, spec_text,
                                   store_entry)

logger = logging.getLogger(__name__)


def grammar_values(req: Any) -> list[tuple[str, Any, str]]:
    """(kind, value, field) of every grammar a request carries (TGI's parameters.grammar, OpenAI's
    response_format and tools), from the parsed wire model or the raw JSON alike, in the same order."""
    def get(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    found: list[tuple[str, Any, str]] = []

    def tgi(grammar: Any) -> None:
        if isinstance(grammar, dict) and grammar.get("value") is not None:
            kind = {"json": "json", "json_object": "json", "regex": "regex"}.get(grammar.get("type"))
            if kind == "json" or (kind == "regex" and isinstance(grammar["value"], str)):
                found.append((kind, grammar["value"], "grammar.value"))

    tgi(get(get(req, "parameters"), "grammar"))
    response_format = get(req, "response_format")
    if isinstance(response_format, dict):
        spec = response_format.get("json_schema")
        if response_format.get("type") == "json_schema" and isinstance(spec, dict) and "schema" in spec:
            found.append(("json", spec["schema"], "response_format.json_schema.schema"))
        tgi(response_format)
    tools = get(req, "tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("parameters"):
            found.append(("json", function["parameters"], f"tools[{i}].function.parameters"))
    return found


def build_request(body: bytes) -> list[tuple[str, str, GrammarSpec | str]]:
    """In the worker: (kind, text, spec or error) of every grammar in a request body, each measured first; a
    grammar over LIMITS.max_bytes comes back as ("size", field, its size) and nothing after it is built."""
    built: list[tuple[str, str, Any]] = []
    try:
        request = json.loads(body)
    except ValueError:
        return []           # the server's parser reports it
    for kind, value, field in grammar_values(request):
        text = spec_text(value)
        size = len(text.encode())
        if size > LIMITS.max_bytes:
            return [("size", field, size)]
        entry = cached_entry(kind, text)    # this process's own cache: a schema sent again is not checked again
        if entry is None:
            try:
                entry = build_entry(kind, text)
            except Exception as exc:  # noqa: BLE001 - any failure is the request's 422, never a dead worker
                first = (str(exc).splitlines() or [""])[0]
                entry = f"`{FIELD}` cannot be compiled: {type(exc).__name__}: {first}"
            store_entry(kind, text, entry)
        built.append((kind, text, entry))
    return built


def _serve(conn: Connection, max_bytes: int) -> None:
    """The worker process: a request body in, its grammars out, until the pipe closes."""
    LIMITS.max_bytes = max_bytes
    while True:
        try:
            body = conn.recv_bytes()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            reply: Any = build_request(body)
        except Exception as exc:  # noqa: BLE001 - the body parsed on the server: this is our bug, not the client's
            reply = []      # the server then builds what it needs itself, and reports any error
            logger.warning("grammar worker: %s: %s", type(exc).__name__, exc)
        conn.send([(k, t, (e.kind, e.grammar) if isinstance(e, GrammarSpec) else e) for k, t, e in reply])


class SpecWorker:
    """One spawned process building specs, one at a time; started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Connection | None = None
        self._max_bytes = LIMITS.max_bytes

    def build(self, body: bytes, timeout_s: float) -> list[tuple[str, str, Any]]:
        """build_request(body) in the worker. Blocking (call it from a thread); TimeoutError after timeout_s,
        the worker is then killed (and started again on the next call)."""
        with self._lock:
            if self._process is None or not self._process.is_alive() or self._max_bytes != LIMITS.max_bytes:
                self._kill()
                self._start()
            assert self._conn is not None
            self._conn.send_bytes(body)
            if not self._conn.poll(timeout_s):
                self._kill()
                raise TimeoutError
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                self._kill()
                raise TimeoutError from None
        return [(k, t, GrammarSpec(*e) if isinstance(e, tuple) else e) for k, t, e in reply]

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._max_bytes = LIMITS.max_bytes
        self._process = context.Process(target=_serve, args=(child, self._max_bytes), name="tgi-engine-grammar",
                                        daemon=True)
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


_timed_out: OrderedDict[bytes, None] = OrderedDict()   # digests of bodies whose grammars outlasted the timeout


async def prepare_request(body: bytes) -> list[tuple[str, str, GrammarSpec | str]]:
    """Measure and build (into spec.py's cache) every grammar of a request body in the worker process, so that
    the event loop never serializes, measures or checks a large schema. Returns what build_request returns;
    GrammarError when the grammars outlast LIMITS.timeout_s (remembered: the same body is refused at once)."""
    digest = await asyncio.to_thread(lambda: hashlib.blake2b(body, digest_size=16).digest())
    message = (f"the request's grammar took more than {LIMITS.timeout_s:g} s to compile, this server's limit "
               "(--grammar-timeout / GRAMMAR_TIMEOUT); simplify it")
    if digest in _timed_out:
        raise GrammarError(message)
    try:
        built = await asyncio.to_thread(_worker.build, body, LIMITS.timeout_s)
    except TimeoutError:
        logger.warning("the grammars of a %d-byte request took more than %g s to check: refused", len(body),
                       LIMITS.timeout_s)
        _timed_out[digest] = None
        while len(_timed_out) > 256:
            _timed_out.popitem(last=False)
        raise GrammarError(message) from None
    for kind, text, entry in built:
        if kind != "size":
            store_entry(kind, text, entry)
    return built


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
