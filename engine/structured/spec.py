"""GrammarSpec: what a request constrains its output to (a JSON schema, a regex or a Lark grammar), checked
when the request arrives so that a bad one is the caller's 422 and never reaches the engine.

Checking a large schema takes seconds to minutes of pure Python (jsonschema) and Rust (llguidance): the server
builds specs in a worker process first (engine/structured/offload.py), bounded by LIMITS, and the synchronous
functions here then find them in the cache."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


# json.dumps' layout, no free whitespace: a small model left free to emit whitespace can loop on "\n\n" until
# max_new_tokens instead of closing the object
_JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar a request gave cannot be used; the message names the request field."""


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """`grammar` is llguidance's form (a Lark grammar, JSON schemas inlined as given): the cache key."""

    kind: str           # "json" | "regex" | "lark"
    grammar: str


@dataclass(slots=True)
class GrammarLimits:
    """Set once by the server from --max-grammar-bytes and --grammar-timeout (engine/server/app.py)."""

    max_bytes: int = 512 * 1024
    timeout_s: float = 10.0


LIMITS = GrammarLimits()
FIELD = "\x00"     # stands for the request field in a cached error message
MAX_CACHED = 512
_cache: OrderedDict[tuple[str, str], GrammarSpec | str] = OrderedDict()   # (kind, text) -> spec or error
_cache_lock = threading.Lock()


def spec_text(value: Any) -> str:
    """The text a grammar value is cached and measured by: a string as given, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def json_schema_spec(schema: Any, field: str) -> GrammarSpec:
    """A JSON schema (dict, bool, or its JSON text) -> spec; invalid or unenforceable schemas raise GrammarError."""
    return _cached("json", spec_text(schema), field)


def regex_spec(pattern: Any, field: str) -> GrammarSpec:
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"`{field}` must be a non-empty regular expression string")
    return _cached("regex", pattern, field)


def check_size(text: str, field: str) -> None:
    size = len(text.encode())
    if size > LIMITS.max_bytes:
        raise GrammarError(f"`{field}` is {size} bytes, more than this server's limit of {LIMITS.max_bytes} "
                           "(--max-grammar-bytes / MAX_GRAMMAR_BYTES)")


def cached_entry(kind: str, text: str) -> GrammarSpec | str | None:
    with _cache_lock:
        entry = _cache.get((kind, text))
        if entry is not None:
            _cache.move_to_end((kind, text))
        return entry


def store_entry(kind: str, text: str, entry: GrammarSpec | str) -> None:
    with _cache_lock:
        _cache[(kind, text)] = entry
        while len(_cache) > MAX_CACHED:
            _cache.popitem(last=False)


def build_entry(kind: str, text: str) -> GrammarSpec | str:
    """The spec, or the error message with FIELD for the request field (cached either way: a schema that failed
    once fails the same way again, without the work). Runs in engine/structured/offload.py's worker process."""
    try:
        return (_json_schema if kind == "json" else _regex)(text, FIELD)
    except GrammarError as exc:
        return str(exc)


def _cached(kind: str, text: str, field: str) -> GrammarSpec:
    check_size(text, field)
    entry = cached_entry(kind, text)
    if entry is None:   # not prepared off the event loop (engine/server/grammar.py): built here
        entry = build_entry(kind, text)
        store_entry(kind, text, entry)
    if isinstance(entry, str):
        raise GrammarError(entry.replace(FIELD, field))
    return entry


def grammar_libraries():
    """(jsonschema, llguidance), imported on the first grammar: an engine without them still serves, and a
    grammar request then gets a 422 saying what is missing."""
    try:
        import jsonschema
        import llguidance
    except ImportError as exc:
        raise GrammarError(f"structured output is not available on this server: {exc.name} is not installed "
                           "(pip install llguidance jsonschema)") from None
    return jsonschema, llguidance


def _json_schema(text: str, field: str) -> GrammarSpec:
    jsonschema, llguidance = grammar_libraries()
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"`{field}` is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"`{field}` must be a JSON schema object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"`{field}` is not a valid JSON schema: {exc.message}"
                           + (f" (at `{where}`)" if where else "")) from None
    # property order is kept: models answer better in the order the schema lists (and the caller wants it)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_LAYOUT)
    return _checked(GrammarSpec("json", grammar), field, "uses a JSON schema feature this server cannot enforce")


def _regex(pattern: str, field: str) -> GrammarSpec:
    llguidance = grammar_libraries()[1]
    return _checked(GrammarSpec("regex", llguidance.LLMatcher.grammar_from_regex(pattern)), field,
                    "is not a regular expression this server can compile")


def lark_spec(grammar: str, field: str) -> GrammarSpec:
    return _checked(GrammarSpec("lark", grammar), field, "is not a valid grammar")


def _checked(spec: GrammarSpec, field: str, problem: str) -> GrammarSpec:
    # no tokenizer needed: this checks the grammar itself, cheaply, on the server's event loop
    llguidance = grammar_libraries()[1]
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.grammar)
    if is_error:
        lines = messages[0].strip().splitlines() if messages else ["unknown error"]
        # llguidance's first line says where, a later "error:" line (regex parser) says what
        detail = " ".join([lines[0]] + [line.strip() for line in lines[1:] if line.startswith("error:")])
        raise GrammarError(f"`{field}` {problem}: {detail}")
    return spec
