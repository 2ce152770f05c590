"""Batch jobs: a JSONL file of OpenAI Batch requests run through Slurm jobs, resumable and exactly once.

This subpackage owns the batch's shared state on the filesystem and everything the toolkit does with it:
the input's copy and index (inputs.py), the ledger of shards, leases and committed parts (ledger.py), the
lines finished inside a shard not committed yet (journal.py), the
final output in input order (assembly.py) and the submission of the jobs that run it (submission.py). The
jobs themselves run `python -m engine.offline`, which takes shards from the same ledger. Nothing here
imports torch or the engine.
"""
