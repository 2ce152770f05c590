"""Encoder-decoder models (T5 / flan-t5, BART, ...: transformers' `AutoModelForSeq2SeqLM`) served on the same
generation routes as decoder-only ones.

This subpackage owns everything between a request's prompt ids and its generated tokens for such a model:
- `engine.py`: Seq2SeqEngine, with LLMEngine's add_request / abort / step surface, so AsyncEngine, the server's
  validation and routes (/generate, /v1/completions, chat) and the launcher drive it unchanged; the engine's own
  sampler, stop sequences and incremental detokenizer.
- `batch.py`: DecoderBatch, the running requests as rows: transformers' own model class runs the encoder once per
  request (the requests joining in a step in one padded call), then one decoder step for all rows together over
  transformers' own KV cache (self- and cross-attention), not the paged one.
- `request.py`: one request's state.
Not supported here (each refused in one line): grammars, LoRA, images, --num-shard > 1, pipeline ranks,
--quantize, speculation.
"""
