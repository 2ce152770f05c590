"""GrammarSpec: what a request constrains its output to (a JSON schema, a regex or a Lark grammar), checked
when the request arrives so that a bad one is the caller's 422 and never reaches the engine."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import llguidance


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


def json_schema_spec(schema: Any, field: str) -> GrammarSpec:
    """A JSON schema (dict, bool, or its JSON text) -> spec; invalid or unenforceable schemas raise GrammarError."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
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


def regex_spec(pattern: Any, field: str) -> GrammarSpec:
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"`{field}` must be a non-empty regular expression string")
    return _checked(GrammarSpec("regex", llguidance.LLMatcher.grammar_from_regex(pattern)), field,
                    "is not a regular expression this server can compile")


def lark_spec(grammar: str, field: str) -> GrammarSpec:
    return _checked(GrammarSpec("lark", grammar), field, "is not a valid grammar")


def _checked(spec: GrammarSpec, field: str, problem: str) -> GrammarSpec:
    # no tokenizer needed: this checks the grammar itself, cheaply, on the server's event loop
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.grammar)
    if is_error:
        lines = messages[0].strip().splitlines() if messages else ["unknown error"]
        # llguidance's first line says where, a later "error:" line (regex parser) says what
        detail = " ".join([lines[0]] + [line.strip() for line in lines[1:] if line.startswith("error:")])
        raise GrammarError(f"`{field}` {problem}: {detail}")
    return spec
