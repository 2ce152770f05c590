"""Quantized checkpoints end to end on CPU: GPTQ and AWQ written by a packer from the format specs
(quant_packers.py), compressed-tensors written by the compressed-tensors library, --quantize fp8 and
bitsandbytes on a float checkpoint. The engine's logits must match transformers on the dequantized
weights (or on the checkpoint itself where transformers can load it), greedy generations must agree,
and two shards must give one shard's logits."""
import json

import pytest

torch = pytest.importorskip("torch")

from engine.batch import SeqSpan  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from quant_packers import build  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12], [200, 1, 64, 33]]


@pytest.fixture(scope="module")
def base_llama(tmp_path_factory):
    """A tiny float Llama: 4 heads of 32 over 2 kv heads, hidden 128, MLP 256, two layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("base-llama")
    config = LlamaConfig(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.08, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_runner(path, num_shard=1, **overrides):
    settings = dict(model_id=str(path), device="cpu", block_size=4, cpu_kv_cache_bytes=2**21,
                    num_shard=num_shard, master_port=0)
    return ModelRunner(EngineConfig(**{**settings, **overrides}), ModelConfig.from_pretrained(path))


def engine_logits(runner):
    """Logits of every prompt position (prefill, one batch), then one decode step each."""
    tables = [list(range(1, 5)), list(range(5, 9))]
    spans = [SeqSpan(i, p[:-1], 0, tables[i], "all") for i, p in enumerate(PROMPTS)]
    _, rows = runner.run(spans)
    last, _ = runner.run([SeqSpan(i, p[-1:], len(p) - 1, tables[i]) for i, p in enumerate(PROMPTS)])
    return [torch.cat([rows[i], last[i:i + 1]]) for i in range(len(PROMPTS))]


def greedy(runner, prompts, new_tokens):
    tables = [list(range(1 + i * 8, 1 + (i + 1) * 8)) for i in range(len(prompts))]
    outputs = [[] for _ in prompts]
    spans = [SeqSpan(i, p, 0, tables[i]) for i, p in enumerate(prompts)]
    for _ in range(new_tokens):
        last, _ = runner.run(spans)
        tokens = [int(row.argmax()) for row in last]
        for span, token in zip(spans, tokens):
            outputs[span.seq_id].append(token)
        spans = [SeqSpan(s.seq_id, [t], s.start_pos + len(s.token_ids), s.block_table) for s, t in zip(spans, tokens)]
    return outputs


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


def hf_greedy(model, prompts, new_tokens):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


PACKED = {
    "gptq-int4-g32": ("gptq", dict(bits=4, group_size=32)),
    "gptq-int4-act-order-asym": ("gptq", dict(bits=4, group_size=32, desc_act=True, sym=False)),
    "gptq-int8-whole-rows-v2": ("gptq", dict(bits=8, group_size=-1, sym=False, v2=True)),
    "awq-g64": ("awq", dict(group_size=64)),
}


@pytest.mark.parametrize("case", PACKED)
def test_packed_checkpoints_match_transformers_on_the_dequantized_weights(base_llama, tmp_path, case):
    kind, options = PACKED[case]
    quant, reference = build(kind, options, base_llama, tmp_path)
    model = hf_model(reference)
    expected = hf_logits(model)
    with make_runner(quant) as runner:
        got = engine_logits(runner)
        ours = greedy(runner, PROMPTS, 6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-4, rtol=0)
    assert ours == hf_greedy(model, PROMPTS, 6)
