"""The CPU prefill attention kernel (engine/kernels/cpu_prefill_attention.py) against the float64 reference,
through cpu_paged (prefill chunks), and its start-up choice: the kernel when it checks, SDPA with the reason
(shown in /info's attention_checks) when it cannot build, is wrong, or meets a head dim it does not cover."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.attention import selection  # noqa: E402
from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from engine.kernels import cpu_prefill_attention  # noqa: E402
from engine.kernels.attention_reference import paged_attention_reference  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from test_attention_backends import MIXES, random_batch, run_backend  # noqa: E402
from vector_widths import build_for, widths_here  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_prefill_attention.compiler() is None, reason="no C++ compiler (g++) here")

TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def kernel_case(q_lens, contexts, heads, kv_heads, dim, block_size, window, softcap, dtype, seed, query_block=64):
    """(kernel output, reference) for chunks of q_lens new tokens after contexts cached ones, on shuffled blocks,
    the work items in shuffled order, q a strided view of a fused projection."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    needed = [-(-n // block_size) for n in seq_lens]
    blocks = (torch.randperm(2 * sum(needed), generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(needed) + 2, dtype=torch.int32)  # padded rows, as the engine's
    for b, count in enumerate(needed):
        tables[b, :count] = torch.tensor(blocks[:count])
        blocks = blocks[count:]
    cu = torch.tensor([0] + q_lens).cumsum(0)
    shape = (2 * sum(needed) + 1, block_size, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(int(cu[-1]), heads + 2 * kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    order = list(range(len(q_lens)))
    random.Random(seed).shuffle(order)
    work = torch.tensor([[b, int(cu[b]), q_lens[b], seq_lens[b]] for b in order], dtype=torch.int32)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    cpu_prefill_attention.prefill_attention(out, q, k_cache, v_cache, work, tables, scale=dim ** -0.5, window=window,
                                            softcap=softcap, query_block=query_block)
    expected = paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens),
                                         block_tables=tables, scale=dim ** -0.5, window=window, softcap=softcap)
    return out, expected


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 32), (6, 2, 80),
                                                (16, 2, 16)])
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (64, 20.0)])
def test_kernel_matches_the_reference(heads, kv_heads, dim, window, softcap):
    """Odd lengths, lengths at tile (64) and block edges, chunks over cached prefixes, GQA ratios 1-8."""
    seed = heads * dim + (window or 0)
    rng = random.Random(seed)
    for block_size, query_block in ((16, 64), (4, 7), (32, 16)):
        q_lens = [rng.choice([9, 63, 64, 65, 129, rng.randint(2, 200)]) for _ in range(rng.randint(1, 4))]
        contexts = [rng.choice([0, 0, block_size, 64, rng.randint(1, 300)]) for _ in q_lens]
        out, expected = kernel_case(q_lens, contexts, heads, kv_heads, dim, block_size, window, softcap,
                                    torch.float32, seed, query_block)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5, msg=lambda m: (
            f"{m}\nq_lens {q_lens}, contexts {contexts}, block {block_size}, query block {query_block}"))


@pytest.mark.parametrize("extra", widths_here(), ids=lambda extra: " ".join(extra) or "native")
def test_each_vector_width_matches_the_reference(monkeypatch, extra):
    """Tiles of native vectors, sized to the registers (on an AVX-512 CPU a build without it runs too): each gives
    the reference's results, head dims of one to four 16-float slices, row groups of 1-4 slices."""
    monkeypatch.setattr(cpu_prefill_attention, "_LIBRARY", build_for(cpu_prefill_attention, extra))
    rng = random.Random(11)
    for heads, kv_heads, dim, window in ((9, 3, 64, None), (8, 2, 128, 37), (16, 2, 16, None), (6, 2, 80, None)):
        q_lens = [rng.choice([9, 64, 65, rng.randint(2, 150)]) for _ in range(2)]
        contexts = [rng.choice([0, 16, rng.randint(1, 200)]) for _ in q_lens]
        out, expected = kernel_case(q_lens, contexts, heads, kv_heads, dim, 16, window, None, torch.float32, dim)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_caches(dtype):
    out, expected = kernel_case([70, 1, 130], [0, 40, 77], 9, 3, 64, 16, None, None, dtype, seed=7)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_one_token_chunks_and_a_long_prompt_with_a_window_shorter_than_a_tile():
    for q_lens, contexts, window in (([1], [0], None), ([1, 1], [5, 64], None), ([300], [0], 10), ([2], [700], 3)):
        out, expected = kernel_case(q_lens, contexts, 9, 3, 64, 16, window, None, torch.float32, seed=1)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_large_scores_stay_finite():
    """Scores in the hundreds (an unnormalized model): the running max keeps every exponent <= 0."""
    big_q = torch.full((100, 4, 64), 3.0)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(12, 16, 2, 64, generator=gen) * 4, torch.randn(12, 16, 2, 64, generator=gen)
    tables = torch.arange(1, 11, dtype=torch.int32)[None]
    work = torch.tensor([[0, 0, 100, 150]], dtype=torch.int32)
    out = torch.empty_like(big_q)
    cpu_prefill_attention.prefill_attention(out, big_q, k_cache, v_cache, work, tables, scale=1.0, window=None,
                                            softcap=None)
    expected = paged_attention_reference(big_q, k_cache, v_cache, cu_seqlens_q=torch.tensor([0, 100]),
                                         seq_lens=torch.tensor([150]), block_tables=tables, scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def avx512(monkeypatch):
    """The backend's choice as on a CPU with AVX-512 (the kernel runs on any; on AVX2 'auto' takes SDPA)."""
    monkeypatch.setattr(cpu_prefill_attention, "vector_floats", lambda: 16)


@pytest.mark.parametrize("mix", ["prefill only", "chunked + decode", "one long chunk"])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (50, 20.0)])
def test_backend_sends_prefill_chunks_to_the_kernel(mix, window, softcap, monkeypatch):
    backend = CpuPagedBackend()
    assert backend.configure([Attention(9, 3, 64, 0.125, window, softcap)], torch.float32) == {
        "cpu_paged prefill": "kernel"}
    calls = []
    real = cpu_prefill_attention.prefill_attention
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    spans, num_blocks = random_batch(MIXES[mix], 16, seed=len(mix))
    out, expected, _ = run_backend(backend, spans, num_blocks, 16, 9, 3, 64, window, softcap, torch.float32, seed=2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert calls


def test_a_layer_the_kernel_was_not_checked_on_takes_sdpa(monkeypatch):
    """A draft model's other head layout in the same step: SDPA for it, the kernel for the checked one."""
    backend = CpuPagedBackend()
    backend.configure([Attention(9, 3, 64, 0.125)], torch.float32)
    spans, num_blocks = random_batch(MIXES["chunked + decode"], 16, seed=3)
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", None)  # must not be called
    out, expected, _ = run_backend(backend, spans, num_blocks, 16, 4, 2, 32, None, None, torch.float32, seed=4)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def smollm2_layers():
    return [Attention(9, 3, 64, 0.125)]


def test_the_choice_shows_in_the_attention_report():
    _, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert report == {"cpu_paged": "ok", "cpu_paged prefill": "kernel"}
    _, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32,
                                            [Attention(4, 2, 24, 0.2)], None)
    assert report["cpu_paged prefill"] == "sdpa (a head dim that is not a multiple of 16)"


