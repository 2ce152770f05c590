"""Multi-LoRA: PEFT adapters (built with the real `peft`) served beside the base model.

Greedy tokens through the engine equal transformers' with the adapter merged (fp32, CPU); one batch mixing
adapters and the base model gives every row its own tokens; TP=2 gives TP=1's logits; every adapter or
request the engine cannot serve is refused with one clear line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from engine.batch import SeqSpan  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.launcher import parse_args, to_config  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora.adapter import LoraError, read_adapters  # noqa: E402
from engine.lora.names import parse_lora_adapters  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from lora_adapters import ALL_TARGETS, make_adapter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog and then runs far away into the woods", "x"]


@pytest.fixture(scope="module")
def tiny(model_path, tmp_path_factory):
    """tiny-llama, two adapters on it and the merged reference models."""
    from transformers import AutoModelForCausalLM

    base = model_path("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    # a1: every target, per-module rank and alpha; a2: attention only, rsLoRA, another rank
    merged_a1 = make_adapter(base, root / "a1", seed=1, r=4, alpha=8, rank_pattern={"v_proj": 2},
                             alpha_pattern={"down_proj": 3})
    merged_a2 = make_adapter(base, root / "a2", seed=2, r=6, alpha=5, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                             use_rslora=True)
    return {"base": base, "a1": root / "a1", "a2": root / "a2", "merged": {
        "a1": merged_a1, "a2": merged_a2, None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()}}


def engine_with(base, adapters, **config):
    config = {"device": "cpu", "dtype": "float32", "block_size": 4, "cpu_kv_cache_bytes": 16 * 1024**2, **config}
    return LLMEngine(EngineConfig(model_id=str(base), lora_adapters=[(name, str(path)) for name, path in adapters],
                                  **config))


def greedy(adapter, n=12):
    return SamplingParams(max_new_tokens=n, adapter_id=adapter)


def generate_with_each_adapter(engine, prompts):
    """Every prompt with a1, the base and a2, interleaved in one batch: the (prompt, adapter) pairs, the outputs."""
    pairs = [(i, a) for a in ("a1", None, "a2") for i in range(len(prompts))]
    return pairs, engine.generate([prompts[i] for i, _ in pairs], [greedy(a) for _, a in pairs])


def assert_each_row_is_its_merged_model(tiny, prompts, pairs, outs):
    for (i, a), out in zip(pairs, outs):
        assert [t.id for t in out.tokens] == hf_greedy(tiny["merged"][a], prompts[i], 12), (i, a)


def test_greedy_tokens_equal_the_merged_peft_model_and_the_adapters_change_them(tiny):
    with engine_with(tiny["base"], [("a1", tiny["a1"]), ("a2", tiny["a2"])]) as engine:
        assert engine.runner.lora_backend == "grouped"
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        for adapter in ("a1", "a2", None):
            outs = engine.generate(prompts, greedy(adapter))
            for ids, out in zip(prompts, outs):
                assert [t.id for t in out.tokens] == hf_greedy(tiny["merged"][adapter], ids, 12), adapter
    for ids in prompts:  # the adapters are not no-ops (PEFT's default zero lora_B would be)
        tokens = {name: tuple(hf_greedy(model, ids, 12)) for name, model in tiny["merged"].items()}
        assert len(set(tokens.values())) == 3


def test_one_batch_mixing_adapters_and_the_base_gives_each_row_its_own_tokens(tiny):
    with engine_with(tiny["base"], [("a1", tiny["a1"]), ("a2", tiny["a2"])], max_batch_prefill_tokens=24) as engine:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        alone = {(i, a): [t.id for t in engine.generate([p], greedy(a))[0].tokens]
                 for i, p in enumerate(prompts) for a in ("a1", "a2", None)}
        # the same prompts again, every (prompt, adapter) pair in one batch, interleaved; the prefix cache is
        # warm now, so a shared KV block between adapters would change tokens
        pairs, outs = generate_with_each_adapter(engine, prompts)
    for (i, a), out in zip(pairs, outs):
        assert [t.id for t in out.tokens] == alone[(i, a)], (i, a)


def test_speculative_decoding_verifies_drafts_with_each_rows_adapter(tiny):
    # repetitive prompts: the n-gram proposer drafts, the adapted model must accept or correct every draft
    prompts_text = ["a b c a b c a b c a b", "one two one two one two one"]
    with engine_with(tiny["base"], [("a1", tiny["a1"]), ("a2", tiny["a2"])], speculate=3) as engine:
        prompts = [engine.tokenizer.encode(t) for t in prompts_text]
        pairs, outs = generate_with_each_adapter(engine, prompts)
        assert engine.stats().num_speculative_proposed_total > 0
    assert_each_row_is_its_merged_model(tiny, prompts, pairs, outs)


def test_piecewise_graphs_give_each_row_its_adapter_in_mixed_steps(tiny, monkeypatch):
    """The pieces read a static token -> adapter map (engine/lora/batch.py): every row against its merged model."""
    from engine.piecewise_graphs import PiecewiseGraphs
    replays, run = [], PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, inputs: replays.append(1) or run(self, inputs))
    sizes = [4, 8, 16, 24, 32, 40, 48]
    with engine_with(tiny["base"], [("a1", tiny["a1"]), ("a2", tiny["a2"])], max_batch_prefill_tokens=24,
                     piecewise_graphs=sizes, speculate=2) as engine:
        assert engine.runner.piecewise_graph_sizes == sizes
        prompts = [engine.tokenizer.encode(t) for t in TEXTS + ["a b c a b c a b c a b"]]
        pairs, outs = generate_with_each_adapter(engine, prompts)
    assert len(replays) > 3
    assert_each_row_is_its_merged_model(tiny, prompts, pairs, outs)


def test_steps_ahead_give_each_row_its_adapter(tiny):
    """Async scheduling with adapters: a step ahead's decodes read their tokens from the picks in flight, then the
    worker groups the spans by adapter, so each input id must follow its span to its new row. Every row against its
    merged model, mixed with prompt chunks, and most steps ahead."""
    with engine_with(tiny["base"], [("a1", tiny["a1"]), ("a2", tiny["a2"])], max_batch_prefill_tokens=24,
                     async_scheduling="on") as engine:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        pairs, outs = generate_with_each_adapter(engine, prompts)
        assert engine.stats().num_steps_ahead_total > 8
    assert_each_row_is_its_merged_model(tiny, prompts, pairs, outs)


def test_the_prefix_cache_never_shares_blocks_between_adapters():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(13))

    def seq(adapter):
        s = Sequence(adapter, f"r{adapter}", list(tokens), SamplingParams(), max_tokens=64)
        s.adapter = s.adapter_key = adapter
        return s

    first = seq(1)
    bm.allocate(first, 13)
    first.num_computed_tokens = 13
    bm.mark_computed(first)
    assert bm.num_cached_tokens(seq(1)) == 12
    assert bm.num_cached_tokens(seq(0)) == 0 and bm.num_cached_tokens(seq(2)) == 0


@pytest.mark.slow
def test_smollm2_adapter_matches_merged(model_path, tmp_path):
    base = model_path("smollm2")
    merged = make_adapter(base, tmp_path / "s", seed=3, r=8, alpha=16, use_rslora=True,
                          targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    with engine_with(base, [("smol", tmp_path / "s")], cpu_kv_cache_bytes=8 * 1024**2) as engine:
        ids = engine.tokenizer.encode("The capital of France is")
        out = engine.generate([ids, ids], [greedy("smol", 8), greedy(None, 8)])
    assert [t.id for t in out[0].tokens] == hf_greedy(merged, ids, 8)
    assert [t.id for t in out[0].tokens] != [t.id for t in out[1].tokens]


def test_unknown_adapter_id_is_refused_naming_the_loaded_ones(tiny):
    with engine_with(tiny["base"], [("a1", tiny["a1"])]) as engine:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; loaded adapters: a1"):
            engine.add_request("r", [1, 2, 3], greedy("nope"))
        assert not engine.has_unfinished_requests()


def test_two_shards_give_the_same_logits_as_one(tiny):
    from engine.model_runner import ModelRunner

    def logits(num_shard):
        config = EngineConfig(model_id=str(tiny["base"]), device="cpu", block_size=4, cpu_kv_cache_bytes=2**20,
                              num_shard=num_shard, master_port=0,
                              lora_adapters=[("a1", str(tiny["a1"])), ("a2", str(tiny["a2"]))])
        with ModelRunner(config, ModelConfig.from_pretrained(tiny["base"])) as runner:
            assert runner.lora_backend == "grouped"
            spans = [SeqSpan(0, list(range(3, 13)), 0, [1, 2, 3], "all", adapter=1),
                     SeqSpan(1, list(range(20, 27)), 0, [4, 5], "all", adapter=0),
                     SeqSpan(2, list(range(3, 12)), 0, [6, 7, 8], "all", adapter=2)]
            _, rows = runner.run(spans)
            return torch.cat([rows[i] for i in range(3)])

    expected = logits(1)
    torch.testing.assert_close(logits(2), expected, atol=1e-4, rtol=0)


# --- the flag and the adapter checks: one clear line each ----------------------------------------

def test_flag_parsing_names_paths_and_env_twin(tmp_path):
    assert parse_lora_adapters("a=/x/a, b=/y/b/,") == [("a", "/x/a"), ("b", "/y/b/")]
    assert parse_lora_adapters("/models/my-adapter/") == [("my-adapter", "/models/my-adapter/")]
    args = parse_args(["--model-id", "m"], {"LORA_ADAPTERS": "org/name=/p"})
    assert to_config(args, "m").lora_adapters == [("org/name", "/p")]
    for bad, message in [("a=/x,a=/y", "given twice"), ("a=", "has no path"), ("a b=/x", "not valid"),
                         ("=/x", "not valid")]:
        with pytest.raises(ValueError, match=message):
            parse_lora_adapters(bad)


def check(tiny, pairs, base_name="tiny-llama"):
    return read_adapters([(n, str(p)) for n, p in pairs], ModelConfig.from_pretrained(tiny["base"]), base_name)


def edited_copy(tiny, tmp_path, **changes):
    target = tmp_path / "edited"
    shutil.copytree(tiny["a1"], target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return target


def test_hostile_adapters_fail_at_start_with_one_line(tiny, tmp_path, model_path):
    (tmp_path / "empty").mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny["a1"] / "adapter_config.json", no_weights)
    (no_weights / "adapter_model.bin").write_bytes(b"x")
    junk = tmp_path / "junk"
    shutil.copytree(tiny["a1"], junk)
    (junk / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    cases = [
        ([("x", tmp_path / "missing")], "no such directory"),
        ([("x", tmp_path / "empty")], "adapter_config.json is missing"),
        ([("x", no_weights)], "adapter_model.safetensors is missing .*safe_serialization"),
        ([("x", junk)], "cannot read adapter_model.safetensors"),
        ([("x", edited_copy(tiny, tmp_path, use_dora=True))], "DoRA"),
        ([("a1", tiny["a1"]), ("a1", tiny["a2"])], "given twice"),
        ([("tiny-llama", tiny["a1"])], "base model's name"),
        ([("tgi", tiny["a1"])], "base model's name"),
    ]
    for pairs, message in cases:
        with pytest.raises(ValueError, match=message) as info:  # LoraError for the files, ValueError for names
            check(tiny, pairs)
        assert "\n" not in str(info.value)
    shutil.rmtree(tmp_path / "edited")
    with pytest.raises(LoraError, match=r"modules_to_save"):
        check(tiny, [("x", edited_copy(tiny, tmp_path, modules_to_save=["lm_head"]))])


def test_adapters_for_another_model_or_other_modules_are_refused(tiny, model_path, tmp_path):
    make_adapter(model_path("smollm2"), tmp_path / "smol", targets=["q_proj"])
    with pytest.raises(LoraError, match=r"does not fit this base model \(it was trained on .*smollm2.*q_proj"):
        check(tiny, [("smol", tmp_path / "smol")])
    make_adapter(tiny["base"], tmp_path / "embed", targets=["q_proj", "embed_tokens"])
    with pytest.raises(LoraError, match=r"'base_model.model.model.embed_tokens.*' is not a lora_A/lora_B weight"):
        check(tiny, [("e", tmp_path / "embed")])
    # a Phi-3-style fused target: the engine fuses q/k/v itself and adapts only the separate projections
    from safetensors.torch import load_file, save_file

    fused = tmp_path / "fused"
    shutil.copytree(tiny["a1"], fused)
    tensors = load_file(fused / "adapter_model.safetensors")
    save_file({k.replace(".q_proj.", ".qkv_proj."): v for k, v in tensors.items()}, fused / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"target modules \['model.layers.0.self_attn.qkv_proj', .*\] are not "
                                        r"supported for LlamaForCausalLM; supported: q_proj, k_proj"):
        check(tiny, [("f", fused)])


def test_the_engine_refuses_a_bad_adapter_before_loading_the_model(tiny, tmp_path):
    with pytest.raises(LoraError, match="no such directory"):
        engine_with(tiny["base"], [("a", tmp_path / "nothing")])


@pytest.mark.parametrize("targets", [["q_proj"], ALL_TARGETS[4:]])
def test_single_target_groups_match_merged(tiny, tmp_path, targets):
    merged = make_adapter(tiny["base"], tmp_path / "t", seed=5, targets=targets)
    with engine_with(tiny["base"], [("t", tmp_path / "t")]) as engine:
        ids = engine.tokenizer.encode(TEXTS[1])
        (out,) = engine.generate([ids], greedy("t"))
    assert [t.id for t in out.tokens] == hf_greedy(merged, ids, 12)


# --- over HTTP: the real launcher and the real clients ------------------------------------------

@pytest.mark.slow
def test_clients_pick_adapters_by_adapter_id_and_openai_model(tiny, tmp_path):
    import httpx
    import openai
    from test_clients import start_server, stop_server

    proc, url, _ = start_server(tiny["base"], tmp_path, "--served-model-name", "tiny", "--kv-cache-bytes", "16MiB",
                                "--lora-adapters", f"a1={tiny['a1']},{tiny['a2']}")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
        assert [m.id for m in client.models.list().data] == ["tiny", "a1", "a2"]
        info = httpx.get(f"{url}/info").json()
        assert (info["lora_adapters"], info["lora_backend"]) == (["a1", "a2"], "grouped")
        assert info["lora_checks"] == {"triton": "needs CUDA", "grouped": "ok"}
        prompt = TEXTS[1]

        def generate(adapter_id):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True, "adapter_id": adapter_id}}
            r = httpx.post(f"{url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()
        from transformers import AutoTokenizer
        prompt_ids = AutoTokenizer.from_pretrained(tiny["base"])(prompt)["input_ids"]
        texts = {}
        for adapter in ("a1", "a2", None):
            out = generate(adapter)
            assert [t["id"] for t in out["details"]["tokens"]] == hf_greedy(tiny["merged"][adapter], prompt_ids, 8)
            texts[adapter] = out["generated_text"]
        assert len(set(texts.values())) == 3
        for model, adapter in (("a1", "a1"), ("a2", "a2"), ("tiny", None), ("tgi", None)):
            completion = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            assert completion.choices[0].text == texts[adapter], model
            assert completion.model == (model if adapter else "tiny")
        r = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": {"adapter_id": "nope"}})
        assert r.status_code == 422 and r.json()["error_type"] == "validation"
        error = r.json()["error"]
        assert "unknown adapter 'nope': loaded adapters are 'a1', 'a2' (or 'tiny' for the base model)" in error
        chat = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0, stream=True)
        assert {chunk.model for chunk in chat} == {"a2"}
        metrics = httpx.get(f"{url}/metrics").text
        assert 'tgi_lora_request_count{adapter="a1"} 2.0' in metrics  # /generate and a completion
        assert 'tgi_lora_request_count{adapter="a2"} 3.0' in metrics  # and the chat stream
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            client.completions.create(model="a3", prompt=prompt, max_tokens=2)
        assert "unknown adapter 'a3': loaded adapters are 'a1', 'a2'" in refused.value.response.json()["error"]
    finally:
        stop_server(proc)


def test_adapters_on_a_quantized_base_match_the_merged_dequantized_model(tiny, tmp_path):
    from quant_packers import build

    quant, reference = build("gptq", dict(bits=4, group_size=16), tiny["base"], tmp_path)
    merged = make_adapter(reference, tmp_path / "q", seed=7)
    with engine_with(quant, [("q", tmp_path / "q")]) as engine:
        ids = engine.tokenizer.encode(TEXTS[1])
        (out,) = engine.generate([ids], greedy("q"))
    assert [t.id for t in out.tokens] == hf_greedy(merged, ids, 12)


@pytest.mark.gpu
def test_gpu_triton_lora_backend_matches_merged_and_the_cpu_tokens(tiny):
    """On CUDA the Triton kernels are chosen (self-check passed) and give the merged model's tokens."""
    config = dict(device="cuda", cuda_graphs=[4])  # graphs asked for: LoRA turns them off
    with engine_with(tiny["base"], [("a1", tiny["a1"]), ("a2", tiny["a2"])], **config) as engine:
        assert engine.runner.lora_backend == "triton", engine.runner.lora_checks
        assert engine.runner.cuda_graph_sizes == []
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        pairs, outs = generate_with_each_adapter(engine, prompts)
    assert_each_row_is_its_merged_model(tiny, prompts, pairs, outs)


def test_the_launcher_exits_with_one_line_for_a_bad_adapter(tiny, tmp_path):
    dora = edited_copy(tiny, tmp_path, use_dora=True)
    proc = subprocess.run([sys.executable, "-m", "engine", "--model-id", str(tiny["base"]), "--port", "0",
                           "--hostname", "127.0.0.1", "--lora-adapters", f"good={tiny['a1']},bad={dora}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "LoRA adapter 'bad'" in errors[0] and "DoRA (use_dora) is not supported" in errors[0]
    assert "Traceback" not in proc.stderr
