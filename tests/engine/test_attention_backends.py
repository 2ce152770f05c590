"""The attention backends against the float64 reference, and the start-up choice between them.

The portable backend is checked here on randomized mixed batches; the Triton kernels have their own
file (test_triton_attention.py) and run through the same `choose_backend` in the engine tests."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.attention import build_metadata  # noqa: E402
from engine.attention import selection  # noqa: E402
from engine.attention.alibi import alibi_slopes  # noqa: E402
from engine.attention.flash import FlashBackend  # noqa: E402
from engine.attention.portable import PortableBackend  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.kernels.attention_reference import paged_attention_reference  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from flash_reference import reference_flash_kvcache, reference_flash_varlen  # noqa: E402


def random_batch(lengths, block_size, seed):
    """Spans over shuffled blocks; lengths = [(new tokens, cached tokens)]."""
    rng = random.Random(seed)
    needed = [-(-(q + c) // block_size) for q, c in lengths]
    blocks = list(range(1, 2 * sum(needed) + 2))
    rng.shuffle(blocks)
    spans = []
    for seq_id, ((q, cached), count) in enumerate(zip(lengths, needed)):
        spans.append(SeqSpan(seq_id, [0] * q, cached, blocks[:count]))
        blocks = blocks[count:]
    return spans, 2 * sum(needed) + 2


def run_backend(backend, spans, num_blocks, block_size, heads, kv_heads, dim, window, softcap, dtype, seed,
                alibi=None):
    generator = torch.Generator().manual_seed(seed)
    layer = Attention(heads, kv_heads, dim, dim ** -0.5, window, softcap, alibi)
    layer.impl = backend
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    tokens = sum(len(s.token_ids) for s in spans)
    q, k, v = (torch.randn(tokens, n, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads))
    meta = build_metadata(spans, block_size, torch.device("cpu"))
    backend.prepare(meta, {window})
    out = layer(q, k, v, meta).view(tokens, heads, dim)
    expected = paged_attention_reference(q, layer.k_cache, layer.v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                         seq_lens=meta.seq_lens, block_tables=meta.block_tables, scale=layer.scale,
                                         window=window, softcap=softcap, alibi_slopes=alibi)
    return out, expected, layer


MIXES = {
    "decode only": [(1, 0), (1, 15), (1, 16), (1, 300)],
    "prefill only": [(128, 0), (17, 0), (2, 0)],
    "chunked + decode": [(1, 40), (33, 31), (128, 64), (1, 0), (5, 200), (1, 63)],
    "one long chunk": [(70, 129)],
    # speculative verification: short spans over a cache batch with the decodes (longer ones do not)
    "drafts + decode": [(4, 30), (1, 17), (2, 16), (8, 100), (1, 0), (3, 5), (9, 40), (2, 0)],
    "drafts only": [(4, 30), (2, 15), (8, 100)],
}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (6, 2, 64), (8, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0), (50, 20.0)])
def test_portable_matches_the_reference(mix, heads, kv_heads, dim, window, softcap):
    spans, num_blocks = random_batch(MIXES[mix], 16, seed=len(mix))
    out, expected, _ = run_backend(PortableBackend(), spans, num_blocks, 16, heads, kv_heads, dim, window, softcap,
                                   torch.float32, seed=heads + dim)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 32, 64])
def test_portable_with_other_block_sizes_and_fp16(block_size):
    spans, num_blocks = random_batch(MIXES["chunked + decode"], block_size, seed=3)
    out, expected, _ = run_backend(PortableBackend(), spans, num_blocks, block_size, 6, 2, 64, 40, None,
                                   torch.float32, seed=4)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    out, expected, _ = run_backend(PortableBackend(), spans, num_blocks, block_size, 6, 2, 64, None, None,
                                   torch.float16, seed=4)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("mix", MIXES)
def test_portable_applies_alibi(mix):
    """BLOOM's per-head bias over every kind of span; in fp16 too, where the bias's size (hundreds of positions back)
    must not eat the precision of the near keys."""
    slopes = alibi_slopes(8)
    spans, num_blocks = random_batch(MIXES[mix], 16, seed=len(mix))
    for dtype, tolerance in ((torch.float32, 2e-5), (torch.float16, 3e-3)):
        out, expected, _ = run_backend(PortableBackend(), spans, num_blocks, 16, 8, 2, 64, None, None, dtype,
                                       seed=9, alibi=slopes)
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
        if dtype == torch.float32:
            with_bias = expected
    _, plain, _ = run_backend(PortableBackend(), spans, num_blocks, 16, 8, 2, 64, None, None, torch.float32, seed=9)
    assert not torch.allclose(plain, with_bias)  # the bias changes the answer


def test_alibi_models_skip_the_backends_without_it():
    layers = [Attention(8, 2, 64, 0.125, alibi_slopes=alibi_slopes(8))]
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, layers, None)
    assert backend.name == "portable" and report["cpu_paged"] == "it has no ALiBi (the model's attention bias)"
    with pytest.raises(ValueError, match="'cpu_paged' cannot run here: it has no ALiBi"):
        selection.choose_backend("cpu_paged", torch.device("cpu"), torch.float32, layers, None)


class CausalOnly(PortableBackend):
    """A backend without bidirectional image attention: steps with such spans must not reach it."""
    name = "causal-only"
    supports_bidirectional_images = False

    def forward(self, layer, q, k, v, meta):
        assert not meta.bidirectional, "a step with images attending both ways reached a causal-only backend"
        return super().forward(layer, q, k, v, meta)


def image_backends():
    from engine.attention.cpu_paged import CpuPagedBackend

    cpu_paged = [] if CpuPagedBackend.unavailable_reason(torch.device("cpu"), torch.float32) else [CpuPagedBackend()]
    return [PortableBackend(), CausalOnly(), *cpu_paged]


@pytest.mark.parametrize("backend", image_backends(), ids=lambda backend: backend.name)
@pytest.mark.parametrize("window", [None, 4])
def test_image_tokens_attend_both_ways_as_transformers_masks_them(backend, window):
    """Gemma 3: transformers' mask is (causal OR same image run) AND window, the run ids from token_type_ids. Image
    chunks from scratch, over a cached context, starting inside a cached run, short ones (which would otherwise
    batch with the decodes), next to a decode and a text chunk."""
    check_image_attention(backend, window, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 4])
def test_a_gpu_step_with_images_attending_both_ways_runs_on_the_portable_backend(window):
    """Triton has no widened masks: such a step runs on the portable backend over the same cache, on CUDA."""
    from engine.attention.triton_backend import TritonBackend

    check_image_attention(TritonBackend(), window, torch.device("cuda"))


def check_image_attention(backend, window, device):
    from engine.model_inputs import prepare_inputs
    from engine.multimodal.prompt import MultiModalPrompt

    lengths = [(12, 0), (6, 5), (1, 20), (5, 9), (9, 3)]          # (new tokens, cached tokens)
    image_runs = [[(3, 9)], [(2, 8)], [(4, 7)], [(10, 14)], []]  # the decode's and the text chunk's runs are past
    spans, num_blocks = random_batch(lengths, 16, seed=11)
    for span, runs in zip(spans, image_runs):
        positions = [p for start, end in runs for p in range(start, end)]
        if positions:
            span.images = MultiModalPrompt({}, positions, [(runs[0][0], 1)], len(runs), bidirectional=True)
    inputs = prepare_inputs(spans, 16, device, backend, {window})
    generator = torch.Generator().manual_seed(12)
    layer = Attention(4, 2, 16, 0.25, window)
    layer.impl = backend
    cache = torch.randn(2, num_blocks, 16, 2, 16, generator=generator).to(device)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    q, k, v = (torch.randn(sum(n for n, _ in lengths), heads, 16, generator=generator).to(device)
               for heads in (4, 2, 2))
    out = layer(q, k, v, inputs.attention).view(q.shape).cpu()
    q, cache = q.cpu(), cache.cpu()
    row = 0
    for span, (num_new, cached), runs in zip(spans, lengths, image_runs):
        seq_len = num_new + cached
        slots = torch.tensor([span.block_table[p // 16] * 16 + p % 16 for p in range(seq_len)])
        keys, values = (c.view(-1, 2, 16)[slots].repeat_interleave(2, dim=1) for c in cache)
        run_id = torch.full((seq_len,), -1)
        for i, (start, end) in enumerate(runs):
            run_id[start:end] = i
        query_pos = torch.arange(cached, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        same_run = (run_id[query_pos] == run_id[key_pos]) & (run_id[query_pos] >= 0)
        mask = (key_pos <= query_pos) | same_run
        if window is not None:
            mask &= key_pos > query_pos - window
        scores = torch.einsum("qhd,khd->hqk", q[row:row + num_new], keys) * 0.25
        expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values)
        torch.testing.assert_close(out[row:row + num_new], expected, atol=1e-5, rtol=1e-5)
        row += num_new


def test_the_reference_sees_what_it_should():
    """The reference itself can fail: a window or another block table changes its answer."""
    spans, num_blocks = random_batch(MIXES["chunked + decode"], 16, seed=5)
    out, expected, layer = run_backend(PortableBackend(), spans, num_blocks, 16, 4, 2, 64, None, None,
                                       torch.float32, seed=6)
    meta = build_metadata(spans, 16, torch.device("cpu"))
    q = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    args = dict(cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, scale=0.125)
    plain = paged_attention_reference(q, layer.k_cache, layer.v_cache, block_tables=meta.block_tables, **args)
    windowed = paged_attention_reference(q, layer.k_cache, layer.v_cache, block_tables=meta.block_tables,
                                         window=8, **args)
    shuffled = paged_attention_reference(q, layer.k_cache, layer.v_cache, block_tables=meta.block_tables.flip(1),
                                         **args)
    assert not torch.allclose(plain, windowed) and not torch.allclose(plain, shuffled)


def layers_like(*shapes):
    return [Attention(h, kv, d, d ** -0.5, w, c) for h, kv, d, w, c in shapes]


class IgnoresWindow(PortableBackend):
    name = "ignores-window"

    def prepare(self, meta, windows):
        super().prepare(meta, windows | {None})

    def forward(self, layer, q, k, v, meta):
        window, layer.sliding_window = layer.sliding_window, None
        try:
            return super().forward(layer, q, k, v, meta)
        finally:
            layer.sliding_window = window


class WrongOnDecode(PortableBackend):
    name = "wrong-on-decode"

    def forward(self, layer, q, k, v, meta):
        out = super().forward(layer, q, k, v, meta)
        return out * 1.01 if meta.max_query_len == 1 else out


class Crashes(PortableBackend):
    name = "crashes"

    def forward(self, layer, q, k, v, meta):
        raise RuntimeError("no kernel image is available for execution on the device")


@pytest.fixture
def candidates(monkeypatch):
    for cls in (IgnoresWindow, WrongOnDecode, Crashes):
        monkeypatch.setitem(selection.BACKENDS, cls.name, cls)
    return monkeypatch


def test_auto_takes_the_first_candidate_that_passes(candidates):
    candidates.setitem(selection.PRIORITY, "cpu", ("crashes", "wrong-on-decode", "ignores-window", "portable"))
    layers = layers_like((4, 2, 64, None, None), (4, 2, 64, 8, None))
    backend, block_size, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, layers, None)
    assert backend.name == "portable" and block_size == 16
    assert "RuntimeError" in report["crashes"] and "decode batch" in report["wrong-on-decode"]
    assert "window 8" in report["ignores-window"] and report["portable"] == "ok"
    # the model decides what is checked: without a window, ignoring windows is harmless
    backend, _, _ = selection.choose_backend("auto", torch.device("cpu"), torch.float32,
                                             layers_like((4, 2, 64, None, None)), None)
    assert backend.name == "ignores-window"


def test_forcing_a_backend_that_cannot_run_fails_with_the_reason(candidates):
    cpu, layers = torch.device("cpu"), layers_like((4, 2, 64, None, None))
    with pytest.raises(ValueError, match="'wrong-on-decode' cannot run here: differs from the reference"):
        selection.choose_backend("wrong-on-decode", cpu, torch.float32, layers, None)
    with pytest.raises(ValueError, match="flash-attn.*needs a CUDA device"):
        selection.choose_backend("flash", cpu, torch.float32, layers, None)
    with pytest.raises(ValueError, match="unknown attention backend 'paged'; choose one of auto"):
        selection.choose_backend("paged", cpu, torch.float32, layers, None)
    with pytest.raises(ValueError, match="block size 24 is not one of"):
        selection.choose_backend("portable", cpu, torch.float32, layers, 24)
    assert selection.choose_backend("sdpa", cpu, torch.float32, layers, 32)[:2][1] == 32  # the old name still works


def test_every_rank_must_agree(candidates):
    candidates.setitem(selection.PRIORITY, "cpu", ("ignores-window", "portable"))
    votes = []

    def other_rank_says_no_first(ok):
        votes.append(ok)
        return ok and len(votes) > 1

    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32,
                                                  layers_like((4, 2, 64, None, None)), None,
                                                  agree=other_rank_says_no_first)
    assert backend.name == "portable" and report["ignores-window"] == "another tensor-parallel rank cannot use it"


def test_flash_backend_semantics_pass_the_same_check():
    """FlashBackend's argument translation (window, lengths, block table) with CPU stand-ins of its kernels."""
    backend = FlashBackend(reference_flash_varlen, reference_flash_kvcache)
    layers = layers_like((4, 2, 64, None, None), (8, 2, 64, 40, None))
    assert selection.self_check(backend, torch.device("cpu"), torch.float32, layers, 256) is None


def test_launcher_offers_exactly_the_backends_there_are():
    from engine.launcher import ATTENTION_CHOICES

    assert sorted(ATTENTION_CHOICES) == sorted(selection.CHOICES)


def test_attention_check_prints_what_release_verify_reads(tmp_path, capsys):
    """`tgi-hpc release verify` runs `python -m engine.attention_check` on a GPU node and reads the last
    stdout line as JSON: `ok`, `attention_backend`; a failure exits non-zero with the reason."""
    import json

    from engine.attention_check import main

    assert main(["--device", "cpu", "--json-out", str(tmp_path / "check.json")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["ok"] is True and printed["attention_backend"] == "cpu_paged"  # where g++ builds its kernel
    assert json.loads((tmp_path / "check.json").read_text()) == printed
    assert main(["--device", "cpu", "--attention-backend", "flash-attn"]) == 1
    failed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert failed["ok"] is False and "needs a CUDA device" in failed["error"]
