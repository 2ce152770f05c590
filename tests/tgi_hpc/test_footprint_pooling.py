"""serve sizes a pooling model by its weights alone (no KV plan for an embedder or cross-encoder), and a
vision-language model with its vision tower (no torch)."""
from __future__ import annotations

import json

import pytest

from tgi_hpc.models.footprint import footprint, is_pooling

MINILM = {"architectures": ["BertModel"], "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
          "intermediate_size": 1536, "vocab_size": 30522}


@pytest.mark.parametrize("arch,pooling", [
    ("BertModel", True), ("XLMRobertaForSequenceClassification", True), ("Qwen3Model", True),
    ("ModernBertModel", True), ("LlamaForCausalLM", False), ("GPT2LMHeadModel", False),
    ("Gemma3ForConditionalGeneration", False), ("", False)])
def test_is_pooling_by_architecture(arch, pooling):
    assert is_pooling({"architectures": [arch]}) is pooling


def test_pooling_footprint_has_no_kv_plan():
    fp = footprint("sentence-transformers/all-MiniLM-L6-v2", json.loads(json.dumps(MINILM)))
    assert fp is not None and fp.pooling and fp.kv_bytes_per_token == 0 and fp.kv_gb(10**6) == 0
    assert "no KV cache" in fp.describe()
    llm = footprint("x", {**MINILM, "architectures": ["LlamaForCausalLM"]})
    assert not llm.pooling and llm.kv_bytes_per_token > 0
    assert is_pooling({"architectures": None}) is False and is_pooling({}) is False


def test_a_vision_language_model_counts_its_vision_tower():
    """LLaVA-1.5-7B: a Llama-2-7B text model, CLIP ViT-L/14 (~0.30B) and a 2-layer projector (~0.02B)."""
    text = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
            "vocab_size": 32064}
    vision = {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096, "patch_size": 14}
    llava = {"architectures": ["LlavaForConditionalGeneration"], "text_config": text, "vision_config": vision}
    text_only = footprint("x", {"architectures": ["LlamaForCausalLM"], **text})
    with_vision = footprint("llava-hf/llava-1.5-7b-hf", llava)
    assert 0.30 < with_vision.total_b - text_only.total_b < 0.35
    assert with_vision.kv_bytes_per_token == text_only.kv_bytes_per_token
    assert with_vision.weight_gb > text_only.weight_gb + 0.6
