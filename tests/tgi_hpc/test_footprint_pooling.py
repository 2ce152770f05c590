"""serve sizes a pooling model by its weights alone: no KV plan for an embedder or cross-encoder (no torch)."""
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
