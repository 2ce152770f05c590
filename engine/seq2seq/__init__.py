"""Encoder-decoder models (T5 / flan-t5, BART, ...: transformers' `AutoModelForSeq2SeqLM`) served on the same
generation routes as decoder-only ones.

This subpackage owns everything between a request's prompt ids and its generated tokens for such a model:
- `engine.py`: Seq2SeqEngine, with LLMEngine's add_request / abort / step surface, so AsyncEngine, the server's
  validation and routes (/generate, /v1/completions, chat) and the launcher drive it unchanged. It runs
  transformers' own model class: the encoder once per request (new requests of a step in one padded call), then
  one decoder step per engine step for every running request together, over transformers' own KV cache (self-
  and cross-attention), not the paged one. The sampler, stop sequences and incremental detokenizer are the
  engine's own.
Not supported here (each refused in one line): grammars, LoRA, images, --num-shard > 1, pipeline ranks,
--quantize, speculation.
"""
