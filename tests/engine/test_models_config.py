"""ModelConfig for the families beyond Llama, from the Hub's config.json shapes (transformers-4 form) and
their transformers-5 rewrites; the registry and the supported list agree."""
import math

import pytest

pytest.importorskip("torch")

from engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig  # noqa: E402
from engine.models import MODEL_REGISTRY  # noqa: E402

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1e6, "sliding_window": None,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16"}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "rope_theta": 1e6, "sliding_window": None, "use_sliding_window": False, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256,
    "vocab_size": 256000, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 10000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
PHI3_MINI_128K = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32064,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48},
    "sliding_window": 262144, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False}
OLMO2_7B = {
    "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 4096, "intermediate_size": 11008,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 100352,
    "rope_theta": 500000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
STARCODER2_15B = {
    "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_size": 6144,
    "intermediate_size": 24576, "num_attention_heads": 48, "num_hidden_layers": 40, "num_key_value_heads": 4,
    "vocab_size": 49152, "max_position_embeddings": 16384, "sliding_window": 4096, "norm_epsilon": 1e-5,
    "use_bias": True, "hidden_act": "gelu_pytorch_tanh", "rope_theta": 100000, "tie_word_embeddings": False}
GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "n_ctx": 1024, "n_inner": None, "vocab_size": 50257, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256}

HUB = {"mixtral-8x7b": (MIXTRAL_8X7B, 46.7e9), "qwen3-30b-a3b": (QWEN3_30B_A3B, 30.5e9),
       "gemma-2-9b": (GEMMA2_9B, 9.24e9), "gemma-3-1b": (GEMMA3_1B, 1.0e9), "phi-3-mini": (PHI3_MINI_128K, 3.82e9),
       "olmo-2-7b": (OLMO2_7B, 7.3e9), "starcoder2-15b": (STARCODER2_15B, 16.0e9), "gpt2": (GPT2, 124e6)}


@pytest.mark.parametrize("name", HUB)
def test_hub_configs_parse_with_their_published_size(name):
    raw, params = HUB[name]
    config = ModelConfig.from_dict(raw)
    assert config.architecture in MODEL_REGISTRY
    assert abs(config.num_params - params) / params < 0.03, config.num_params


def test_moe_fields():
    mixtral, qwen = ModelConfig.from_dict(MIXTRAL_8X7B), ModelConfig.from_dict(QWEN3_30B_A3B)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 14336)
    assert mixtral.norm_topk_prob and mixtral.sliding_window is None and not mixtral.qk_norm
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.qk_norm and qwen.head_dim == 128 and all(qwen.is_moe_layer(i) for i in range(48))
    sparse = ModelConfig.from_dict({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [5],
                                    "norm_topk_prob": False})
    assert [sparse.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, False]
    assert not sparse.norm_topk_prob
    assert ModelConfig.from_dict({**QWEN3_30B_A3B, "num_local_experts": 16, "num_experts": None}).num_experts == 16


def test_gemma_fields():
    gemma2, gemma3 = ModelConfig.from_dict(GEMMA2_9B), ModelConfig.from_dict(GEMMA3_1B)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.attention_scale == 256 ** -0.5 and gemma2.embedding_multiplier == 3584 ** 0.5
    assert [gemma2.layer_sliding_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert gemma2.tie_word_embeddings and gemma2.norm == "rms_gemma" and gemma2.norm_layout == "sandwich"
    assert gemma3.qk_norm and gemma3.attn_logit_softcap is None and gemma3.final_logit_softcap is None
    assert [gemma3.layer_sliding_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.rope_scaling) == (1e6, 10000.0, None)


def test_gemma3_transformers5_form_gives_the_same_config():
    raw = {k: v for k, v in GEMMA3_1B.items()
           if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")}
    raw["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)]
    raw["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    legacy = {**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(legacy)
    assert ModelConfig.from_dict(raw).rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_phi3_longrope_in_both_forms():
    legacy = ModelConfig.from_dict(PHI3_MINI_128K)
    assert legacy.rope_scaling["rope_type"] == "longrope"  # the older name "su"
    assert legacy.rope_scaling["original_max_position_embeddings"] == 4096
    v5 = {k: v for k, v in PHI3_MINI_128K.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                             "original_max_position_embeddings": 4096, "short_factor": [1.0] * 48,
                             "long_factor": [4.0] * 48}
    assert ModelConfig.from_dict(v5) == legacy
    mini4 = ModelConfig.from_dict({**PHI3_MINI_128K, "partial_rotary_factor": 0.75})  # Phi-4-mini
    assert mini4.partial_rotary_factor == 0.75
    broken = {**PHI3_MINI_128K, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_dict(broken)


def test_olmo2_starcoder2_gpt2_fields():
    olmo, coder, gpt2 = (ModelConfig.from_dict(raw) for raw in (OLMO2_7B, STARCODER2_15B, GPT2))
    assert olmo.norm_layout == "post" and olmo.qk_norm and olmo.qk_norm_scope == "all"
    assert coder.norm == "layer" and not coder.mlp_gated and coder.mlp_bias and coder.o_proj_bias
    assert coder.sliding_window == 4096 and coder.hidden_act == "gelu_pytorch_tanh" and coder.rms_norm_eps == 1e-5
    assert (gpt2.hidden_size, gpt2.num_attention_heads, gpt2.num_key_value_heads, gpt2.intermediate_size) == \
        (768, 12, 12, 3072)
    assert gpt2.position_embedding == "learned" and gpt2.tie_word_embeddings and gpt2.hidden_act == "gelu_new"
    assert gpt2.max_position_embeddings == 1024


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="relu2"):
        ModelConfig.from_dict({**STARCODER2_15B, "hidden_act": "relu2"})


def test_registry_serves_exactly_the_supported_architectures():
    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-gemma3", "tiny-gpt2", "tiny-starcoder2"])
def test_parameter_estimate_matches_the_tiny_checkpoints(model_path, name):
    from safetensors import safe_open

    from engine.weights import safetensors_files

    path = model_path(name)
    actual = 0
    for file in safetensors_files(path):
        with safe_open(str(file), "pt") as handle:
            actual += sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())
    assert abs(ModelConfig.from_pretrained(path).num_params - actual) / actual < 0.03


GEMMA3_4B_IT = {  # google/gemma-3-4b-it: the text config lists only what differs from transformers' defaults
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "torch_dtype": "bfloat16", "mm_tokens_per_image": 256, "vision_config": {"hidden_size": 1152},
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024}}


def test_multimodal_gemma3_config_reads_its_text_part():
    config = ModelConfig.from_dict(GEMMA3_4B_IT)
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.eos_token_id == [1, 106]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.local_rope_theta == 10000.0
    assert [config.layer_sliding_window(i) for i in range(6)] == [1024] * 5 + [None]
    assert config.torch_dtype == "bfloat16" and config.qk_norm and config.tie_word_embeddings
    assert 3.7e9 < config.num_params < 4.0e9  # the 4B model's language part (the vision tower is ~0.4B)


def test_gemma3_text_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    from engine.model_config import GEMMA3_TEXT_DEFAULTS

    theirs = transformers.Gemma3TextConfig().to_dict()
    rope = theirs["rope_parameters"]
    theirs.update(rope_theta=rope["full_attention"]["rope_theta"],
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                  sliding_window_pattern=6)  # its default layer_types: every 6th layer global
    assert theirs["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert {k: theirs[k] for k in GEMMA3_TEXT_DEFAULTS} == GEMMA3_TEXT_DEFAULTS
