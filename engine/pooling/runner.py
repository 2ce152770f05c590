"""PoolingRunner: transformers' own model class for the checkpoint, run prefill-only on packed batches.

The forward is the library's (AutoModel for embedders, AutoModelForSequenceClassification for cross-encoders)
under torch.inference_mode, and on CPU its linears go through oneDNN with prepacked weights
(engine/pooling/linear.py); what we add is that and the batching. Embedders run packed (engine/pooling/varlen.py):
a batch is its sequences concatenated, up to `max_batch_tokens` real tokens, with per-sequence attention, so no
token is padding; a model class that fails varlen's load-time self-check, and cross-encoders (whose heads read
a padded batch), run length-sorted padded batches of at most `max_batch_tokens` padded tokens with SDPA.
`workers` > 1 runs that many batches at once, one per thread, each op single-threaded (the engine sets torch to
one thread): on a shared CPU an OpenMP team stalls at every op's barrier when one of its threads is descheduled,
and independent forwards do not. Nothing outlives the forward: there is no KV cache.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine.layers import cpu_gemm as _cpu_gemm
from engine.pooling.linear import pack_linears
from engine.pooling import varlen
from engine.pooling.pooler import pool
from engine.pooling.spec import PoolingSpec

logger = logging.getLogger(__name__)


class PoolingRunner:
    def __init__(self, model_dir: str, spec: PoolingSpec, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, pad_token_id: int = 0, max_batch_tokens: int = 4096,
                 max_batch_size: int = 256, trust_remote_code: bool = False, load_format: str = "safetensors",
                 cpu_gemm: str = "auto", workers: int = 1, packed: bool = True) -> None:
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self.pad_token_id = pad_token_id
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        cls = AutoModelForSequenceClassification if spec.task == "classify" else AutoModel
        kwargs: dict[str, Any] = dict(dtype=dtype, trust_remote_code=trust_remote_code)
        try:
            if load_format == "dummy":
                config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
                config._attn_implementation = "sdpa"
                model = cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            else:
                model = cls.from_pretrained(model_dir, attn_implementation="sdpa", **kwargs)
        except (ValueError, ImportError) as exc:  # no SDPA for this class: the library's default attention
            logger.info("SDPA not available (%s); using the model's default attention", exc)
            model = cls.from_pretrained(model_dir, **kwargs)
        self.model = model.to(self.device).eval()
        if getattr(self.model, "pooler", None) is not None and spec.task == "embed":
            self.model.pooler = None  # BERT's tanh pooler on [CLS]: sentence-transformers reads the hidden states
        self.uses_token_types = "token_type_ids" in getattr(self.model, "forward").__code__.co_varnames
        self.hidden_size = int(getattr(self.model.config, "hidden_size", 0))
        self.linear_backend = _cpu_gemm.choose(cpu_gemm, self.device, dtype)
        if self.linear_backend == "onednn":
            logger.info("oneDNN linears: %d layers packed", pack_linears(self.model))
        self.model_type = str(getattr(self.model.config, "model_type", ""))
        self.position_pad = int(getattr(self.model.config, "pad_token_id", None) or 0)  # RoBERTa's padding_idx
        self.packed = packed and spec.task == "embed" and self._packed_works()
        self.workers = max(1, workers)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pooling") if self.workers > 1 else None

    def _packed_works(self) -> bool:
        varlen.register()
        config = self.model.config
        before = config._attn_implementation
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab < 2:
            return False
        special = [int(x) for x in (getattr(config, k, None) for k in ("pad_token_id", "bos_token_id",
                   "eos_token_id", "cls_token_id", "sep_token_id")) if isinstance(x, int)]
        max_len = min(128, int(getattr(config, "max_position_embeddings", 128) or 128) - 2)

        def packed(seqs: list[list[int]]) -> torch.Tensor:
            varlen.set_implementation(self.model, varlen.ATTN_IMPLEMENTATION)
            return self._forward_packed(seqs, None)

        problem = varlen.self_check(packed, lambda s: self._forward(s, None, None), vocab, max_len, special)
        if problem is None:
            logger.info("packed variable-length batches (no padding)")
            return True
        logger.info("padded batches: %s with packed sequences (%s)", type(self.model).__name__, problem)
        varlen.set_implementation(self.model, before)
        return False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def run(self, seqs: list[list[int]], token_types: list[list[int] | None] | None = None,
            skips: list[int] | None = None) -> list[torch.Tensor]:
        """One float32 CPU tensor per sequence: the pooled vector (embed) or the logits (classify), in order.
        `skips[i]`: leading prompt tokens of sequence i left out of its pooling (include_prompt: false)."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        batches, start = [], 0
        while start < len(order):
            end, tokens = start + 1, len(seqs[order[start]])
            while end < len(order) and end - start < self.max_batch_size:
                # packed: real tokens; padded: the batch's width (its longest, the last) times its rows
                tokens = tokens + len(seqs[order[end]]) if self.packed else (end - start + 1) * len(seqs[order[end]])
                if tokens > self.max_batch_tokens:
                    break
                end += 1
            batches.append(order[start:end])
            start = end

        def one(batch: list[int]) -> torch.Tensor:
            types = [token_types[i] for i in batch] if token_types is not None else None
            skip = [skips[i] for i in batch] if skips is not None else None
            if self.packed:
                return self._forward_packed([seqs[i] for i in batch], skip)
            return self._forward([seqs[i] for i in batch], types, skip)

        results = self._pool.map(one, batches) if self._pool is not None and len(batches) > 1 else map(one, batches)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for batch, vectors in zip(batches, results):
            for i, vector in zip(batch, vectors):
                out[i] = vector
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _forward_packed(self, seqs: list[list[int]], skips: list[int] | None) -> torch.Tensor:
        inputs, lengths = varlen.packed_inputs(seqs, self.model_type, self.position_pad, self.device)
        output = self.model(**inputs)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        skip = torch.tensor(skips, dtype=torch.long) if skips else None
        return pool(self.spec.pooling, hidden[0], lengths, skip).float().cpu()

    @torch.inference_mode()
    def _forward(self, seqs: list[list[int]], types: list[list[int] | None] | None,
                 skips: list[int] | None) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        inputs: dict[str, torch.Tensor] = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if types is not None and self.uses_token_types and any(t is not None for t in types):
            tt = torch.zeros_like(ids)
            for row, t in enumerate(types):
                if t is not None:
                    tt[row, :len(t)] = torch.tensor(t, dtype=torch.long)
            inputs["token_type_ids"] = tt.to(self.device)
        output = self.model(**inputs)
        if self.spec.task == "classify":
            return output.logits.float().cpu()
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        lengths = mask.sum(dim=1)
        skip = torch.tensor(skips, dtype=torch.long) if skips else None
        return pool(self.spec.pooling, hidden[mask.to(hidden.device).bool()], lengths, skip).float().cpu()
