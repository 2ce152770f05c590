"""Constrained decoding: grammars (JSON schema, regex, Lark) compiled once and cached, one matcher per request,
a token bitmask per step for the batch, and the tool-call formats and grammars of the OpenAI `tools` API.

Library: llguidance, chosen over xgrammar with `scripts/bench_grammar_libs.py` (SmolLM2's 49,152-token
vocabulary, 2-core Zen 4 VM, 2026-11-24):

| | xgrammar 0.2.8 | llguidance 1.9.1 |
|---|---|---|
| tokenizer set-up (once per engine) | 251 ms | 1,246 ms |
| compile, TGI workshop schema / 40-field schema | 3.6 / 7.9 ms | 0.75 / 1.8 ms |
| bitmask for a batch of 16, per step | 0.11 ms | 0.51 ms |
| schema keywords it cannot enforce | silently ignored (`not`, `if`/`then`/`else`, `uniqueItems` compile to "any JSON") | refused with "Unimplemented keys: [...]" |

Both are far below one decode step of SmolLM2 at batch 16 on this CPU (tens of ms), and the bitmask is filled
in a worker thread while the forward runs (`masks.py`), so speed does not separate them. Coverage does: a schema
xgrammar accepts may still produce JSON that fails validation, whereas every schema llguidance accepts is
enforced, and the ones it cannot enforce become a 422 that names the keyword instead of silently wrong output.

Files: `spec.py` (what a request asks for, checked up front), `offload.py` (that check and the compilation off
the server's event loop, bounded by --max-grammar-bytes and --grammar-timeout), `compiler.py` (tokenizer-bound
compilation and the cache keyed by spec), `masks.py` (the step's bitmask, filled in parallel and overlapped with the forward; applied
by `engine.sampler`), `tool_calls.py` (how a chat template marks a tool call, the grammar that forces or allows
one, and parsing it back).
"""
