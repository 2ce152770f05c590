"""Piecewise graphs (engine/piecewise_graphs.py): the forward cut at attention, on static buffers padded to a
captured token count, attention on the real rows only. Off CUDA there is no capture: the same split forward
runs uncaptured, which checks the padding, the buffers, the cut and the step paths on CPU; greedy equality
with transformers for every family, with a draft model, n-gram drafts and two tensor-parallel shards. The
real capture runs in the gpu-marked test at the end."""
import pytest

torch = pytest.importorskip("torch")

from prometheus_client import generate_latest  # noqa: E402

from engine import piecewise_graphs  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.launcher import parse_args, to_config  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from engine.model_inputs import prepare_inputs  # noqa: E402
from engine.models.decoder import DecoderModel  # noqa: E402
from engine.piecewise_graphs import PiecewiseGraphs, matches_eager, token_sizes  # noqa: E402
from engine.server.metrics import ServerMetrics  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_cuda_graphs import BLOCK, NUM_BLOCKS, load  # noqa: E402
from test_models_families import (FAMILIES, assert_generations_match, engine_for, hf_generate,  # noqa: E402,F401
                                  mixed_requests, TEXT)

SIZES = [1, 2, 4, 8, 16, 32, 48, 64]   # a step here is at most 40 prefill tokens + 16 decodes


class Count(list):
    models: set


@pytest.fixture
def replays(monkeypatch):
    """How many forwards ran through the pieces (so no test passes by falling back to the eager forward);
    `count.models`: the models whose pieces ran."""
    count = Count([0])
    count.models = set()
    run = PiecewiseGraphs.run

    def counted(self, inputs):
        count[0] += 1
        count.models.add(id(self.model))
        return run(self, inputs)

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    return count


