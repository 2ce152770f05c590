"""Request grammars -> GrammarSpec: TGI's `parameters.grammar` and OpenAI's `response_format` (and the schemas of
`tools`). Every problem is a 422 naming the field; nothing unchecked reaches the engine. `prepare_grammars` does
the heavy part first, off the event loop and bounded (engine/structured/offload.py)."""
from __future__ import annotations

from typing import Any

from engine.server.errors import ValidationError
from engine.structured.offload import prepare_matcher, prepare_spec
from engine.structured.spec import (GrammarError, GrammarSpec, cached_entry, check_size, json_schema_spec, regex_spec,
                                    spec_text)

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


def _grammar_values(req: Any) -> list[tuple[str, Any, str]]:
    """(kind, value, field) of every grammar a parsed request carries."""
    found: list[tuple[str, Any, str]] = []

    def tgi(grammar: Any, field: str) -> None:
        if isinstance(grammar, dict) and grammar.get("value") is not None:
            kind = {"json": "json", "json_object": "json", "regex": "regex"}.get(grammar.get("type"))
            if kind == "regex" and not isinstance(grammar["value"], str):
                return
            if kind is not None:
                found.append((kind, grammar["value"], field))

    parameters = getattr(req, "parameters", None)
    tgi(getattr(parameters, "grammar", None), "grammar.value")
    response_format = getattr(req, "response_format", None)
    if isinstance(response_format, dict):
        spec = response_format.get("json_schema")
        if response_format.get("type") == "json_schema" and isinstance(spec, dict) and "schema" in spec:
            found.append(("json", spec["schema"], "response_format.json_schema.schema"))
        tgi(response_format, "grammar.value")
    for i, tool in enumerate(getattr(req, "tools", None) or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("parameters"):
            found.append(("json", function["parameters"], f"tools[{i}].function.parameters"))
    return found


async def prepare_grammars(req: Any, engine: Any) -> None:
    """Build every grammar of `req` off the event loop, bounded by --max-grammar-bytes and --grammar-timeout:
    specs in the worker process, then their matchers in a thread (with the GrammarCompiler of `engine`, an
    AsyncEngine, when it has one). Both land in caches, so the synchronous validation after this finds them there; a problem found
    here is raised there, with the field's own message, or here when only the matcher fails."""
    compiler = getattr(getattr(engine, "engine", None), "grammars", None)
    for kind, value, field in _grammar_values(req):
        text = spec_text(value)
        try:
            check_size(text, field)
        except GrammarError as exc:
            raise ValidationError(f"Grammar is not valid: {exc}") from None
        await prepare_spec(kind, text)
        entry = cached_entry(kind, text)
        if isinstance(entry, GrammarSpec):
            try:
                await prepare_matcher(compiler, entry)
            except GrammarError as exc:
                raise ValidationError(f"Grammar is not valid: {exc}") from None
