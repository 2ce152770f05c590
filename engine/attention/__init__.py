"""Paged attention over one flattened varlen batch.

Owns: the step's attention metadata (`metadata.py`, one layout for every backend: cu_seqlens_q,
seq_lens, block tables, cache slots), the backends that compute attention from it
(`portable.py` torch on any device, `cpu_paged.py` our C++ kernel reading the cache in place on CPU,
`triton_backend.py` our Triton kernels, `flash.py` flash-attn when importable), and the start-up
choice between them (`selection.py`: a priority list per device, each candidate checked against the
float64 reference in engine/kernels/attention_reference.py, `--attention-backend` to force one). The
`Attention` module in engine/layers/attention.py holds a layer's cache and hands the work to the
chosen backend.
"""
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, build_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "build_metadata"]
