"""Medusa heads (`--speculative-model DIR` holding `medusa_lm_head.safetensors` + a config with
`medusa_num_heads`): greedy output equal to no speculation (batch 1 and 16 mixed requests, two shards), the
drafts equal to the heads on transformers' hidden state, the sampled distribution kept (chi-square), and
refusals of heads the model cannot use."""
import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import (assert_same_distribution, compare_greedy, loop_sampled_counts, real_engine,  # noqa: E402
                              record_head_drafts)


def make_medusa(target, path, num_heads=4, num_layers=1, seed=0, lm_head=True):
    """Heads in FasterDecoding's / TGI's format: random non-zero ResBlocks, each head's projection the target's
    LM head (or random), so some drafts are right and some wrong."""
    path.mkdir()
    config = json.loads((target / "config.json").read_text())
    tensors = load_file(target / "model.safetensors")
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    vocab, hidden = head.shape
    generator = torch.Generator().manual_seed(seed)
    heads = {}
    for i in range(num_heads):
        for j in range(num_layers):
            heads[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.05
            heads[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=generator) * 0.05
        heads[f"{i}.{num_layers}.weight"] = (head.clone() if lm_head else
                                            torch.randn(vocab, hidden, generator=generator) * 0.1)
    save_file(heads, path / "medusa_lm_head.safetensors")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                                                  "base_model_name_or_path": config.get("_name_or_path", "")}))
    return path


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    return {name: make_medusa(test_model_path(name), root / name) for name in ("tiny-llama", "tiny-qwen3")}


def test_greedy_with_medusa_heads_is_identical(heads):
    _, stats = compare_greedy("tiny-llama", {"speculative_model": str(heads["tiny-llama"])}, max_new=16)
    assert stats.speculative_method == "medusa"


def test_greedy_with_two_shards_and_medusa_heads_is_identical(heads):
    # the heads run on rank 0 alone, on the hidden states every rank holds whole
    compare_greedy("tiny-qwen3", {"speculative_model": str(heads["tiny-qwen3"]), "num_shard": 2}, {"num_shard": 1},
                   count=4, max_new=16)


def test_sampled_token_distribution_is_kept_with_medusa_heads(heads):
    base, _ = loop_sampled_counts({})
    assert_same_distribution(base, *loop_sampled_counts({"speculate": 3,
                                                         "speculative_model": str(heads["tiny-llama"])}))


def test_medusa_heads_the_model_cannot_use_are_refused_before_loading(heads, tmp_path):
    with pytest.raises(ValueError, match="4 Medusa heads"):
        real_engine("tiny-llama", speculate=5, speculative_model=str(heads["tiny-llama"]))
    other = tmp_path / "other"                                   # heads for another hidden size
    make_medusa(test_model_path("tiny-llama"), other)
    tensors = load_file(other / "medusa_lm_head.safetensors")
    tensors["2.1.weight"] = torch.ones(1024, 32)
    save_file(tensors, other / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match="head 2 projects 32 -> 1024"):
        real_engine("tiny-llama", speculate=3, speculative_model=str(other))
    (other / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(ValueError, match="without weights"):
        real_engine("tiny-llama", speculate=3, speculative_model=str(other))
    (other / "config.json").write_text(json.dumps({"medusa_num_heads": "three"}))
    with pytest.raises(ValueError, match="medusa_num_heads='three'"):
        real_engine("tiny-llama", speculate=3, speculative_model=str(other))


def test_medusa_drafts_equal_the_heads_on_transformers_last_hidden_state(heads, monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = record_head_drafts(monkeypatch)
    with real_engine("tiny-llama", speculate=3, speculative_model=str(heads["tiny-llama"])) as engine:
        engine.generate([engine.tokenizer.encode("Hello world, this is a test of the heads")],
                        SamplingParams(max_new_tokens=8))
    model = AutoModelForCausalLM.from_pretrained(test_model_path("tiny-llama"), dtype=torch.float32).eval()
    w = load_file(heads["tiny-llama"] / "medusa_lm_head.safetensors")
    for context, got in seen[:2]:
        with torch.no_grad():
            h = model(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        expected = []
        for i in range(3):
            x = h + torch.nn.functional.silu(w[f"{i}.0.linear.weight"] @ h + w[f"{i}.0.linear.bias"])
            expected.append(int((w[f"{i}.1.weight"] @ x).argmax()))
        assert got == expected
