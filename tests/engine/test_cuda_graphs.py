"""Decode CUDA graphs: padding to a captured size, static buffers, the scratch block and the
start-up self-check. Off CUDA, `capture` records a re-run of the forward on the same buffers
instead of a graph, and flash-attn's kernels are CPU stand-ins: this checks everything around the
graph; the real capture is in test_model_runner's gpu-marked test."""
import pytest

torch = pytest.importorskip("torch")

from engine.attention.flash import FlashBackend  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.cuda_graphs import DecodeGraphs, batch_sizes, matches_eager  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_inputs import prepare_inputs  # noqa: E402
from engine.models import model_class  # noqa: E402
from engine.weights import load_safetensors  # noqa: E402
from flash_reference import reference_flash_kvcache, reference_flash_varlen  # noqa: E402

BLOCK = 8
NUM_BLOCKS = 12  # + 1 scratch block at index NUM_BLOCKS


def load(path, decode_fn=reference_flash_kvcache, backend=None):
    """A tiny model on the flash backend (CPU stand-ins) with its paged cache; cache[NUM_BLOCKS] is scratch.
    Returns the model, its attention layers, their windows and the backend."""
    config = ModelConfig.from_pretrained(path)
    model = model_class(config)(config)
    load_safetensors(model, str(path), model.packed_modules_mapping, skip=model.skipped_checkpoint_tensors())
    layers = model.attention_layers()
    cache = torch.zeros(2, len(layers), NUM_BLOCKS + 1, BLOCK, layers[0].num_kv_heads, config.head_dim)
    backend = backend or FlashBackend(reference_flash_varlen, decode_fn)
    for i, layer in enumerate(layers):
        layer.impl = backend
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    windows = {layer.sliding_window for layer in layers}
    return model.eval(), layers, windows


def graphs_for(model, sizes=(1, 2, 4), max_blocks=4):
    backend = model.attention_layers()[0].impl
    graphs = DecodeGraphs(model, backend, list(sizes), max_blocks=max_blocks, block_size=BLOCK,
                          scratch_block=NUM_BLOCKS, device=torch.device("cpu"))
    graphs.capture()
    return graphs


@torch.inference_mode()
def eager(model, spans, windows):
    backend = model.attention_layers()[0].impl
    inputs = prepare_inputs(spans, BLOCK, torch.device("cpu"), backend, windows)
    return model(inputs.input_ids, inputs.positions, inputs.attention)