def test_a_wrong_kernel_falls_back_to_sdpa_with_the_reason(monkeypatch):
    real = cpu_prefill_attention.prefill_attention

    def off_by_a_little(out, *args, **kwargs):
        real(out, *args, **kwargs)
        out.mul_(1.001)

    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", off_by_a_little)
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert backend.name == "cpu_paged" and not backend.prefill_layouts
    assert report["cpu_paged prefill"].startswith("sdpa (differs from the reference by")


def test_a_kernel_that_does_not_build_falls_back_to_sdpa(monkeypatch):
    def broken_build():
        raise RuntimeError("g++ failed (1): main.cpp:1: error: expected ';'")

    monkeypatch.setattr(cpu_prefill_attention, "load", broken_build)
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert backend.name == "cpu_paged" and report["cpu_paged"] == "ok"
    assert report["cpu_paged prefill"] == "sdpa (self-check raised RuntimeError: g++ failed (1): main.cpp:1: error: " \
                                          "expected ';')"


def test_the_environment_overrides_the_choice(monkeypatch):
    monkeypatch.setenv("TGI_HPC_CPU_PREFILL_ATTENTION", "sdpa")
    assert cpu_prefill_attention.choose({(9, 3, 64, None, None)}, torch.float32) == (
        False, "sdpa (TGI_HPC_CPU_PREFILL_ATTENTION=sdpa)")
    monkeypatch.setenv("TGI_HPC_CPU_PREFILL_ATTENTION", "kernel")
    assert cpu_prefill_attention.choose({(9, 3, 64, None, None)}, torch.float32) == (True, "kernel")
    with pytest.raises(ValueError, match="cannot serve this model: a head dim that is not a multiple of 16"):
        cpu_prefill_attention.choose({(4, 2, 24, None, None)}, torch.float32)
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32,
                                                  [Attention(4, 2, 24, 0.2)], None)
    assert backend.name == "portable" and "cannot serve this model" in report["cpu_paged"]
    monkeypatch.setenv("TGI_HPC_CPU_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="use one of auto, kernel, sdpa"):
        cpu_prefill_attention.choose({(9, 3, 64, None, None)}, torch.float32)


@pytest.mark.parametrize("floats", [8])
def test_without_avx512_auto_takes_sdpa_and_the_environment_still_takes_the_kernel(monkeypatch, floats):
    monkeypatch.setattr(cpu_prefill_attention, "vector_floats", lambda: floats)
    why = f"no AVX-512 here: SDPA is faster than the kernel's tiles at {floats} floats a register"
    assert cpu_prefill_attention.choose({(9, 3, 64, None, None)}, torch.float32) == (False, f"sdpa ({why})")
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert backend.name == "cpu_paged" and not backend.prefill_layouts and report["cpu_paged prefill"] == f"sdpa ({why})"
    monkeypatch.setenv("TGI_HPC_CPU_PREFILL_ATTENTION", "kernel")
    assert cpu_prefill_attention.choose({(9, 3, 64, None, None)}, torch.float32) == (True, "kernel")


def test_the_build_reports_its_vector_width():
    assert cpu_prefill_attention.vector_floats.__name__ == "<lambda>"    # the fixture's
    real = cpu_prefill_attention.load().tgi_prefill_vector_floats()
    flags = open("/proc/cpuinfo").read()
    assert real == (16 if " avx512f" in flags else 8)


def test_empty_chunks_write_nothing():
    q = torch.randn(3, 4, 32)
    cache = torch.randn(2, 2, 16, 2, 32)
    out = torch.full_like(q, 7.0)
    work = torch.tensor([[0, 0, 0, 5], [1, 3, 0, 0]], dtype=torch.int32)
    cpu_prefill_attention.prefill_attention(out, q, cache[0], cache[1], work, torch.ones(2, 1, dtype=torch.int32),
                                            scale=0.2, window=None, softcap=None)
    assert torch.equal(out, torch.full_like(q, 7.0))
