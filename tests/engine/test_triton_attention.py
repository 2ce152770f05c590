"""Triton paged attention and cache write against the float64 reference, on randomized mixed batches.

Without CUDA the kernels run in Triton's interpreter (fp32/fp16; bf16 is wrong there, so it runs only
compiled). Shapes stay small: the interpreter runs every program instance in Python.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import triton_available, triton_interpreted

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")

if triton_available():
    from engine.kernels.attention_reference import paged_attention_reference, write_kv_cache_reference
    from engine.kernels.triton_attention import DecodeWorkspace, decode_num_splits, unified_attention, write_kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([] if triton_interpreted() or DEVICE == "cpu" else [torch.bfloat16])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(q_lens, ctx_lens, *, heads, kv_heads, head_dim, block_size, dtype, seed=0, spare_blocks=3):
    """A varlen batch whose caches hold random blocks at shuffled (non-contiguous) block ids.

    Block-table rows are padded with random valid ids; seq_lens = cached context + new tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(needed) + 1
    table = torch.randint(0, num_blocks, (len(q_lens), width), generator=gen)
    used = 0
    for b, n in enumerate(needed):
        table[b, :n] = ids[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return dict(
        q=torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(DEVICE, dtype),
        k_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        v_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=table.to(DEVICE, torch.int32),
    )


def run_kernel(batch, **kw):
    out = torch.full_like(batch["q"], float("nan"))
    q_lens = (batch["cu_seqlens_q"][1:] - batch["cu_seqlens_q"][:-1]).tolist()
    result = unified_attention(batch["q"], batch["k_cache"], batch["v_cache"], out,
                               cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
                               block_tables=batch["block_tables"], max_query_len=max(q_lens), **kw)
    assert result is out
    return out


def reference(batch, **kw):
    kw.pop("workspace", None), kw.pop("num_splits", None), kw.pop("max_seq_len", None)
    return paged_attention_reference(batch["q"].double(), batch["k_cache"].double(), batch["v_cache"].double(),
                                     cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"],
                                     block_tables=batch["block_tables"], **kw)


def assert_matches(out, ref, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# (q_lens, cached context lens, heads, kv_heads, head_dim, block_size, window, softcap)
MIXED = {
    "mha-d64-bs16": ([1, 7, 128, 17, 1], [37, 0, 0, 5, 300], 2, 2, 64, 16, None, None),
    "gqa4-d128-bs64-over-a-block": ([3, 70, 1, 2], [100, 0, 250, 63], 4, 1, 128, 64, None, None),
    "gqa3-d80-window": ([1, 12, 33], [200, 40, 0], 3, 1, 80, 16, 24, None),
    "gqa8-softcap-window": ([2, 1, 20], [45, 129, 0], 8, 1, 64, 16, 50, 2.0),
    "gemma2-like-d256-softcap": ([1, 9], [40, 0], 2, 1, 256, 16, None, 30.0),
    # a prefill chunk deep in its context: window-cut, whole and diagonal key tiles all occur
    "chunked-window": ([40, 1], [300, 150], 2, 1, 64, 16, 100, None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(MIXED), ids=list(MIXED))
def test_mixed_batch_matches_reference(case, dtype):
    q_lens, ctx, heads, kv_heads, head_dim, block_size, window, softcap = MIXED[case]
    batch = make_batch(q_lens, ctx, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, seed=list(MIXED).index(case))
    kw = dict(scale=head_dim ** -0.5, window=window, softcap=softcap)
    assert_matches(run_kernel(batch, **kw), reference(batch, **kw), dtype)


def test_every_tile_alignment_of_diagonal_and_window():
    """Sequences whose context ends at every offset within a key tile (32 keys in fp32), prefill and
    decode: an off-by-one in which tiles skip the mask, or where the window starts, shows at one offset only."""
    dtype = torch.float32
    ctx = list(range(60, 92))
    for q_len, window in ((2, 37), (1, 37)):
        batch = make_batch([q_len] * len(ctx), ctx, heads=2, kv_heads=1, head_dim=16, block_size=16, dtype=dtype,
                           seed=q_len)
        kw = dict(scale=0.7, window=window, num_splits=3)
        assert_matches(run_kernel(batch, **kw), reference(batch, **kw), dtype)


def test_window_softcap_and_block_table_change_the_result():
    """The kernel really reads the mask parameters and the block table (each check can fail)."""
    batch = make_batch([9, 1], [60, 90], heads=2, kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    kw = dict(scale=0.125, window=16, softcap=None)
    out = run_kernel(batch, **kw)
    assert_matches(out, reference(batch, **kw), torch.float32)
    assert (out.double() - reference(batch, scale=0.125)).abs().max() > 1e-2
    assert (out.double() - reference(batch, scale=0.125, window=17)).abs().max() > 1e-4
    assert (run_kernel(batch, scale=0.125, softcap=1.0) - run_kernel(batch, scale=0.125)).abs().max() > 1e-2
    swapped = dict(batch, block_tables=batch["block_tables"][[1, 0]].contiguous())
    assert (run_kernel(swapped, **kw) - out).abs().max() > 1e-2


DECODE = {
    # (cached context lens, heads, kv_heads, head_dim, block_size, window, softcap)
    "gqa4-long-and-short": ([300, 2, 64, 129], 4, 1, 128, 16, None, None),
    "gqa8-window": ([250, 40, 7], 8, 1, 64, 64, 33, None),
    "mha-softcap-bs256": ([400, 1], 2, 2, 64, 256, None, 3.0),
}


@pytest.mark.parametrize(("num_splits", "with_workspace"), [(1, False), (3, True), (16, False), (16, True)],
                         ids=["unsplit", "3-workspace", "16-alloc", "16-workspace"])
@pytest.mark.parametrize("case", list(DECODE), ids=list(DECODE))
def test_decode_split_kv_matches_reference(case, num_splits, with_workspace):
    """Pure decode takes the split-KV kernel; 16 splits of the short sequences leave most splits empty."""
    ctx, heads, kv_heads, head_dim, block_size, window, softcap = DECODE[case]
    for dtype in DTYPES:
        batch = make_batch([1] * len(ctx), ctx, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           block_size=block_size, dtype=dtype, seed=num_splits)
        workspace = DecodeWorkspace(len(ctx) + 2, heads, head_dim, 16, DEVICE) if with_workspace else None
        if workspace is not None:
            workspace.max.fill_(float("nan"))  # stale garbage must not leak into the reduce
        kw = dict(scale=head_dim ** -0.5, window=window, softcap=softcap, workspace=workspace, num_splits=num_splits)
        assert_matches(run_kernel(batch, **kw), reference(batch, **kw), dtype)


def test_decode_default_splits_depend_only_on_host_sizes():
    """Small batches split (the reduce runs), large ones do not; either way the result is right."""
    assert decode_num_splits(1, 1, 4096, DEVICE) > 1
    assert decode_num_splits(1, 1, 4096, DEVICE, max_splits=4) == 4
    assert decode_num_splits(1, 1, 40, DEVICE) == 1  # no split shorter than a useful chunk
    assert decode_num_splits(1, 1, 200, DEVICE) == 3
    assert decode_num_splits(4096, 8, 4096, DEVICE) == 1
    batch = make_batch([1, 1], [500, 30], heads=2, kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    workspace = DecodeWorkspace(2, 2, 64, 8, DEVICE)
    kw = dict(scale=0.125, workspace=workspace, max_seq_len=4096)
    assert_matches(run_kernel(batch, **kw), reference(batch, **kw), torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        run_kernel(batch, scale=0.125, workspace=DecodeWorkspace(1, 2, 64, 8, DEVICE), max_seq_len=4096)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_cache_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 16, 3, 80, 11
    qkv = torch.randn(tokens, 2 * kv_heads + 4, head_dim, generator=gen).to(DEVICE, dtype)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]  # strided views, as the qkv projection gives them
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    slots = slots.to(DEVICE)
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache(k, v, *caches, slots)
    write_kv_cache_reference(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    flat_k = caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots[0].long()], k[0])
    assert not torch.equal(flat_k[slots[2 + 1].long()], k[2])  # the skipped row went nowhere


def test_rejects_bad_shapes():
    batch = make_batch([2], [3], heads=3, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        run_kernel(batch, scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_captured_in_cuda_graph_replays_new_lengths(dtype):
    """A decode step captured once with a workspace replays right for new seq_lens and block tables."""
    batch_size, heads, kv_heads, head_dim, block_size, max_seq_len = 4, 8, 2, 128, 16, 2048
    width = max_seq_len // block_size
    assert decode_num_splits(batch_size, kv_heads, max_seq_len, DEVICE) > 1  # the reduce is in the graph
    num_blocks = batch_size * width
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch_size, heads, head_dim, device=DEVICE, dtype=dtype)
    out = torch.empty_like(q)
    cu = torch.arange(batch_size + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(batch_size, dtype=torch.int32, device=DEVICE)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=DEVICE).view(batch_size, width)
    workspace = DecodeWorkspace(batch_size, heads, head_dim, 32, DEVICE)
    kw = dict(cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables, max_query_len=1, scale=head_dim ** -0.5,
              workspace=workspace, max_seq_len=max_seq_len)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        unified_attention(q, k_cache, v_cache, out, **kw)  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unified_attention(q, k_cache, v_cache, out, **kw)
    for step, lens in enumerate(([1500, 37, 800, 5], [2048, 1, 17, 999], [64, 65, 16, 2000])):
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(torch.randperm(num_blocks, device=DEVICE).view(batch_size, width).int())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), cu_seqlens_q=cu,
                                        seq_lens=seq_lens, block_tables=tables, scale=head_dim ** -0.5)
        assert_matches(out, ref, dtype)
