"""PoolingRunner: transformers' own model class for the checkpoint, run prefill-only on length-sorted batches.

The forward is the library's (AutoModel for embedders, AutoModelForSequenceClassification for cross-encoders),
with SDPA attention under torch.inference_mode, and on CPU its linears go through oneDNN with prepacked weights
(engine/pooling/linear.py); what we add is that and the batching. Sequences are sorted by length
and cut into batches of at most `max_batch_tokens` padded tokens, so each batch pads only to its own longest
member (with mixed lengths, a few percent of the tokens). The best size on CPU grows with the threads
(engine.forward_tokens): for MiniLM 1024 tokens a forward was ~1.5x faster than 2048-4096 with one thread,
and 4096 ~1.7x faster than 1024 with two (an OpenMP barrier per op costs more than cache misses).
Nothing outlives the forward: there is no KV cache.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from engine.layers import cpu_gemm as _cpu_gemm
from engine.pooling.linear import pack_linears
from engine.pooling.pooler import pool
from engine.pooling.spec import PoolingSpec

logger = logging.getLogger(__name__)


class PoolingRunner:
    def __init__(self, model_dir: str, spec: PoolingSpec, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, pad_token_id: int = 0, max_batch_tokens: int = 4096,
                 max_batch_size: int = 256, trust_remote_code: bool = False, load_format: str = "safetensors",
                 cpu_gemm: str = "auto") -> None:
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

    def run(self, seqs: list[list[int]], token_types: list[list[int] | None] | None = None) -> list[torch.Tensor]:
        """One float32 CPU tensor per sequence: the pooled vector (embed) or the logits (classify), in order."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out: list[torch.Tensor | None] = [None] * len(seqs)
        start = 0
        while start < len(order):
            end = start + 1
            while (end < len(order) and end - start < self.max_batch_size
                   and (end - start + 1) * len(seqs[order[end]]) <= self.max_batch_tokens):
                end += 1
            batch = order[start:end]
            types = [token_types[i] for i in batch] if token_types is not None else None
            for i, vector in zip(batch, self._forward([seqs[i] for i in batch], types)):
                out[i] = vector
            start = end
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _forward(self, seqs: list[list[int]], types: list[list[int] | None] | None) -> torch.Tensor:
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
        return pool(self.spec.pooling, hidden, inputs["attention_mask"]).float().cpu()
