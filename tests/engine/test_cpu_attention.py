"""The CPU paged-attention kernel (engine/kernels/cpu_attention.py) and its backend (cpu_paged) against the
float64 reference, its build cache, and the fall back to portable when it cannot build or is wrong.

The kernel is compiled once per process (and once per CPU type into ~/.cache/tgi-hpc/kernels), so only
the first test here pays for g++ (a few seconds on the 2-core box)."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.attention import selection  # noqa: E402
from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from engine.attention.portable import PortableBackend  # noqa: E402
from engine.kernels import cpu_attention, cpu_prefill_attention  # noqa: E402
from engine.kernels.attention_reference import paged_attention_reference  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from test_attention_backends import MIXES, random_batch, run_backend  # noqa: E402
from vector_widths import build_for, widths_here  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_attention.compiler() is None, reason="no C++ compiler (g++) here")

TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def spans_batch(rng, num_seqs, block_size, max_query=8, max_context=300):
    """Random decode rows and short spans: query lengths 1..max_query over contexts 0..max_context, with
    lengths at and around block edges."""
    edges = [block_size - 1, block_size, block_size + 1, 2 * block_size]
    q_lens = [rng.choice([1, 1, 1, rng.randint(2, max_query)]) for _ in range(num_seqs)]
    contexts = [rng.choice([0, rng.randint(1, max_context), rng.choice(edges)]) for _ in range(num_seqs)]
    return q_lens, contexts


def kernel_case(q_lens, contexts, heads, kv_heads, dim, block_size, window, softcap, dtype, seed, splits=0,
                layout="shuffled", cache_dtype=None):
    """(kernel output, reference) for spans of q_lens new tokens after contexts cached ones: blocks shuffled one
    by one, or ("runs") in runs of 1-20 blocks that lie one after another, as a prompt's blocks do (the kernel
    reads such a run at once, up to 64 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    needed = [-(-n // block_size) for n in seq_lens]
    blocks = (torch.randperm(2 * sum(needed), generator=gen) + 1).tolist()
    if layout == "runs":
        rng, runs, start = random.Random(seed), [], 1
        while start <= 2 * sum(needed):
            length = rng.randint(1, 20)
            runs.append(list(range(start, min(start + length, 2 * sum(needed) + 1))))
            start += length
        rng.shuffle(runs)
        blocks = [block for run in runs for block in run]
    tables = torch.zeros(len(seq_lens), max(needed) + 2, dtype=torch.int32)  # padded rows, as the engine's
    for b, count in enumerate(needed):
        tables[b, :count] = torch.tensor(blocks[:count])
        blocks = blocks[count:]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
    shape = (2 * sum(needed) + 1, block_size, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(cache_dtype or dtype) for _ in range(2))
    q = torch.randn(int(cu[-1]), heads, dim, generator=gen).to(dtype)
    # spans in shuffled order: work items need not follow the rows
    order = list(range(len(q_lens)))
    random.Random(seed).shuffle(order)
    work = torch.tensor([[b, int(cu[b]), q_lens[b], seq_lens[b]] for b in order], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    scale = dim ** -0.5
    cpu_attention.paged_attention(out, q, k_cache, v_cache, work, tables, scale=scale, window=window,
                                  softcap=softcap, splits=splits)
    expected = paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens),
                                         block_tables=tables, scale=scale, window=window, softcap=softcap)
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 64), (6, 2, 80)])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0), (50, 20.0)])
def test_kernel_matches_the_reference(dtype, heads, kv_heads, dim, window, softcap):
    seed = heads * dim + (window or 0)
    rng = random.Random(seed)
    for block_size, layout in ((16, "shuffled"), (4, "shuffled"), (32, "shuffled"), (16, "runs"), (4, "runs"),
                               (128, "runs")):
        q_lens, contexts = spans_batch(rng, rng.randint(1, 12), block_size)
        out, expected = kernel_case(q_lens, contexts, heads, kv_heads, dim, block_size, window, softcap, dtype, seed,
                                    layout=layout)
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: (
            f"{m}\nq_lens {q_lens}, contexts {contexts}, block {block_size}, {layout}"))


