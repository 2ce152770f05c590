"""Images in requests, for vision-language models served through the transformers backend.

Owns: reading images from requests (`data:` and http(s) URLs, with size, type and time limits:
`image_source.py`; http(s) URLs unless `--image-fetch deny`), turning a prompt with image placeholders into token
ids and the vision encoder's inputs with the model's own processor, in a worker thread before validation, off the
server's event loop (`processor.py` → `MultiModalPrompt`, `prompt.py`: where the image tokens are and each
image's content hash, which keys the prefix-cache blocks that hold them), and, inside the worker, running the
vision encoder once per request and placing its outputs at the image tokens of each prefill chunk
(`encoder_cache.py`), and the three-section positions of M-RoPE models such as Qwen2-VL (`mrope.py`). The model
classes stay transformers'; the backend (engine/models/transformers_backend.py) takes the placed embeddings.
"""
