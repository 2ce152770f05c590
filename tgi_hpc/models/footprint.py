"""GPU memory a served model needs: its weights (every expert of an MoE model) plus the KV cache the
profile plans for (KV bytes per token = layers x KV heads x head_dim x 2 (K and V) x dtype bytes)."""
from __future__ import annotations

from dataclasses import dataclass

from tgi_hpc.models.config_names import common_names
from tgi_hpc.models.known_models import known_model
from tgi_hpc.models.quantization import linear_weight_bits
from tgi_hpc.models.size import active_params_b, catalog_size_b, param_split


@dataclass(frozen=True)
class Footprint:
    total_b: float                 # parameters held in memory, billions
    active_b: float                # parameters per token (MoE: the routed experts only)
    weight_gb: float               # weight bytes / 1e9 at the served precision
    kv_bytes_per_token: int
    source: str                    # "config.json" or the model card the sizes come from
    pooling: bool = False          # an embedder or cross-encoder: prefill only, no KV cache kept
    draft: str = ""                # with a speculative draft: its description (its bytes are in the figures)

    def kv_gb(self, tokens: int) -> float:
        return self.kv_bytes_per_token * tokens / 1e9

    def describe(self) -> str:
        moe = f" ({self.active_b:.1f}B active per token)" if self.active_b < self.total_b * 0.95 else ""
        if self.pooling:
            return (f"{self.total_b:.2f}B parameters: {self.weight_gb:.1f} GB of weights, a pooling model (no KV "
                    f"cache) (source: {self.source})")
        with_draft = f", with the {self.draft}" if self.draft else ""
        return (f"{self.total_b:.1f}B parameters{moe}{with_draft}: {self.weight_gb:.0f} GB of weights, "
                f"KV cache {self.kv_bytes_per_token / 1024:.0f} KiB per token (source: {self.source})")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


def is_pooling(config: dict) -> bool:
    """An encoder, a decoder used as an embedder, or a cross-encoder, by config.json's architecture (what
    engine/pooling/spec.py serves; a sentence-transformers snapshot of a decoder is named `*Model` too)."""
    arch = (config.get("architectures") or [""])[0] or ""
    return isinstance(arch, str) and (arch.endswith("ForSequenceClassification")
                                      or (arch.endswith("Model") and not arch.endswith("LMHeadModel")))


def footprint(model: str, config: dict | None, quantize: str | None = None,
              dtype_bytes: int = 2) -> Footprint | None:
    """From the snapshot's config.json when there is one, else from the table of known models."""
    if config is not None:
        try:
            text = common_names(config.get("text_config", config))
            heads = int(text.get("num_attention_heads", 1))
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
            kv = kv_bytes_per_token(int(text["num_hidden_layers"]), int(text.get("num_key_value_heads", heads)),
                                    head_dim, dtype_bytes)
            if is_pooling(config):
                kv = 0
            return Footprint(sum(param_split(config)), active_params_b(config),
                             2 * (catalog_size_b(model, config, quantize) or 0), kv, "config.json",
                             pooling=is_pooling(config))
        except (KeyError, ValueError, TypeError):
            pass
    known = known_model(model)
    if known is None:
        return None
    bits = linear_weight_bits(None, quantize)
    return Footprint(known.total_b, known.active_b, known.total_b * bits / 8,
                     kv_bytes_per_token(known.num_layers, known.num_kv_heads, known.head_dim, dtype_bytes),
                     known.source)