def test_default_sizes_and_limits():
    assert batch_sizes(None, False, None) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_sizes(None, False, 24) == [1, 2, 4, 8, 16, 24]      # a full batch replays a graph too
    assert batch_sizes(None, False, 300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert batch_sizes(None, False, 4096)[-2:] == [256, 512]          # larger batches decode eagerly
    assert batch_sizes([8, 3], False, 24) == [3, 8]                   # an explicit list is taken as given
    assert batch_sizes([8, 3, 3, 0], False, None) == [3, 8]
    assert batch_sizes([], False, None) == [] and batch_sizes(None, True, None) == []


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen3"])
def test_padded_replay_gives_the_eager_hidden_states(model_path, name):
    model, layers, windows = load(model_path(name))
    graphs = graphs_for(model)
    with torch.inference_mode():
        for layer in layers:  # a context to attend to
            layer.k_cache[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(1))
            layer.v_cache[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(2))
    # 3 sequences -> the size-4 graph with one padding row; scattered, partly filled block tables
    spans = [SeqSpan(0, [11], 20, [5, 2, 9]), SeqSpan(1, [12], 0, [7]), SeqSpan(2, [13], 29, [1, 3, 4, 0])]
    scratch_before = layers[0].k_cache[NUM_BLOCKS].clone()
    replayed = graphs.run(spans).clone()
    assert replayed.shape[0] == 3
    assert not torch.equal(layers[0].k_cache[NUM_BLOCKS], scratch_before)  # the padding row wrote to scratch only
    torch.testing.assert_close(replayed, eager(model, spans, windows), atol=1e-5, rtol=1e-5)
    for count in (1, 2, 4):  # every captured size, exact fits
        subset = spans[:count] if count <= 3 else spans + [SeqSpan(3, [14], 3, [6])]
        torch.testing.assert_close(graphs.run(subset).clone(), eager(model, subset, windows), atol=1e-5, rtol=1e-5)


def test_padded_replay_with_the_triton_kernels(model_path):
    """The Triton backend inside graphs: static metadata, fixed length bound, preallocated split-KV buffers
    (the kernels run interpreted here; the real capture is in the gpu-marked tests)."""
    from engine.attention.triton_backend import TritonBackend

    model, layers, windows = load(model_path("tiny-mistral"), backend=TritonBackend())
    graphs = graphs_for(model, sizes=(1, 4), max_blocks=4)
    with torch.inference_mode():
        for layer in layers:
            layer.k_cache[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(1))
            layer.v_cache[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(2))
    spans = [SeqSpan(0, [11], 20, [5, 2, 9]), SeqSpan(1, [12], 0, [7]), SeqSpan(2, [13], 29, [1, 3, 4, 0])]
    assert graphs.workspace is not None
    torch.testing.assert_close(graphs.run(spans).clone(), eager(model, spans, windows), atol=1e-5, rtol=1e-5)
    assert matches_eager(graphs, layers, windows, tolerance=1e-4)


def test_only_decode_batches_that_fit_are_replayed(model_path):
    graphs = graphs_for(load(model_path("tiny-llama"))[0], sizes=(1, 2), max_blocks=2)
    decode = SeqSpan(0, [1], 9, [0, 1])
    assert graphs.can_run([decode, decode])
    assert not graphs.can_run([])
    assert not graphs.can_run([decode] * 3)                              # above the largest graph
    assert not graphs.can_run([SeqSpan(0, [1, 2], 0, [0])])              # prefill
    assert not graphs.can_run([SeqSpan(0, [1], 9, [0, 1], "all")])      # prefill logprobs
    assert not graphs.can_run([SeqSpan(0, [1], 17, [0, 1, 2])])          # longer than the graphs' block table


def test_self_check_accepts_the_right_kernel_and_rejects_wrong_ones(model_path):
    """Wrong decode kernels are caught by the backend's start-up check against the reference; the graph
    check (replay == eager) catches what only graphs break: lengths read on the host, capture errors."""
    from engine.attention.selection import self_check

    path = model_path("tiny-mistral")
    model, layers, windows = load(path)
    assert matches_eager(graphs_for(model), layers, windows, tolerance=1e-4)
    assert self_check(layers[0].impl, torch.device("cpu"), torch.float32, layers, 256) is None

    def no_window(*args, window_size, **kwargs):
        return reference_flash_kvcache(*args, window_size=(-1, -1), **kwargs)

    def off_by_one(q, k_cache, v_cache, *, cache_seqlens, **kwargs):
        return reference_flash_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens - 1 + (cache_seqlens == 1),
                                       **kwargs)

    for wrong in (no_window, off_by_one):
        backend = FlashBackend(reference_flash_varlen, wrong)
        assert "differs from the reference" in self_check(backend, torch.device("cpu"), torch.float32, layers, 256)

    def host_lengths(q, k_cache, v_cache, *, cache_seqlens, **kwargs):  # frozen into a graph: stale at replay
        lengths = torch.tensor(host_lengths.seen[-1]) if host_lengths.seen else cache_seqlens
        host_lengths.seen.append(cache_seqlens.tolist())
        return reference_flash_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.to(torch.int32), **kwargs)

    host_lengths.seen = []
    model, layers, windows = load(path, decode_fn=host_lengths)
    assert not matches_eager(graphs_for(model), layers, windows, tolerance=1e-4)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    model, layers, windows = load(path, decode_fn=broken)
    with pytest.raises(RuntimeError, match="capturing"):
        graphs_for(model)  # the worker catches this and runs eagerly