@pytest.mark.parametrize("extra", widths_here(), ids=lambda extra: " ".join(extra) or "native")
def test_each_vector_width_matches_the_reference(monkeypatch, extra):
    """The row groups' accumulators are native vectors (16 or 8 floats; on an AVX-512 CPU a build without it runs
    too): each scores and sums as the reference does, head sizes 64 and 128 (the grouped paths) and 80, rows in groups of 1-4."""
    monkeypatch.setattr(cpu_attention, "_LIBRARY", build_for(cpu_attention, extra))
    rng = random.Random(7)
    for seed, (heads, kv_heads, dim) in enumerate([(9, 3, 64), (8, 2, 128), (6, 2, 80), (8, 8, 64)]):
        for dtype in (torch.float32, torch.bfloat16):
            q_lens, contexts = spans_batch(rng, 5, 16)
            out, expected = kernel_case(q_lens, contexts, heads, kv_heads, dim, 16, 24 if seed % 2 else None,
                                        None, dtype, seed)
            atol, rtol = TOLERANCE[dtype]
            torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (6, 2, 80)])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (50, 20.0)])
def test_float32_queries_over_a_bfloat16_cache_match_the_reference_at_float32_tolerance(heads, kv_heads, dim, window,
                                                                                         softcap):
    """The fused float32 decode step of a bfloat16 model reads its bfloat16 cache this way: the cached values widen
    exactly, so the result is as close to the float64 reference (on the same bfloat16 values) as float32's."""
    rng = random.Random(heads * dim)
    for block_size, layout in ((16, "shuffled"), (16, "runs"), (4, "runs")):
        q_lens, contexts = spans_batch(rng, rng.randint(1, 12), block_size)
        for splits in (0, 3):
            out, expected = kernel_case(q_lens, contexts, heads, kv_heads, dim, block_size, window, softcap,
                                        torch.float32, heads + dim, splits=splits, layout=layout,
                                        cache_dtype=torch.bfloat16)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, expected.float(), atol=2e-5, rtol=1e-5)


def test_queries_and_caches_of_other_mixed_dtypes_are_refused():
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 1, 16)
    work, tables = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(AssertionError):
        cpu_attention.paged_attention(torch.empty_like(q), q, cache, cache, work, tables, scale=1.0, window=None,
                                      softcap=None)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 0])
def test_context_ranges_merge_to_the_same_result(splits):
    """One long sequence and a few short ones, the contexts cut into ranges (some empty, some masked away)."""
    for window in (None, 37):
        out, expected = kernel_case([1, 3, 1, 8], [2047, 600, 0, 31], 9, 3, 64, 16, window, None, torch.float32,
                                    seed=splits, splits=splits, layout="runs" if splits % 2 else "shuffled")
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_a_batch_of_one_row_and_one_token_contexts():
    for q_lens, contexts in (([1], [0]), ([1], [1]), ([2], [1]), ([1] * 16, [0] * 16)):
        out, expected = kernel_case(q_lens, contexts, 9, 3, 64, 16, None, None, torch.float32, seed=1)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (50, 20.0)])
def test_backend_matches_the_reference(mix, heads, kv_heads, dim, window, softcap):
    """Decode rows and spans through the kernel, prefill chunks through portable's path, in one batch."""
    spans, num_blocks = random_batch(MIXES[mix], 16, seed=len(mix))
    out, expected, _ = run_backend(CpuPagedBackend(), spans, num_blocks, 16, heads, kv_heads, dim, window, softcap,
                                   torch.float32, seed=heads + dim)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backend_in_half_precision_stays_as_close_as_portable(dtype):
    spans, num_blocks = random_batch(MIXES["drafts + decode"], 16, seed=2)
    errors = {}
    for backend in (CpuPagedBackend(), PortableBackend()):
        out, expected, _ = run_backend(backend, spans, num_blocks, 16, 9, 3, 64, None, None, dtype, seed=3)
        errors[backend.name] = (out.float() - expected.float()).abs().max().item()
    assert errors["cpu_paged"] <= max(errors["portable"], 1e-2), errors


