"""EAGLE-3 drafts (`--speculative-model DIR` holding `LlamaForCausalLMEagle3` weights as vLLM and SGLang load
them): greedy output equal to no speculation (batch 1 and 16 mixed requests), the sampled distribution kept
(chi-square), the draft's KV in the block budget, and refusals of drafts the model cannot feed."""
import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import chi_square_p, compare_greedy, real_engine  # noqa: E402


def make_eagle3(target, path, seed=0, trim_vocab=24, aux=(1, 1, 1)):
    """A draft in the community EAGLE-3 layout: `midlayer.*` with 2 * hidden q/k/v inputs, `fc` over three
    layer inputs, `lm_head` over a draft vocabulary with `d2t`; random non-zero weights, except that fc passes
    the third feature through and lm_head is the target's (so some drafts are right)."""
    path.mkdir()
    target_config = json.loads((target / "config.json").read_text())
    weights = load_file(target / "model.safetensors")
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    vocab, hidden = head.shape
    heads, kv = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim, inter = target_config["head_dim"], target_config["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale
    draft_vocab = vocab - trim_vocab
    fc = rand(hidden, 3 * hidden)
    fc[:, 2 * hidden:] += torch.eye(hidden)
    tensors = {
        "fc.weight": fc, "norm.weight": torch.ones(hidden) + rand(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden), "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "lm_head.weight": head[:draft_vocab].clone(), "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    save_file(tensors, path / "model.safetensors")
    config = {key: target_config[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "intermediate_size", "rms_norm_eps", "vocab_size",
                                                  "max_position_embeddings")}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=draft_vocab, rope_theta=target_config["rope_theta"],
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux)})
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {name: make_eagle3(test_model_path(name), root / name) for name in ("tiny-llama", "tiny-qwen3")}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_greedy_with_an_eagle3_draft_is_identical(name, drafts):
    stats = compare_greedy(name, {"speculative_model": str(drafts[name])})
    assert stats.speculative_method == "eagle3"


def test_sampled_token_distribution_is_kept_with_an_eagle3_draft(drafts):
    num_draws = 200
    params = [SamplingParams(do_sample=True, seed=seed, temperature=1.0, top_k=2, max_new_tokens=4,
                             ignore_eos=True) for seed in range(num_draws)]
    counts = {}
    for use_draft in (False, True):
        config = {"speculate": 3, "speculative_model": str(drafts["tiny-llama"])} if use_draft else {}
        with real_engine("tiny-llama", **config) as engine:
            start = engine.tokenizer.encode("one two three")
            ids = start + [t.id for t in engine.generate([start], SamplingParams(max_new_tokens=24))[0].tokens]
            outs = engine.generate([ids] * num_draws, params)
            stats = engine.stats()
        counts[use_draft] = [{} for _ in range(4)]
        for out in outs:
            for position, token in enumerate(out.tokens):
                counts[use_draft][position][token.id] = counts[use_draft][position].get(token.id, 0) + 1
    assert 0.05 < stats.num_speculative_accepted_total / stats.num_speculative_proposed_total < 0.95, stats
    p_values = [chi_square_p(counts[False][k], counts[True][k]) for k in range(4)]
    assert min(p_values) > 1e-3 / 4, p_values


def test_eagle3_drafts_the_model_cannot_feed_are_refused_before_loading(tmp_path):
    target = test_model_path("tiny-llama")
    with pytest.raises(ValueError, match=r"aux hidden-state layers \[2, 1, -1\]"):
        real_engine("tiny-llama", speculate=3, speculative_model=str(make_eagle3(target, tmp_path / "a", aux=())))
    wrong = make_eagle3(target, tmp_path / "b")
    tensors = load_file(wrong / "model.safetensors")
    tensors["fc.weight"] = torch.ones(64, 96)
    save_file(tensors, wrong / "model.safetensors")
    with pytest.raises(ValueError, match=r"fc.weight is \[64, 96\], the model needs \[64, 192\]"):
        real_engine("tiny-llama", speculate=3, speculative_model=str(wrong))
    tensors["fc.weight"], tensors["d2t"] = torch.ones(64, 192), torch.full((1000,), 500)
    save_file(tensors, wrong / "model.safetensors")
    with pytest.raises(ValueError, match="past the model's vocabulary"):
        real_engine("tiny-llama", speculate=3, speculative_model=str(wrong))
    with pytest.raises(ValueError, match="not supported with --num-shard > 1"):
        real_engine("tiny-llama", speculate=3, num_shard=2, speculative_model=str(make_eagle3(target, tmp_path / "c")))
