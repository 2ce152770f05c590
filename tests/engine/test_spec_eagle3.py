"""EAGLE-3 drafts (`--speculative-model DIR` holding `LlamaForCausalLMEagle3` weights as vLLM and SGLang load
them): greedy output equal to no speculation (batch 1 and 16 mixed requests), its drafts equal to a plain
reference of the layer, the sampled distribution kept (chi-square), and refusals of drafts the model cannot
feed."""
import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import (assert_same_distribution, compare_greedy, loop_sampled_counts, real_engine,  # noqa: E402
                              record_head_drafts)


def make_eagle3(target, path, seed=0, trim_vocab=24, aux=(1, 1, 1), draft_tokens=None):
    """A draft in the community EAGLE-3 layout: `midlayer.*` with 2 * hidden q/k/v inputs, `fc` over three
    layer inputs, `lm_head` over a draft vocabulary with `d2t`; random non-zero weights, except that fc passes
    the third feature through and lm_head is the target's (so some drafts are right). `draft_tokens`: a draft
    vocabulary of just these target tokens (random lm_head), e.g. the ones the target samples most."""
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
    if draft_tokens is not None:
        draft_vocab = len(draft_tokens)
        tensors["lm_head.weight"] = rand(draft_vocab, hidden, scale=1.0)
        tensors["d2t"] = torch.tensor(draft_tokens) - torch.arange(draft_vocab)
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
    return {"tiny-llama": make_eagle3(test_model_path("tiny-llama"), tmp_path_factory.mktemp("eagle3") / "d")}


@pytest.mark.parametrize("pieces", [None, [1, 2, 4, 8, 16, 32, 64, 96, 128]])
def test_greedy_with_an_eagle3_draft_is_identical(tmp_path, pieces, monkeypatch):
    monkeypatch.delenv("TGI_HPC_PIECEWISE_CPU", raising=False)   # None: no pieces
    draft = make_eagle3(test_model_path("tiny-qwen3"), tmp_path / "q")
    _, stats = compare_greedy("tiny-qwen3", {"speculative_model": str(draft), "piecewise_graphs": pieces}, max_new=16)
    assert stats.speculative_method == "eagle3"
    assert (stats.forward_steps.get("piecewise_graphs", 0) > 0) == bool(pieces)


def test_sampled_token_distribution_is_kept_with_an_eagle3_draft(tmp_path):
    base, _ = loop_sampled_counts({})
    totals = {}     # a draft vocabulary of the two tokens the target samples most: both outcomes are common
    for position in base:
        for token, n in position.items():
            totals[token] = totals.get(token, 0) + n
    draft = make_eagle3(test_model_path("tiny-llama"), tmp_path / "d", draft_tokens=sorted(totals, key=totals.get)[-2:])
    assert_same_distribution(base, *loop_sampled_counts({"speculate": 3, "speculative_model": str(draft)}))


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
    with pytest.raises(ValueError, match="reads the generic decoder's layers; .* --model-impl native"):
        real_engine("tiny-llama", speculate=3, model_impl="transformers", speculative_model=str(tmp_path / "c"))


def reference_drafts(target_dir, draft_dir, ids, num_drafts):
    """EAGLE-3 drafting written out plainly: transformers' model for the target's layer inputs, the draft
    layer over the whole sequence with causal attention, then one position per further draft."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = json.loads((draft_dir / "config.json").read_text())
    w = load_file(draft_dir / "model.safetensors")
    aux = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps = config["rms_norm_eps"]

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):
        inv = 1.0 / config["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        freqs = torch.outer(pos.float(), inv)
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        next_token = int(out.logits[0, -1].argmax())
        features = torch.cat([out.hidden_states[i][0] for i in aux], -1) @ w["fc.weight"].T
        tokens, keys, values, drafts = ids[1:] + [next_token], [], [], []
        positions = torch.arange(len(ids))
        for _ in range(num_drafts):
            embeds = rms(model.model.embed_tokens(torch.tensor(tokens)), w["midlayer.input_layernorm.weight"])
            x = torch.cat([embeds, rms(features, w["midlayer.hidden_norm.weight"])], -1)
            q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, d), positions)
            keys.append(rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, kv, d), positions))
            values.append((x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, kv, d))
            k, v = torch.cat(keys).repeat_interleave(heads // kv, 1), torch.cat(values).repeat_interleave(heads // kv, 1)
            mask = positions[:, None] >= torch.arange(len(k))[None]
            attn = torch.softmax((q.transpose(0, 1) @ k.permute(1, 2, 0)) * d ** -0.5 + torch.where(mask, 0, -1e9), -1)
            h = (attn @ v.transpose(0, 1)).transpose(0, 1).reshape(len(q), -1) @ w["midlayer.self_attn.o_proj.weight"].T
            h = h + features
            mlp_in = rms(h, w["midlayer.post_attention_layernorm.weight"])
            m = (torch.nn.functional.silu(mlp_in @ w["midlayer.mlp.gate_proj.weight"].T)
                 * (mlp_in @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
            prenorm = m + h
            best = int((rms(prenorm[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            drafts.append(best + int(w["d2t"][best]))
            tokens, features, positions = [best], prenorm[-1:], positions[-1:] + 1
    return next_token, drafts


# piecewise graphs (engine/piecewise_graphs.py): the layer inputs come from the tensors kept at capture
@pytest.mark.parametrize("pieces", [None, [1, 2, 4, 8, 16, 32]])
def test_eagle3_drafts_equal_a_plain_reference_of_the_layer(drafts, monkeypatch, pieces):
    monkeypatch.delenv("TGI_HPC_PIECEWISE_CPU", raising=False)   # None: no pieces
    seen = record_head_drafts(monkeypatch)
    with real_engine("tiny-llama", speculate=3, speculative_model=str(drafts["tiny-llama"]),
                     piecewise_graphs=pieces) as engine:
        assert engine.runner.piecewise_graph_sizes == (pieces or [])
        ids = engine.tokenizer.encode("Hello world, this is a test of the drafts")
        engine.generate([ids], SamplingParams(max_new_tokens=8))
        if pieces:
            assert engine.stats().forward_steps["piecewise_graphs"] >= 2
    context, got = seen[0]                              # the first decode: the whole prompt caught up, then a chain
    next_token, expected = reference_drafts(test_model_path("tiny-llama"), drafts["tiny-llama"], ids, 3)
    assert context == ids + [next_token]
    assert got == expected
    context, got = seen[1]                              # the next: the verified tokens caught up, then a chain
    assert got == reference_drafts(test_model_path("tiny-llama"), drafts["tiny-llama"], context[:-1], 3)[1]
