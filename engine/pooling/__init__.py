"""Pooling models: embedders, cross-encoders and classifiers served like generative ones.

This subpackage owns everything between a request's token ids and its vector or scores:
- `spec.py`: what a snapshot is (`detect`): embed or classify, from config.json's architecture or from the
  sentence-transformers files (modules.json, 1_Pooling/config.json, Normalize, sentence_bert_config.json,
  config_sentence_transformers.json). Torch-free, so the toolkit can read it too.
- `pooler.py`: the sentence-transformers poolings (mean, CLS, last token, max, mean-sqrt-len) over packed
  hidden states, prompt tokens left out where the model says so.
- `varlen.py`: packed forwards (sequences concatenated, attention within each) for transformers' model classes,
  checked against padded ones at load.
- `runner.py`: the encoder itself (transformers' own model class, inference mode), run on packed batches (or
  length-sorted padded ones) under a token budget, one single-threaded forward per CPU worker; nothing is kept
  after the forward (no KV cache).
- `engine.py`: PoolingEngine, with LLMEngine's add_request/abort/step surface, so AsyncEngine, the server's
  admission control and the launcher drive it unchanged. One engine serves one task.
The HTTP side (/v1/embeddings, /embed, /rerank, /predict, /v1/rerank, /v1/score) is engine/server/pooling_routes.py.
"""
