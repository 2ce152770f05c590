"""Compare xgrammar and llguidance on SmolLM2's tokenizer: compile time per JSON schema, per-step bitmask time
for a batch of 16, and JSON-schema feature coverage. Prints one table per measure.

    PYTHONPATH=$PWD python scripts/bench_grammar_libs.py [--model-dir DIR] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKSHOP = {"type": "object", "properties": {
    "location": {"type": "string"}, "activity": {"type": "string"},
    "animals_seen": {"type": "integer", "minimum": 1, "maximum": 5},
    "animals": {"type": "array", "items": {"type": "string"}}},
    "required": ["location", "activity", "animals_seen", "animals"]}
WORKSHOP_VALUE = {"location": "the park", "activity": "a walk", "animals_seen": 3,
                  "animals": ["puppy", "cat", "raccoon"]}

SCHEMAS = {
    "workshop": WORKSHOP,
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age"]}}, "required": ["user"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"]},
    "wide": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "null"]}
                                              for i in range(40)}, "required": [f"field_{i}" for i in range(40)]},
}

# feature -> schema using it (each also needs an instance to check enforcement is out of scope: compile only)
FEATURES = {
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]},
    "enum/const": {"type": "object", "properties": {"a": {"enum": [1, "x", None]}, "b": {"const": "k"}}},
    "$ref recursive": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                       "$ref": "#/$defs/n"},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]+$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 8},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "min/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "if/then/else": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, threads: int):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, token_id: int) -> None:
        for m in matchers:
            assert m.accept_token(token_id)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        matcher.compute_bitmask()   # lazy: the lexer is built on the first mask, count it as compile
        return grammar

    def matchers(self, grammar, n: int):
        return [self.ll.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matchers, token_id: int) -> None:
        for m in matchers:
            assert m.consume_token(token_id), m.get_error()


def compile_times(lib, repeats: int = 3) -> dict[str, float]:
    out = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lib.compile(schema)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def mask_time(lib, tokenizer, batch: int) -> tuple[float, int]:
    """Mean ms per batched fill over a whole workshop answer, every row on its own matcher."""
    ids = tokenizer.encode(json.dumps(WORKSHOP_VALUE), add_special_tokens=False)
    matchers = lib.matchers(lib.compile(WORKSHOP), batch)
    bitmask = lib.bitmask(batch)
    times = []
    for token_id in ids:
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        times.append(time.perf_counter() - t0)
        lib.accept(matchers, token_id)
    return statistics.mean(times) * 1e3, len(ids)


def coverage(lib) -> dict[str, str]:
    out = {}
    for name, schema in FEATURES.items():
        try:
            lib.compile(schema)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the error is the result
            out[name] = f"error: {str(exc).splitlines()[0][:60]}"
    return out


def main() -> None:
    from make_models import ensure_model
    from transformers import AutoTokenizer
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    model_dir = args.model_dir or str(ensure_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    results = {}
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(tokenizer, vocab_size, args.threads)
        init_ms = (time.perf_counter() - t0) * 1e3
        results[cls.name] = (init_ms, compile_times(lib), mask_time(lib, tokenizer, args.batch), coverage(lib))
    print(f"vocab {vocab_size}, batch {args.batch}, threads {args.threads}, torch threads {torch.get_num_threads()}")
    print(f"{'':28}" + "".join(f"{n:>14}" for n in results))
    print(f"{'tokenizer init ms':28}" + "".join(f"{r[0]:14.1f}" for r in results.values()))
    for name in SCHEMAS:
        print(f"{'compile ms ' + name:28}" + "".join(f"{r[1][name]:14.2f}" for r in results.values()))
    print(f"{'mask ms/step, batch':28}" + "".join(f"{r[2][0]:14.3f}" for r in results.values()))
    print("coverage (compiles):")
    for name in FEATURES:
        print(f"  {name:28}" + "".join(f"  {r[3][name]:<40}" for r in results.values()))


if __name__ == "__main__":
    main()
