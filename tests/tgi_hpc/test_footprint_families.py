"""serve sizes Falcon, BLOOM and flan-t5 from their own config.json names (no torch): Falcon's multi-query and
grouped KV heads, BLOOM's n_layer/n_head, T5's d_model/num_layers/d_kv."""
from __future__ import annotations

from tgi_hpc.models.footprint import footprint

FALCON_7B = {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 4544,
             "num_hidden_layers": 32, "num_attention_heads": 71, "multi_query": True, "parallel_attn": True,
             "new_decoder_architecture": False, "vocab_size": 65024}
FALCON_40B = {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 8192,
              "num_hidden_layers": 60, "num_attention_heads": 128, "num_kv_heads": 8,
              "new_decoder_architecture": True, "vocab_size": 65024}
BLOOM_560M = {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 1024, "n_layer": 24,
              "n_head": 16, "vocab_size": 250880}
FLAN_T5_BASE = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True,
                "d_model": 768, "d_kv": 64, "d_ff": 2048, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12,
                "vocab_size": 32128, "tie_word_embeddings": False, "feed_forward_proj": "gated-gelu"}


def test_falcon_kv_heads_follow_its_generation():
    assert footprint("tiiuae/falcon-7b", FALCON_7B).kv_bytes_per_token == 32 * 1 * 64 * 2 * 2  # multi-query
    assert footprint("tiiuae/falcon-40b", FALCON_40B).kv_bytes_per_token == 60 * 8 * 64 * 2 * 2
    assert 6.0 < footprint("tiiuae/falcon-7b", FALCON_7B).total_b < 8.5


def test_bloom_and_flan_t5_are_sized_from_their_own_names():
    bloom = footprint("bigscience/bloom-560m", BLOOM_560M)
    assert bloom.source == "config.json" and 0.5 < bloom.total_b < 0.7
    assert bloom.kv_bytes_per_token == 24 * 16 * 64 * 2 * 2
    t5 = footprint("google/flan-t5-base", FLAN_T5_BASE)
    assert t5.source == "config.json" and 0.2 < t5.total_b < 0.3
    assert t5.kv_bytes_per_token == 24 * 12 * 64 * 2 * 2  # decoder self-attention + cross-attention
