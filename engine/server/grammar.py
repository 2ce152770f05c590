"""Request grammars -> GrammarSpec: TGI's `parameters.grammar` and OpenAI's `response_format` (and the schemas of
`tools`). Every problem is a 422 naming the field; nothing unchecked reaches the engine. `prepare_grammars` does
the heavy part first, off the event loop and bounded (engine/structured/offload.py)."""
from __future__ import annotations

import json
from typing import Any

from engine.server.errors import ValidationError
from engine.structured.offload import prepare_matcher, prepare_request
from engine.structured.spec import LIMITS, GrammarError, GrammarSpec, json_schema_spec, regex_spec

# OpenAI's json_object: any JSON object
_ANY_OBJECT = {"type": "object"}


def tgi_grammar(grammar: Any) -> GrammarSpec | None:
    """TGI's GrammarType: {"type": "json" (alias "json_object"), "value": schema or its JSON text} or
    {"type": "regex", "value": pattern}. A spec built by an OpenAI route passes through."""
    if grammar is None or isinstance(grammar, GrammarSpec):
        return grammar
    if not isinstance(grammar, dict) or "type" not in grammar:
        raise ValidationError('`grammar` must be {"type": "json" | "regex", "value": ...}')
    kind, value = grammar["type"], grammar.get("value")
    try:
        if kind in ("json", "json_object"):
            if value is None:
                raise GrammarError("`grammar.value` must be a JSON schema")
            return json_schema_spec(value, "grammar.value")
        if kind == "regex":
            return regex_spec(value, "grammar.value")
    except GrammarError as exc:
        raise ValidationError(f"Grammar is not valid: {exc}") from None
    raise ValidationError(f'`grammar.type` must be "json" or "regex". Given: {kind!r}')


def response_format_grammar(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's response_format: text (no grammar), json_object, or json_schema {"name", "schema", "strict"};
    TGI's own {"type": "json", "value": schema} is accepted too."""
    if not response_format:
        return None
    kind = response_format.get("type")
    try:
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return json_schema_spec(_ANY_OBJECT, "response_format")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
                raise GrammarError("`response_format.json_schema.name` is required")
            # strict or not, the schema is enforced: a grammar cannot half-apply one
            return json_schema_spec(spec.get("schema", _ANY_OBJECT), "response_format.json_schema.schema")
        if kind in ("json", "regex"):
            return tgi_grammar(response_format)
    except GrammarError as exc:
        raise ValidationError(f"Grammar is not valid: {exc}") from None
    raise ValidationError(f'`response_format.type` must be "text", "json_object" or "json_schema". Given: {kind!r}')


def response_format_schema(response_format: dict[str, Any] | None) -> Any | None:
    """The JSON schema a (checked) response_format asks for, or None (text, regex)."""
    kind = (response_format or {}).get("type")
    if kind == "json_object":
        return _ANY_OBJECT
    if kind == "json_schema":
        return (response_format.get("json_schema") or {}).get("schema", _ANY_OBJECT)
    if kind in ("json", "json_object") and response_format.get("value") is not None:
        value = response_format["value"]
        return json.loads(value) if isinstance(value, str) else value
    return None


_GRAMMAR_KEYS = (b'"grammar"', b'"response_format"', b'"tools"')


async def prepare_grammars(body: bytes, engine: Any) -> None:
    """Build every grammar of a request off the event loop, bounded by --max-grammar-bytes and --grammar-timeout,
    before the body is parsed here: the worker process reads the raw body, measures and checks each grammar (a
    2 MB schema is never parsed, serialized or checked on the event loop, it is refused first), then their
    matchers are compiled in a thread with the GrammarCompiler of `engine` (an AsyncEngine) when it has one. Both
    land in caches, so the synchronous validation after this finds them there and raises a bad grammar's error
    with its field's own message."""
    if not any(key in body for key in _GRAMMAR_KEYS):
        return
    try:
        built = await prepare_request(body)
    except GrammarError as exc:
        raise ValidationError(f"Grammar is not valid: {exc}") from None
    compiler = getattr(getattr(engine, "engine", None), "grammars", None)
    for kind, text, entry in built:
        if kind == "size":
            raise ValidationError(f"Grammar is not valid: `{text}` is {entry} bytes, more than this server's limit of "
                                  f"{LIMITS.max_bytes} (--max-grammar-bytes / MAX_GRAMMAR_BYTES)")
        if isinstance(entry, GrammarSpec):
            try:
                await prepare_matcher(compiler, entry)
            except GrammarError as exc:
                raise ValidationError(f"Grammar is not valid: {exc}") from None


async def prepare_spec(spec: GrammarSpec | None, engine: Any) -> None:
    """Compile one spec's matcher off the event loop (the routes that build their grammar from another API's
    shape: Anthropic Messages, Responses), bounded by --grammar-timeout; a failure is the request's 422."""
    if spec is None:
        return
    try:
        await prepare_matcher(getattr(getattr(engine, "engine", None), "grammars", None), spec)
    except GrammarError as exc:
        raise ValidationError(f"Grammar is not valid: {exc}") from None
