"""Offline batches: OpenAI Batch requests run through an in-process LLMEngine, no HTTP.

This subpackage owns the job side of `tgi-hpc batch`: turning an input line into a validated request and
its answer into an OpenAI Batch output line, with the server's own request code (requests.py; /v1/embeddings
lines when the model is an embedder, which runs on engine/pooling's PoolingEngine), and the
loop that keeps the engine's batch full from shards it takes from the batch ledger (runner.py; the ledger
itself is tgi_hpc.batch.ledger). `python -m engine.offline --batch-dir DIR --model-id M ...` runs it.
"""
