"""Medusa heads (`--speculative-model DIR` holding `medusa_lm_head.safetensors` + a config with
`medusa_num_heads`): greedy output equal to no speculation (batch 1 and 16 mixed requests, tiny models and
SmolLM2), the sampled distribution kept (chi-square), and refusals of heads the model cannot use."""
import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import chi_square_p, compare_greedy, real_engine  # noqa: E402


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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_greedy_with_medusa_heads_is_identical(name, heads):
    stats = compare_greedy(name, {"speculative_model": str(heads[name])})
    assert stats.speculative_method == "medusa"


def test_greedy_on_smollm2_with_medusa_heads_is_identical(tmp_path):
    compare_greedy("smollm2", {"speculative_model": str(make_medusa(test_model_path("smollm2"), tmp_path / "m"))},
                   count=6, max_new=8)


def test_sampled_token_distribution_is_kept_with_medusa_heads(heads):
    num_draws = 200
    params = [SamplingParams(do_sample=True, seed=seed, temperature=1.0, top_k=2, max_new_tokens=4,
                             ignore_eos=True) for seed in range(num_draws)]
    counts = {}
    for use_heads in (False, True):
        config = {"speculate": 3, "speculative_model": str(heads["tiny-llama"])} if use_heads else {}
        with real_engine("tiny-llama", **config) as engine:
            # the model's own greedy loop as the prompt: where it repeats a token the heads' guess is likely
            start = engine.tokenizer.encode("one two three")
            ids = start + [t.id for t in engine.generate([start], SamplingParams(max_new_tokens=24))[0].tokens]
            outs = engine.generate([ids] * num_draws, params)
            stats = engine.stats()
        counts[use_heads] = [{} for _ in range(4)]
        for out in outs:
            for position, token in enumerate(out.tokens):
                counts[use_heads][position][token.id] = counts[use_heads][position].get(token.id, 0) + 1
    assert 0.05 < stats.num_speculative_accepted_total / stats.num_speculative_proposed_total < 0.95, stats
    p_values = [chi_square_p(counts[False][k], counts[True][k]) for k in range(4)]
    assert min(p_values) > 1e-3 / 4, p_values


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

    from engine.spec_decode.head_drafter import HeadDrafter
    seen = []
    fill = HeadDrafter.fill

    def recording_fill(self, batch):
        fill(self, batch)
        seen.extend((list(seq.token_ids), list(seq.draft_token_ids)) for seq in batch.seqs if seq.draft_token_ids)
    monkeypatch.setattr(HeadDrafter, "fill", recording_fill)
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