def test_non_contiguous_queries_are_read_through_their_strides():
    spans, num_blocks = random_batch(MIXES["decode only"], 16, seed=4)
    backend = CpuPagedBackend()
    generator = torch.Generator().manual_seed(5)
    layer = Attention(9, 3, 64, 0.125)
    layer.impl = backend
    cache = torch.randn(2, num_blocks, 16, 3, 64, generator=generator)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    qkv = torch.randn(4, 15, 64, generator=generator)  # q, k, v as views of one projection
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    from engine.attention import build_metadata

    meta = build_metadata(spans, 16, torch.device("cpu"))
    out = layer(q, k, v, meta).view(4, 9, 64)
    expected = paged_attention_reference(q, layer.k_cache, layer.v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                         seq_lens=meta.seq_lens, block_tables=meta.block_tables, scale=0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


# start-up choice: cpu_paged first on CPU, portable when it cannot build or is wrong
def smollm2_layers():
    return [Attention(9, 3, 64, 0.125)]


def test_auto_picks_cpu_paged_on_cpu():
    backend, block_size, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32,
                                                           smollm2_layers(), None)
    assert backend.name == "cpu_paged" and block_size == 16
    why = cpu_prefill_attention.width_reason()      # its prefill kernel too, where the CPU has AVX-512
    assert report == {"cpu_paged": "ok", "cpu_paged prefill": "kernel" if why is None else f"sdpa ({why})"}


def test_a_kernel_that_does_not_build_falls_back_to_portable(monkeypatch):
    def broken_build():
        raise RuntimeError("g++ failed (1): main.cpp:1: error: expected ';'")

    monkeypatch.setattr(cpu_attention, "load", broken_build)
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert backend.name == "portable" and report["portable"] == "ok"
    assert report["cpu_paged"] == ("failed its self-check with RuntimeError: "
                                   "g++ failed (1): main.cpp:1: error: expected ';'")
    with pytest.raises(ValueError, match="'cpu_paged' cannot run here: failed its self-check"):
        selection.choose_backend("cpu_paged", torch.device("cpu"), torch.float32, smollm2_layers(), None)


def test_a_wrong_kernel_falls_back_to_portable(monkeypatch):
    real = cpu_attention.paged_attention

    def off_by_a_little(out, *args, **kwargs):
        real(out, *args, **kwargs)
        out.mul_(1.001)

    monkeypatch.setattr(cpu_attention, "paged_attention", off_by_a_little)
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert backend.name == "portable" and report["cpu_paged"].startswith("differs from the reference by")


def test_no_compiler_means_portable_with_the_reason(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    backend, _, report = selection.choose_backend("auto", torch.device("cpu"), torch.float32, smollm2_layers(), None)
    assert backend.name == "portable"
    assert report["cpu_paged"] == "no C++ compiler to build its kernel (set CXX or put g++ on PATH)"
    assert "not the CPU" in CpuPagedBackend.unavailable_reason(torch.device("meta"), torch.float32)


def test_the_build_is_cached_per_cpu_and_loaded_once_per_process(tmp_path, monkeypatch, caplog):
    """A fresh cache compiles once; a new process (here: the module's handle cleared) loads the file."""
    monkeypatch.setenv("TGI_HPC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_attention._LIBRARY, "handle", None)
    with caplog.at_level("INFO", logger="engine.kernels"):
        first = cpu_attention.load()
        assert cpu_attention.load() is first
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and "compiled in" in caplog.text
    caplog.clear()
    monkeypatch.setattr(cpu_attention._LIBRARY, "handle", None)
    stamp = built[0].stat().st_mtime_ns
    with caplog.at_level("INFO", logger="engine.kernels"):
        cpu_attention.load()
    assert "compiled in" not in caplog.text and built[0].stat().st_mtime_ns == stamp
    assert list(tmp_path.iterdir()) == built  # no sources or partial builds left behind
