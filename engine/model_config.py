"""ModelConfig: the architecture facts the engine needs, read from a snapshot's config.json.

Accepts both the transformers-4 form (rope_theta, rope_scaling, torch_dtype) that most Hub
snapshots carry and the transformers-5 form (rope_parameters{rope_theta, rope_type, ...}, dtype).
No transformers import: config.json is plain JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architectures string in config.json -> model_type family handled by engine.models.llama
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None    # rope_type != "default" only; without rope_theta
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None             # tokens a query sees, itself included (HF semantics)
    layer_types: list[str] | None = None          # "full_attention" | "sliding_attention" per layer
    attention_bias: bool = False                  # bias on q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                         # Qwen3: RMSNorm over head_dim on q and k
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    num_params: int = 0
    quantization_config: dict[str, Any] | None = None  # as in the checkpoint; engine.layers.quantization reads it

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (or a config.json path); unsupported models raise ValueError."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.exists():
            raise FileNotFoundError(f"no config.json in {path}: pass a local model snapshot directory")
        raw = json.loads(file.read_text())
        legacy = file.parent / "quantize_config.json"  # older AutoGPTQ snapshots keep it beside config.json
        if not raw.get("quantization_config") and legacy.exists():
            raw["quantization_config"] = {"quant_method": "gptq", **json.loads(legacy.read_text())}
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architecture = _architecture(raw, source)
        model_type = raw.get("model_type", "llama")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope_theta, rope_scaling = _rope(raw, source)
        is_qwen2 = model_type == "qwen2"
        bias = bool(raw.get("attention_bias", is_qwen2))
        config = cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw, model_type),
            layer_types=_layer_types(raw, model_type),
            attention_bias=True if is_qwen2 else bias,
            o_proj_bias=False if is_qwen2 else bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=_as_list(raw.get("eos_token_id")),
            quantization_config=raw.get("quantization_config") or raw.get("compression_config"),
        )
        config.validate(source)
        config.num_params = config.estimate_num_params()
        return config

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"{source}: hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def estimate_num_params(self) -> int:
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + self.hidden_size


def _architecture(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(f"{source}: architecture {architectures or raw.get('model_type')!r} is not supported by "
                     f"this engine; supported: {', '.join(SUPPORTED_ARCHITECTURES)}. "
                     "Serve it with the official TGI launcher instead.")


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = rope_type
    return theta, scaling


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    # Qwen2/Qwen3 configs carry sliding_window even when use_sliding_window is false
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _layer_types(raw: dict[str, Any], model_type: str) -> list[str] | None:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if model_type == "qwen2" and raw.get("use_sliding_window") and "max_window_layers" in raw:
        # transformers-4 Qwen2: layers from max_window_layers on use the window
        first = raw["max_window_layers"]
        return ["sliding_attention" if i >= first else "full_attention" for i in range(raw["num_hidden_layers"])]
    return None


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
