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

# config.json `architectures` names the engine serves (engine.models.MODEL_REGISTRY maps them to classes)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM", "Olmo2ForCausalLM", "Starcoder2ForCausalLM", "GPT2LMHeadModel", "FalconForCausalLM",
    "BloomForCausalLM",
)
# vision-language checkpoints our native classes serve text-only (their tower skipped): images need the transformers
# backend, which the refusal of an image names
VISION_ON_TRANSFORMERS_BACKEND = ("Gemma3ForConditionalGeneration",)
TEXT_ONLY = "this model is text-only: it takes no images"
# transformers' Gemma3TextConfig defaults: the Hub's multimodal Gemma 3 configs (4B, 12B, 27B) list only what differs
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True,
}
MODEL_IMPLS = ("auto", "native", "transformers")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")


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
    # family knobs read by engine/models/decoder.py; the defaults are Llama's
    norm: str = "rms"                             # "rms" | "rms_gemma" (x * (1 + w)) | "layer" (LayerNorm + bias)
    norm_layout: str = "pre"                      # "pre" | "sandwich" (Gemma: also after each block) | "post" (OLMo 2)
                                                  # | "parallel" (x + attn(n(x)) + mlp(n(x)): Falcon-7B) |
                                                  # "parallel_two_norms" (x + attn(n1(x)) + mlp(n2(x)): Falcon-40B)
    qk_norm_scope: str = "head"                   # q/k norm over head_dim, or "all" heads at once (OLMo 2)
    mlp_gated: bool = True                        # False: up -> act -> down (StarCoder2, GPT-2)
    attention_scale: float | None = None          # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None       # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcap: float | None = None
    embedding_multiplier: float | None = None     # Gemma: embeddings times sqrt(hidden_size)
    position_embedding: str = "rope"              # "rope" | "learned" (GPT-2) | "alibi" (BLOOM: a bias per head)
    alibi_slope_scale: float = 1.0                # Falcon-RW scales ALiBi's bias with the scores (head_dim ** -0.5)
    embedding_norm: bool = False                  # BLOOM: a LayerNorm right after the token embeddings
    partial_rotary_factor: float = 1.0            # fraction of head_dim that RoPE rotates (Phi-4-mini)
    local_rope_theta: float | None = None         # Gemma 3: RoPE base of the sliding-window layers
    # mixture of experts (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True                   # renormalise the top-k router probabilities
    shared_expert_intermediate_size: int = 0      # Qwen2-MoE: one always-on expert behind a sigmoid gate
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP in an MoE model
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    num_params: int = 0
    quantization_config: dict[str, Any] | None = None  # as in the checkpoint; engine.layers.quantization reads it
    impl: str = "native"                          # "native" (engine/models/) | "transformers" (its backend)
    source: str = ""                              # the snapshot directory (the transformers backend reads it)
    image_token_id: int | None = None             # vision-language models (engine/multimodal): the image token
    bidirectional_images: bool = False            # an image's tokens attend to each other both ways (Gemma 3)

    @classmethod
    def from_pretrained(cls, path: str | Path, impl: str = "auto") -> ModelConfig:
        """Parse `path/config.json` (or a config.json path); unsupported models raise ValueError.

        `impl` (--model-impl): "native" = our model classes only, "transformers" = the transformers backend
        (engine/models/transformers_backend.py), "auto" = native when there is a class, else transformers."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.exists():
            raise FileNotFoundError(f"no config.json in {path}: pass a local model snapshot directory")
        raw = json.loads(file.read_text())
        if impl not in MODEL_IMPLS:
            raise ValueError(f"--model-impl {impl!r} is not one of {', '.join(MODEL_IMPLS)}")
        native = any(name in SUPPORTED_ARCHITECTURES for name in raw.get("architectures") or [])
        if impl == "transformers" or (impl == "auto" and not native):
            from engine.models.transformers_backend import model_config
            return model_config(file.parent, raw)
        legacy = file.parent / "quantize_config.json"  # older AutoGPTQ snapshots keep it beside config.json
        if not raw.get("quantization_config") and legacy.exists():
            raw["quantization_config"] = {"quant_method": "gptq", **json.loads(legacy.read_text())}
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architecture = _architecture(raw, source)
        raw = {"gpt2": _gpt2_names, "falcon": _falcon_names, "bloom": _bloom_names}.get(
            raw.get("model_type"), dict)(raw)
        if architecture == "Gemma3ForConditionalGeneration":
            raw = _gemma3_text(raw)
        model_type = raw.get("model_type", "llama")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope_theta, rope_scaling = _rope(raw, source)
        is_qwen2 = model_type == "qwen2"
        bias = bool(raw.get("attention_bias", is_qwen2))
        fields = dict(
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
        config = cls(**{**fields, **family_fields(raw, model_type, fields)})
        config.validate(source)
        config.num_params = config.estimate_num_params()
        return config

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{source}: hidden_act={self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def text_only_reason(self) -> str:
        """Why a request's images are refused (this model has no image token): a text-only model, or a vision
        checkpoint served by a native class that skips its tower, where the message names the flag that serves it."""
        if self.impl == "native" and self.architecture in VISION_ON_TRANSFORMERS_BACKEND:
            return (f"this model is served text-only: {self.architecture}'s vision tower runs on the transformers "
                    "backend; start the server with --model-impl transformers (tgi-hpc serve: --engine-arg "
                    "--model-impl=transformers) to send images")
        return TEXT_ONLY

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
        matrices = 3 if self.mlp_gated else 2
        dense = matrices * self.hidden_size * self.intermediate_size
        mlp = [dense if not self.is_moe_layer(i) else self._moe_params() for i in range(self.num_hidden_layers)]
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        if self.position_embedding == "learned":
            embeddings += self.max_position_embeddings * self.hidden_size
        return self.num_hidden_layers * (attention + 2 * self.hidden_size) + sum(mlp) + embeddings + self.hidden_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts > 0 and layer_idx not in self.dense_layers

    def _moe_params(self) -> int:
        experts = self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
        shared = 3 * self.hidden_size * self.shared_expert_intermediate_size
        return experts + shared + self.hidden_size * self.num_experts


def family_fields(raw: dict[str, Any], model_type: str, base: dict[str, Any]) -> dict[str, Any]:
    """What a family changes from Llama's defaults (see the knobs on ModelConfig)."""
    hidden = base["hidden_size"]
    if model_type == "mixtral":
        return _moe(raw, base["intermediate_size"], renormalize=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        fields = _moe(raw, raw.get("moe_intermediate_size", 0), renormalize=bool(raw.get("norm_topk_prob")))
        fields["shared_expert_intermediate_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen3_moe":
            fields.update(qk_norm=True, attention_bias=bool(raw.get("attention_bias", False)), o_proj_bias=False)
        else:
            fields.update(attention_bias=bool(raw.get("qkv_bias", True)), o_proj_bias=False)
        fields["sliding_window"] = None if not raw.get("use_sliding_window") else base["sliding_window"]
        return fields
    if model_type in ("gemma2", "gemma3_text", "gemma3"):
        return _gemma(raw, model_type, hidden)
    if model_type == "phi3":
        return dict(partial_rotary_factor=float(_rope_parameters(raw).get("partial_rotary_factor",
                                                                          raw.get("partial_rotary_factor", 1.0))))
    if model_type == "olmo2":
        return dict(norm_layout="post", qk_norm=True, qk_norm_scope="all")
    if model_type == "starcoder2":
        bias = bool(raw.get("use_bias", True))
        return dict(norm="layer", mlp_gated=False, attention_bias=bias, o_proj_bias=bias, mlp_bias=bias,
                    rms_norm_eps=raw.get("norm_epsilon", 1e-5),
                    tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    if model_type == "falcon":
        return _falcon(raw, hidden // base["num_attention_heads"])
    if model_type == "bloom":
        if raw.get("apply_residual_connection_post_layernorm"):
            raise ValueError("BLOOM with apply_residual_connection_post_layernorm (a residual taken after the norm) "
                             "is not supported")
        return dict(norm="layer", mlp_gated=False, attention_bias=True, o_proj_bias=True, mlp_bias=True,
                    position_embedding="alibi", embedding_norm=True, hidden_act="gelu_pytorch_tanh",
                    rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                    tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    if model_type == "gpt2":
        return dict(norm="layer", mlp_gated=False, attention_bias=True, o_proj_bias=True, mlp_bias=True,
                    position_embedding="learned", hidden_act=raw.get("activation_function", "gelu_new"),
                    rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                    tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    return {}


def _falcon(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Falcon's three generations: RW (ALiBi, one block after the other, biases), 7B (multi-query, attention and MLP
    side by side over one norm), 40B/180B (`new_decoder_architecture`: grouped KV heads, a norm for each side)."""
    bias = bool(raw.get("bias", False))
    fields = dict(norm="layer", mlp_gated=False, attention_bias=bias, o_proj_bias=bias, mlp_bias=bias,
                  hidden_act=raw.get("activation", "gelu"), rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                  tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    if raw.get("alibi"):
        fields.update(position_embedding="alibi", alibi_slope_scale=head_dim ** -0.5)
    if raw.get("new_decoder_architecture"):
        two = (raw.get("num_ln_in_parallel_attn") or 2) == 2
        fields["norm_layout"] = "parallel_two_norms" if two else "parallel"
    elif raw.get("parallel_attn", True):
        fields["norm_layout"] = "parallel"
    return fields


def _falcon_names(raw: dict[str, Any]) -> dict[str, Any]:
    """Falcon's config names as the common ones: KV heads by generation, the MLP's width."""
    heads = raw.get("num_attention_heads") or raw.get("n_head") or 71     # n_*: the older RW-era names
    hidden = raw.get("hidden_size") or raw.get("n_embed")
    if raw.get("new_decoder_architecture"):
        kv_heads = raw.get("num_kv_heads") or raw.get("n_head_kv") or heads
    else:
        kv_heads = 1 if raw.get("multi_query", True) else heads
    return {**raw, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": hidden // heads, "intermediate_size": raw.get("ffn_hidden_size") or 4 * hidden,
            "num_hidden_layers": raw.get("num_hidden_layers") or raw.get("n_layer") or 32}


def _bloom_names(raw: dict[str, Any]) -> dict[str, Any]:
    """BLOOM's config names (n_layer, n_head, n_embed) as the common ones; ALiBi needs no position limit, its
    training context (2048) stands in for one."""
    hidden = raw.get("hidden_size") or raw.get("n_embed")
    heads = raw.get("n_head", raw.get("num_attention_heads"))
    return {**raw, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_dim": hidden // heads, "intermediate_size": 4 * hidden,
            "num_hidden_layers": raw.get("n_layer", raw.get("num_hidden_layers")),
            "max_position_embeddings": raw.get("max_position_embeddings") or raw.get("seq_length") or 2048}


def _moe(raw: dict[str, Any], expert_size: int, renormalize: bool) -> dict[str, Any]:
    num_experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or [])
    dense |= {i for i in range(raw["num_hidden_layers"]) if (i + 1) % step}  # Qwen-MoE: every step-th layer
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                moe_intermediate_size=int(expert_size), norm_topk_prob=renormalize, dense_layers=sorted(dense))


def _gemma(raw: dict[str, Any], model_type: str, hidden: int) -> dict[str, Any]:
    fields = dict(norm="rms_gemma", norm_layout="sandwich",
                  hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
                  attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
                  attn_logit_softcap=raw.get("attn_logit_softcapping"),
                  final_logit_softcap=raw.get("final_logit_softcapping"),
                  embedding_multiplier=hidden ** 0.5,
                  tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                  sliding_window=raw.get("sliding_window"))
    num_layers = raw["num_hidden_layers"]
    if model_type == "gemma2":
        pattern = 2  # even layers slide
    else:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        fields["qk_norm"] = True
        fields["local_rope_theta"] = float(_gemma3_local_theta(raw))
    fields["layer_types"] = list(raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)])
    return fields


def _gemma3_local_theta(raw: dict[str, Any]) -> float:
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    return local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5, per layer type (Gemma 3): the global layers' values
        params = params["full_attention"]
    return params


def _gemma3_text(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model of a multimodal Gemma 3 (the engine serves its text part)."""
    text = raw.get("text_config") or {}
    inherited = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype") if k in raw}
    return {**GEMMA3_TEXT_DEFAULTS, **inherited, **text, "architectures": raw["architectures"], "model_type": "gemma3"}


def _gpt2_names(raw: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's config names (n_embd...) as the common ones; GPT-2 has no RoPE."""
    hidden = raw.get("n_embd", raw.get("hidden_size"))
    return {**raw, "hidden_size": hidden, "num_attention_heads": raw.get("n_head", raw.get("num_attention_heads")),
            "num_hidden_layers": raw.get("n_layer", raw.get("num_hidden_layers")), "num_key_value_heads": None,
            "intermediate_size": raw.get("n_inner") or 4 * hidden,
            "max_position_embeddings": raw.get("n_positions", raw.get("max_position_embeddings", 1024))}


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
    params = dict(_rope_parameters(raw))
    legacy = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in (*SUPPORTED_ROPE_TYPES, "su"):
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = "longrope" if rope_type == "su" else rope_type
    # Phi-3 keeps original_max_position_embeddings at the top level, and so does transformers >= 5.24 for
    # Llama 3 (it moved the field out of rope_parameters): read it from either place.
    if not scaling.get("original_max_position_embeddings") and raw.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if scaling["rope_type"] == "longrope":
        scaling.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
    missing = [k for k in _ROPE_REQUIRED.get(scaling["rope_type"], ()) if not scaling.get(k)]
    if missing:
        raise ValueError(f"{source}: {scaling['rope_type']} RoPE scaling needs {', '.join(missing)} "
                         "(in rope_parameters, rope_scaling or at the top level of config.json)")
    return theta, scaling


# The fields each scaled RoPE needs, wherever the config keeps them.
_ROPE_REQUIRED = {
    "llama3": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
    "linear": ("factor",),
}


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
