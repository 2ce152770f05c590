"""ModelConfig parsing: transformers-4 and -5 config.json forms, family quirks, clear errors."""
import json
import math

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

from engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig  # noqa: E402

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B-Instruct config.json (transformers-4 form)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
}


def write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_llama31_legacy_form(tmp_path):
    config = ModelConfig.from_pretrained(write(tmp_path, LLAMA_31_8B))
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 128
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.torch_dtype == "bfloat16"
    assert config.eos_token_id == [128001, 128008, 128009]
    assert config.sliding_window is None and not config.qk_norm and not config.attention_bias
    assert 7.9e9 < config.num_params < 8.1e9  # Llama-3.1-8B has 8.03e9


def test_transformers5_form_gives_the_same_config(tmp_path):
    raw = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    raw["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA_31_8B["rope_scaling"]}
    raw["dtype"] = "bfloat16"
    assert ModelConfig.from_pretrained(write(tmp_path, raw)) == ModelConfig.from_dict(LLAMA_31_8B)


def _llama3_layouts():
    """The same Llama 3.1 RoPE as each transformers release writes it."""
    scaling = dict(LLAMA_31_8B["rope_scaling"])
    base = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    original = scaling.pop("original_max_position_embeddings")
    return {
        "4.x: rope_scaling with the field inside": {**base, "rope_theta": 500000.0,
                                                     "rope_scaling": LLAMA_31_8B["rope_scaling"]},
        "4.x: rope_scaling, the field at the top": {**base, "rope_theta": 500000.0, "rope_scaling": scaling,
                                                     "original_max_position_embeddings": original},
        "5.0-5.23: rope_parameters with the field inside": {
            **base, "rope_parameters": {"rope_theta": 500000.0, **LLAMA_31_8B["rope_scaling"]}},
        "5.24: rope_parameters, the field at the top": {
            **base, "rope_parameters": {"rope_theta": 500000.0, **scaling},
            "original_max_position_embeddings": original},
    }


@pytest.mark.parametrize("layout", list(_llama3_layouts()))
def test_llama3_rope_fields_are_read_from_every_layout(tmp_path, layout):
    """transformers 5.24 moved original_max_position_embeddings out of rope_parameters; both must load."""
    from engine.layers.rotary_embedding import RotaryEmbedding

    config = ModelConfig.from_pretrained(write(tmp_path, _llama3_layouts()[layout]))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {**LLAMA_31_8B["rope_scaling"]}
    rope = RotaryEmbedding(config.head_dim, 64, config.rope_theta, config.rope_scaling)
    reference = RotaryEmbedding(128, 64, 500000.0, LLAMA_31_8B["rope_scaling"])
    assert torch.equal(rope.cos, reference.cos)


def test_llama3_rope_without_its_original_context_is_a_clear_error():
    raw = {**LLAMA_31_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="llama3 RoPE scaling needs original_max_position_embeddings"):
        ModelConfig.from_dict(raw)


@pytest.mark.skipif(not hasattr(__import__("transformers"), "LlamaConfig"), reason="transformers")
def test_a_config_the_installed_transformers_writes_loads(tmp_path):
    """Whatever layout this transformers writes (it changes between releases), the engine reads it."""
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_hidden_layers=2,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
                ).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.rope_scaling["original_max_position_embeddings"] == 64
    assert config.rope_scaling["factor"] == 8.0 and config.rope_theta == 500000.0


def test_v5_default_rope_has_no_scaling():
    raw = {**LLAMA_31_8B, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    del raw["rope_scaling"], raw["rope_theta"]
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 1e6 and config.rope_scaling is None


def test_qwen2_has_qkv_bias_and_ignores_an_unused_window():
    raw = {**LLAMA_31_8B, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_scaling": None,
           "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True}
    config = ModelConfig.from_dict(raw)
    assert config.attention_bias and not config.o_proj_bias
    assert config.sliding_window is None and config.tie_word_embeddings


def test_qwen3_has_qk_norm_and_explicit_head_dim():
    raw = {**LLAMA_31_8B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_scaling": None,
           "head_dim": 96, "attention_bias": False}
    config = ModelConfig.from_dict(raw)
    assert config.qk_norm and config.head_dim == 96 and not config.attention_bias


def test_mistral_sliding_window_applies_to_every_layer():
    raw = {**LLAMA_31_8B, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "rope_scaling": None,
           "sliding_window": 4096}
    config = ModelConfig.from_dict(raw)
    assert [config.layer_sliding_window(i) for i in (0, 31)] == [4096, 4096]


def test_missing_kv_heads_means_multi_head_attention():
    raw = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(raw).num_key_value_heads == 32


def test_unsupported_architecture_lists_the_supported_ones():
    raw = {**LLAMA_31_8B, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as info:
        ModelConfig.from_dict(raw)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_rejected():
    raw = {**LLAMA_31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(raw)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "smollm2"])
def test_parameter_estimate_matches_the_checkpoint(model_path, name):
    from safetensors import safe_open

    from engine.weights import safetensors_files

    path = model_path(name)
    config = ModelConfig.from_pretrained(path)
    actual = 0
    for file in safetensors_files(path):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                actual += math.prod(handle.get_slice(key).get_shape())
    assert abs(config.num_params - actual) / actual < 0.01
