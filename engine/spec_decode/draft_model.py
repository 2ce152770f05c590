"""DraftModel (`--speculative-model PATH`): a small model with the target's tokenizer, and its own paged KV cache.

The draft's cache has the target's block count and block size and is indexed by the same block tables, so one
allocation serves both (the start-up budget counts both caches' bytes per block) and the block manager's
rollback of a rejected tail rolls back both. The draft runs every span the target runs (prefill chunks,
decodes, verification spans) after the target, writing its own K/V there and computing no logits, so it
holds every computed token's K/V when it drafts; its draft forwards write past the computed tokens, slots the
next verification span rewrites.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from engine.model_config import ModelConfig
from engine.models import model_class
from engine.weights import load_safetensors

logger = logging.getLogger(__name__)


def check_draft_model(path: str, target_dir: str, target_tokenizer: Any, max_total_tokens: int) -> ModelConfig:
    """Refuse a draft the target cannot verify: a missing folder, another tokenizer, a shorter context."""
    if not Path(path, "config.json").is_file():
        raise ValueError(f"--speculative-model {path!r}: no config.json there; pass a model snapshot directory")
    draft_config = ModelConfig.from_pretrained(path)
    from engine.tokenizer import load_tokenizer
    try:
        tokenizer = load_tokenizer(path)
    except Exception as error:  # noqa: BLE001 - any failure: it has no tokenizer we can compare
        raise ValueError(f"--speculative-model {path!r}: cannot load its tokenizer ({type(error).__name__}); "
                         "the draft must ship the target's tokenizer") from None
    if tokenizer.get_vocab() != target_tokenizer.get_vocab() or _specials(tokenizer) != _specials(target_tokenizer):
        raise ValueError(f"--speculative-model {path!r} has another tokenizer than the model {target_dir!r}: its "
                         "drafts would be other tokens; use a draft trained with the same tokenizer")
    if draft_config.max_position_embeddings < max_total_tokens:
        raise ValueError(f"--speculative-model {path!r} holds {draft_config.max_position_embeddings} positions, "
                         f"fewer than max_total_tokens={max_total_tokens}; lower --max-total-tokens")
    return draft_config


def _specials(tokenizer: Any) -> tuple:
    return (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)


class DraftModel:
    def __init__(self, path: str, device: torch.device, dtype: torch.dtype) -> None:
        self.config = ModelConfig.from_pretrained(path)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = model_class(self.config)(self.config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_safetensors(model, path, model.packed_modules_mapping, skip=model.skipped_checkpoint_tensors())
        self.model = model.eval()
        self.attention_layers = model.attention_layers()
        self.windows = {layer.sliding_window for layer in self.attention_layers}
        self.dtype, self.device = dtype, device
        self.kv_cache: torch.Tensor | None = None
        self.piecewise = None   # engine/piecewise_graphs.py, set by the worker when the target's are captured
        logger.info("draft model %s: %d layers (%s)", path, self.config.num_hidden_layers,
                    json.dumps(self.config.architecture))

    def bytes_per_block(self, block_size: int) -> int:
        layer0 = self.attention_layers[0]
        return (2 * len(self.attention_layers) * block_size * layer0.num_kv_heads * self.config.head_dim
                * self.dtype.itemsize)

    def allocate(self, num_blocks: int, block_size: int, backend: Any) -> None:
        """The draft's cache: `num_blocks` blocks, the target's block ids and size."""
        layer0 = self.attention_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, block_size, layer0.num_kv_heads,
                                    self.config.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.impl = backend

    def forward(self, inputs: Any) -> torch.Tensor:
        if self.piecewise is not None and self.piecewise.can_run((), inputs.input_ids.shape[0]):
            return self.piecewise.run(inputs)
        return self.model(inputs.input_ids, inputs.positions, inputs.attention)

    def close(self) -> None:
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = None
        self.model = self.piecewise = None