def test_default_ladder_and_explicit_lists():
    sizes = token_sizes(None, False, 4096 + 50 + 256, 256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and 240 in sizes and 256 in sizes and 288 in sizes
    assert sizes[-1] == 512 and all(b - a <= 32 for a, b in zip(sizes, sizes[1:]))   # larger steps: eager
    assert 24 in token_sizes(None, False, 100, 24)               # max_batch_size: a full batch pads nothing
    assert token_sizes(None, False, 100, None)[-1] == 112        # the smallest count that holds the largest step
    assert token_sizes(None, False, 96, None)[-1] == 96
    assert token_sizes(None, False, 3, 1) == [1, 2, 4]
    assert token_sizes([64, 3, 3, 0], False, 100, None) == [3, 64]
    assert token_sizes([], False, 100, None) == [] and token_sizes(None, True, 100, 8) == []
    with pytest.raises(ValueError, match=">= 1"):
        PiecewiseGraphs(torch.nn.Module(), [], torch.device("cpu"), torch.float32)


def test_launcher_flag():
    env = {"MODEL_ID": "m"}
    assert to_config(parse_args([], environ={**env, "PIECEWISE_GRAPHS": "16, 48"}), "/m").piecewise_graphs == [16, 48]
    assert to_config(parse_args(["--piecewise-graphs", "0"], environ=env), "/m").piecewise_graphs == []
    assert to_config(parse_args(["--piecewise-graphs", "64,16"], environ=env), "/m").piecewise_graphs == [64, 16]
    assert to_config(parse_args([], environ=env), "/m").piecewise_graphs is None
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", "--piecewise-graphs", "16,-1"], environ={})


def mixed_spans():
    """A prefill chunk after a cached prefix, a fresh prompt, two decodes: 20 tokens over scattered blocks."""
    return [SeqSpan(0, [11], 20, [5, 2, 9]), SeqSpan(1, list(range(30, 41)), 6, [7, 0, 10]),
            SeqSpan(2, list(range(50, 57)), 0, [1]), SeqSpan(3, [12], 3, [4])]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen3"])
def test_padded_split_forward_gives_the_eager_hidden_states_and_cache(model_path, name):
    model, layers, windows = load(model_path(name))
    backend = layers[0].impl
    with torch.inference_mode():
        for layer in layers:   # a context to attend to
            layer.k_cache.normal_(generator=torch.Generator().manual_seed(1))
            layer.v_cache.normal_(generator=torch.Generator().manual_seed(2))
    before = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
    spans = mixed_spans()
    inputs = prepare_inputs(spans, BLOCK, torch.device("cpu"), backend, windows)
    with torch.inference_mode():
        eager = model(inputs.input_ids, inputs.positions, inputs.attention).clone()
    eager_cache = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
    for layer, (k, v) in zip(layers, before):   # the same cache again, for the split forward
        layer.k_cache.copy_(k)
        layer.v_cache.copy_(v)
    graphs = PiecewiseGraphs(model, [8, 32], torch.device("cpu"), torch.float32)
    graphs.capture()
    assert graphs.layers[32] == layers                     # cut at every attention layer, in order
    with torch.inference_mode():
        graphs.input_ids.fill_(3)        # stale padding rows: whatever an earlier step left
        split = graphs.run(inputs).clone()
    assert split.shape == eager.shape == (20, model.config.hidden_size)
    torch.testing.assert_close(split, eager, atol=1e-5, rtol=1e-5)
    for layer, (k, v) in zip(layers, eager_cache):   # padding rows wrote nothing: the same cache, bit for bit
        assert torch.equal(layer.k_cache, k) and torch.equal(layer.v_cache, v)
    decode = [SeqSpan(0, [13], 21, [5, 2, 9])]        # the smallest size too, after the larger
    inputs = prepare_inputs(decode, BLOCK, torch.device("cpu"), backend, windows)
    with torch.inference_mode():
        eager = model(inputs.input_ids, inputs.positions, inputs.attention).clone()
    torch.testing.assert_close(graphs.run(inputs), eager, atol=1e-5, rtol=1e-5)


def test_a_forward_that_reaches_the_layers_in_another_order_is_refused(model_path):
    model, layers, windows = load(model_path("tiny-llama"))
    graphs = PiecewiseGraphs(model, [32], torch.device("cpu"), torch.float32)
    graphs.capture()
    graphs.layers[32] = graphs.layers[32][::-1]
    inputs = prepare_inputs(mixed_spans(), BLOCK, torch.device("cpu"), layers[0].impl, windows)
    with pytest.raises(RuntimeError, match="another order"):
        graphs.run(inputs)


def test_self_check_passes_and_catches_a_wrong_cut(model_path, monkeypatch):
    model, layers, windows = load(model_path("tiny-llama"))
    graphs = PiecewiseGraphs(model, [8, 64], torch.device("cpu"), torch.float32)
    graphs.capture()
    check = lambda: matches_eager(graphs, layers, layers[0].impl, BLOCK, windows, NUM_BLOCKS, 1e-4)  # noqa: E731
    assert check()
    monkeypatch.setattr(PiecewiseGraphs, "_attend", staticmethod(lambda layer, n, t, meta, q, k, v, out: out))
    assert not check()                                  # attention skipped between the pieces: refused
    small = PiecewiseGraphs(model, [8], torch.device("cpu"), torch.float32)
    small.capture()
    assert matches_eager(small, layers, layers[0].impl, BLOCK, windows, NUM_BLOCKS, 1e-4)  # too small to probe


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 256])
def test_the_self_check_runs_at_every_block_size(model_path, block_size, replays):
    model, layers, windows = load(model_path("tiny-llama"))
    for layer in layers:
        shape = (12 * max(1, 16 // block_size), block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    graphs = PiecewiseGraphs(model, [16], torch.device("cpu"), torch.float32)
    graphs.capture()
    assert matches_eager(graphs, layers, layers[0].impl, block_size, windows, layers[0].k_cache.shape[0], 1e-4)
    assert replays[0] == 1                               # it compared, not waved through


def test_steps_with_images_or_beyond_the_largest_count_take_the_eager_path(model_path):
    model, _, _ = load(model_path("tiny-llama"))
    graphs = PiecewiseGraphs(model, [8, 32], torch.device("cpu"), torch.float32)
    spans = mixed_spans()
    assert graphs.can_run(spans, 20) and graphs.can_run(spans, 32)
    assert not graphs.can_run(spans, 33) and not graphs.can_run([], 0)
    spans[1].images = object()
    assert not graphs.can_run(spans, 20)


@pytest.mark.parametrize("name", ["tiny-llama"] + FAMILIES)
def test_every_family_matches_transformers_through_the_pieces(name, hf_generate, replays):
    with engine_for(name, piecewise_graphs=SIZES) as engine:
        assert engine.runner.piecewise_graph_sizes == SIZES
        prompts, new_tokens = mixed_requests(engine.tokenizer)
        assert_generations_match(engine, name, hf_generate, prompts, new_tokens)
    assert replays[0] > 0


def test_a_ladder_smaller_than_the_steps_mixes_pieces_and_eager_steps(hf_generate, replays, monkeypatch):
    eager_steps = [0]
    model_forward = DecoderModel.forward

    def counted(self, *args, **kwargs):
        eager_steps[0] += Attention.split is None
        return model_forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderModel, "forward", counted)
    with engine_for("tiny-llama", piecewise_graphs=[8, 40]) as engine:
        prompts, new_tokens = mixed_requests(engine.tokenizer)
        assert_generations_match(engine, "tiny-llama", hf_generate, prompts, new_tokens)
        stats = engine.stats()
    assert replays[0] > 0 and eager_steps[0] > 0
    # /metrics counts each step's forward by path: these pieces, the eager steps, the CPU decode step's decodes
    paths, steps = stats.forward_steps, replays[0] - 1     # the start-up self-check replayed once
    assert paths["piecewise_graphs"] == steps and paths["eager"] > 0 and paths["cpu_decode_step"] > 0
    text = generate_latest(ServerMetrics(lambda: stats).registry).decode()
    assert f'tgi_forward_steps_total{{path="piecewise_graphs"}} {float(steps)}' in text


def _capture_fails(self):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("fault", ["check", "capture"])
def test_the_engine_runs_eagerly_when_the_self_check_fails(hf_generate, replays, monkeypatch, fault):
    """One rank alone falls back (with tensor parallelism a failed capture ends the start: test_tp_failures.py)."""
    if fault == "check":
        monkeypatch.setattr(piecewise_graphs, "matches_eager", lambda *args, **kwargs: False)
    else:
        monkeypatch.setattr(PiecewiseGraphs, "capture", _capture_fails)
    with engine_for("tiny-llama", piecewise_graphs=SIZES) as engine:
        assert engine.runner.piecewise_graph_sizes == []
        ids = engine.tokenizer.encode(TEXT)[:24]
        assert_generations_match(engine, "tiny-llama", hf_generate, [ids], [6])
    assert replays[0] == 0


def test_forwards_that_cannot_be_captured_are_named_and_not_tried():
    from engine.graph_check import end_capture_pool, uncapturable
    from engine.layers.quantization.bitsandbytes import BitsAndBytesLinearMethod

    cpu = torch.device("cpu")
    with engine_for("tiny-llama") as engine:
        model = engine.runner._rank0.model
        assert uncapturable(model, cpu, torch.float32) is None
        layer = next(m for m in model.modules() if hasattr(m, "method"))
        kept = layer.method
        try:
            layer.method = BitsAndBytesLinearMethod("int8")
            assert "bitsandbytes int8" in uncapturable(model, cpu, torch.float32)
            layer.method = BitsAndBytesLinearMethod("nf4")
            assert uncapturable(model, cpu, torch.float32) is None
        finally:
            layer.method = kept
    with engine_for("tiny-mixtral") as engine:   # the MoE layers' torch path (the only one on CPU)
        assert "MoE" in uncapturable(engine.runner._rank0.model, cpu, torch.float32)
    end_capture_pool(cpu, (0, 1))   # no CUDA: nothing to end, and no error


def test_off_unless_asked_on_cpu_and_with_eager(monkeypatch):
    monkeypatch.delenv("TGI_HPC_PIECEWISE_CPU", raising=False)
    with engine_for("tiny-llama") as engine:
        assert engine.runner.piecewise_graph_sizes == []
    monkeypatch.setenv("TGI_HPC_PIECEWISE_CPU", "1")        # the whole-suite switch: the default ladder
    with engine_for("tiny-llama") as engine:
        assert engine.runner.piecewise_graph_sizes == token_sizes(None, False, 40 + 256, None)
    with engine_for("tiny-llama", piecewise_graphs=SIZES, enforce_eager=True) as engine:
        assert engine.runner.piecewise_graph_sizes == []


def test_drafted_steps_verify_through_the_pieces(tmp_path, replays, monkeypatch):
    monkeypatch.delenv("TGI_HPC_PIECEWISE_CPU", raising=False)   # the engines without speculation run eagerly
    from test_spec_decode import compare_greedy
    from test_spec_draft_model import make_draft
    draft = make_draft(test_model_path("tiny-llama"), tmp_path / "draft")
    compare_greedy("tiny-llama", {"speculative_model": str(draft), "piecewise_graphs": SIZES + [96, 128]})
    drafted = replays[0]
    assert drafted > 0 and len(replays.models) == 2     # the target's pieces and the draft model's own
    compare_greedy("tiny-llama", {"piecewise_graphs": SIZES + [96, 128]})   # n-gram drafts
    assert replays[0] > drafted


def test_two_tensor_parallel_shards_through_the_pieces(hf_generate):
    with engine_for("tiny-llama", num_shard=2, piecewise_graphs=SIZES) as engine:
        assert engine.runner.piecewise_graph_sizes == SIZES    # every rank captured and agreed
        prompts, new_tokens = mixed_requests(engine.tokenizer)
        assert_generations_match(engine, "tiny-llama", hf_generate, prompts, new_tokens)


@pytest.mark.gpu
def test_captured_pieces_match_the_eager_forward_on_cuda():
    """The real capture: L + 1 graphs per size, replayed around eager attention, against the eager forward."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    outputs = {}
    for sizes in ([], [16, 64, 128]):
        config = EngineConfig(model_id=str(test_model_path("tiny-llama")), device="cuda", dtype="float32",
                              max_batch_prefill_tokens=40, piecewise_graphs=sizes, cuda_graphs=[])
        with LLMEngine(config) as engine:
            assert engine.runner.piecewise_graph_sizes == sizes
            if sizes:
                pieces = engine.runner._rank0.piecewise
                num_layers = engine.model_config.num_hidden_layers
                assert len(pieces.pieces[128]) == len(pieces.layers[128]) + 1 == num_layers + 1
            prompts, new_tokens = mixed_requests(engine.tokenizer)
            outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in new_tokens])
            outputs[bool(sizes)] = [[t.id for t in out.tokens] for out in outs]
    assert outputs[True] == outputs[False]
