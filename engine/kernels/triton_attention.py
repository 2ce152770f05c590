"""Paged varlen attention in Triton: one kernel for any mix of prefill and decode rows, a split-KV
decode kernel with its log-sum-exp reduce, and the KV-cache write.

Design (learnt from vLLM's "unified attention" kernel and arXiv 2511.11581, written anew here):
- A program owns one KV head and a tile of BLOCK_M rows = BLOCK_Q query tokens x the QPK query heads
  that share that KV head (GQA packed into the M dimension), so each K/V tile is read once per group.
- The launch grid is an upper bound computed from host ints (T // BLOCK_Q + B); each program finds its
  sequence by binary search over cu_seqlens_q and returns when it is past the sequence's end. Loop
  bounds come from seq_lens loaded on the device: the launchers never read a device value on the host,
  so a launch can be captured in a CUDA graph.
- KV is read in tiles of TILE_N positions gathered through the block table, so any block size works.
- Online softmax in fp32 with exp2 (the scale folded with log2(e)), scores through tl.dot.
- Pure decode (max_query_len == 1) splits each sequence's keys over NUM_SPLITS programs when the batch
  alone cannot fill the GPU; a reduce kernel merges the partial results by their log-sum-exp. The split
  count depends only on host ints (batch, kv heads, max_seq_len hint), so for a fixed batch size every
  step launches the same grids; empty splits write max = -inf and weigh nothing in the reduce.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import triton_interpreted

_LOG2E = 1.4426950408889634
# A split should keep at least this many keys (one tile): fewer and it only adds reduce work. On an H100
# (sweep, b=1, 8 kv heads) 16 splits of a 1k context ran 1.8x faster than 4, and 32-64 splits of 4k best.
_MIN_TOKENS_PER_SPLIT = 64
_DEFAULT_MAX_SPLITS = 32


# --------------------------------------------------------------------------------------------- device


# Integers that change from step to step (batch size, splits, the block tables' width): left unspecialized,
# or Triton compiles a variant for each value that is 1 or a multiple of 16, stalling live traffic.
PREFILL_INTS, DECODE_INTS = ["num_seqs", "stride_bt"], ["num_splits", "stride_bt"]


@triton.jit
def _find_seq(cu_seqlens_q, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest b with (cu_seqlens_q[b] // BLOCK_Q + b) <= pid: the sequence owning q-tile `pid`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # No portable tanh in tl.math (the interpreter lacks libdevice); exp overflow to inf still gives +-1.
    e = tl.exp(2.0 * x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, row_ok,
    k_base, v_base, bt_row, tile_lo, tile_hi, kv_end, window, qk_scale, softcap_log2,
    stride_kb, stride_ks, stride_vb, stride_vs,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr, MASKED: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi); scores live in the log2 domain.

    MASKED=False is for tiles that every row of the program sees whole (inside the causal diagonal and
    the window, below kv_end): no mask work there, which is most tiles of a long prefill.
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE_N + offs_n
        k_ok = k_pos < kv_end
        if MASKED:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        in_blk = (k_pos % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + (blk * stride_kb + in_blk * stride_ks)[None, :] + offs_d[:, None]
        v_ptrs = v_base + (blk * stride_vb + in_blk * stride_vs)[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM == D_PAD:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        s = _dot(q, k, IEEE_DOT)
        if USE_SOFTCAP:
            s = _tanh(s * qk_scale) * softcap_log2
        else:
            s = s * qk_scale
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
            if USE_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=PREFILL_INTS)
def _unified_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
    num_seqs, qk_scale, softcap_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    QPK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(cu_q_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_local = q_tile * BLOCK_Q + offs_m // QPK
    head = kvh * QPK + offs_m % QPK
    row_ok = (offs_m // QPK < BLOCK_Q) & (q_local < q_len)
    d_ok = offs_d < HEAD_DIM
    q_tok = (q_start + q_local).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx_len + q_local

    # Key tiles: [tile_lo, full_lo) cut by the window, [full_lo, full_hi) seen whole by every row,
    # [full_hi, tile_hi) cut by the causal diagonal.
    first_q = ctx_len + q_tile * BLOCK_Q
    kv_end = ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    tile_lo = 0
    full_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(first_q - window + 1, 0) // TILE_N
        full_lo = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)
    full_hi = tl.maximum((first_q + 1) // TILE_N, full_lo)
    tile_hi = tl.cdiv(kv_end, TILE_N)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + seq * stride_bt
    if USE_WINDOW:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, row_ok, k_base, v_base, bt_row, tile_lo, full_lo, kv_end, window,
            qk_scale, softcap_log2, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFTCAP, IEEE_DOT, True,
        )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, row_ok, k_base, v_base, bt_row, full_lo, full_hi, kv_end, window,
        qk_scale, softcap_log2, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFTCAP, IEEE_DOT, False,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, row_ok, k_base, v_base, bt_row, full_hi, tile_hi, kv_end, window,
        qk_scale, softcap_log2, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFTCAP, IEEE_DOT, True,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=DECODE_INTS)
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
    num_splits, qk_scale, softcap_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_mb, stride_mh,
    QPK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DIRECT_OUT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    """One sequence (one query token), one KV head, one split of the keys; DIRECT_OUT when unsplit."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_tok = (tl.load(cu_q_ptr + seq + 1) - 1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < QPK
    d_ok = offs_d < HEAD_DIM
    head = kvh * QPK + offs_m
    q = tl.load(q_ptr + q_tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    first_tile = 0
    if USE_WINDOW:
        first_tile = tl.maximum(seq_len - window, 0) // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N) - first_tile
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # An empty split (tile_lo >= tile_hi) runs no iteration and leaves m = -inf, l = 0.
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, row_ok,
        k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, bt_ptr + seq * stride_bt,
        tile_lo, tile_hi, seq_len, window, qk_scale, softcap_log2,
        stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFTCAP, IEEE_DOT, True,
    )
    if DIRECT_OUT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + q_tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = part_acc_ptr + seq * stride_pb + head * stride_ph + split * stride_ps
        tl.store(part[:, None] + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        stat = seq * stride_mb + head * stride_mh + split
        tl.store(part_m_ptr + stat, m_i, mask=row_ok)
        tl.store(part_l_ptr + stat, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, cu_q_ptr, num_splits,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_mb, stride_mh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge one (sequence, head)'s splits by log-sum-exp; empty splits (m = -inf) weigh 0."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    stat = seq * stride_mb + head * stride_mh + offs_s
    m = tl.load(part_m_ptr + stat, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + stat, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(l * w, axis=0)
    part = part_acc_ptr + seq * stride_pb + head * stride_ph
    acc = tl.load(part + offs_s[:, None] * stride_ps + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :] & (m != float("-inf"))[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / total
    q_tok = (tl.load(cu_q_ptr + seq + 1) - 1).to(tl.int64)
    tl.store(out_ptr + q_tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    in_blk = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    ok = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = k_ptr + tok.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + tok.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = k_cache_ptr + blk * stride_kcb + in_blk * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = v_cache_ptr + blk * stride_vcb + in_blk * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, tl.load(src_k, mask=ok).to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(dst_v, tl.load(src_v, mask=ok).to(v_cache_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------- host


class DecodeWorkspace:
    """Preallocated split-KV buffers for pure-decode steps (fixed addresses for CUDA graphs).

    Holds, per (sequence, query head, split): the unnormalized fp32 output, the running max (log2
    domain) and the sum of exponentials. Any batch up to `max_batch` and any split count up to
    `max_splits` reuses the same storage.
    """

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, max_splits: int = _DEFAULT_MAX_SPLITS,
                 device: torch.device | str = "cuda"):
        if min(max_batch, num_heads, head_dim, max_splits) < 1:
            raise ValueError("DecodeWorkspace sizes must be positive")
        self.max_batch, self.num_heads, self.head_dim, self.max_splits = max_batch, num_heads, head_dim, max_splits
        self.acc = torch.empty(max_batch, num_heads, max_splits, head_dim, dtype=torch.float32, device=device)
        self.max = torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device)
        self.sum = torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and not triton_interpreted():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # the interpreter: any value; this one makes small test batches split


def decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str,
                      max_splits: int = _DEFAULT_MAX_SPLITS) -> int:
    """How many KV splits a pure-decode step of `batch` sequences uses (host ints only).

    Enough programs to give every SM about two, but no split shorter than _MIN_TOKENS_PER_SPLIT keys of
    the longest possible sequence. 1 means no split (the decode kernel writes the output directly).
    """
    programs = max(1, batch * num_kv_heads)
    want = -(-2 * _num_sms(torch.device(device)) // programs)
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_length, max_splits))


def _ieee_dot(dtype: torch.dtype) -> bool:
    # fp32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa) on the GPU. Others keep
    # the backend's default precision: naming "tf32" is refused by AMD targets that lack it.
    return dtype == torch.float32


def _tile_n(head_dim_pad: int, dtype: torch.dtype) -> int:
    if dtype == torch.float32 or head_dim_pad > 128:
        return 32
    return 64


def prefill_config(max_query_len: int, qpk: int, head_dim_pad: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch settings of the unified kernel (BLOCK_M rows = BLOCK_Q tokens x qpk heads)."""
    # H100 sweep (bench_attention.py --sweep, bf16, D=128, GQA 4): 64x64 tiles, 4 warps, 2 stages beat
    # 128-row tiles by 15-25% on mixed and chunked-prefill batches.
    block_m = 16 if max_query_len * qpk <= 16 else 64
    if dtype == torch.float32 and head_dim_pad > 128:
        block_m = 16  # fp32 dots stage through shared memory: 64 rows would need 131 KB, over consumer GPUs' ~99
    block_m = max(block_m, triton.next_power_of_2(qpk))
    return dict(block_m=block_m, tile_n=_tile_n(head_dim_pad, dtype), num_warps=4, num_stages=2)


def decode_config(qpk: int, head_dim_pad: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch settings of the split-KV decode kernel."""
    return dict(block_m=max(16, triton.next_power_of_2(qpk)), tile_n=_tile_n(head_dim_pad, dtype), num_warps=4,
                num_stages=2 if head_dim_pad > 128 else 3)


def _check(q, k_cache, v_cache, out, block_tables):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape or out.shape != q.shape:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k_cache={tuple(k_cache.shape)} "
                         f"v_cache={tuple(v_cache.shape)} out={tuple(out.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim or head_dim > 256:
        raise ValueError(f"head_dim {head_dim} (cache {k_cache.shape[3]}) must match and be <= 256")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_size & (block_size - 1) or not 1 <= block_size <= 4096:
        raise ValueError(f"block_size {block_size} must be a power of two")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must have a contiguous last dimension")


def _scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(factor on q.k, factor after tanh): scores end in the log2 domain for exp2."""
    if softcap:
        return scale / softcap, softcap * _LOG2E
    return scale * _LOG2E, 1.0


def unified_attention(q, k_cache, v_cache, out, *, cu_seqlens_q, seq_lens, block_tables, max_query_len: int,
                      scale: float, window: int | None = None, softcap: float | None = None,
                      workspace: DecodeWorkspace | None = None, max_seq_len: int | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """Causal paged attention of a flattened varlen batch; writes `out` [T, H, D] and returns it.

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; cu_seqlens_q [B+1] int32;
    seq_lens [B] int32 (context length including the new tokens, which are the last q_len positions
    and are already in the cache); block_tables [B, max_blocks] int32. `window` (HF: key j visible
    from position p iff p - window < j <= p), `softcap` (Gemma 2, on the scaled scores).
    max_query_len == 1 takes the split-KV decode path; its split count comes from (B, KVH, max_seq_len)
    only (max_seq_len defaults to the block table's capacity), at most workspace.max_splits;
    `num_splits` forces a count (tests, benchmarks). No GPU->CPU sync.
    """
    _check(q, k_cache, v_cache, out, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    use_window = window is not None and window > 0
    qk_scale, softcap_log2 = _scales(scale, softcap)
    common = dict(qpk=num_heads // num_kv_heads, head_dim=head_dim, d_pad=max(16, triton.next_power_of_2(head_dim)),
                  block_size=block_size, window=int(window) if use_window else 0, use_window=use_window,
                  use_softcap=bool(softcap), qk_scale=qk_scale, softcap_log2=softcap_log2)
    if max_query_len == 1:
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * block_size
        cap = workspace.max_splits if workspace is not None else _DEFAULT_MAX_SPLITS
        if num_splits is None:
            num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device, cap)
        _decode(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, num_seqs,
                max(1, min(num_splits, cap)), workspace, **common)
    else:
        _prefill(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, num_seqs, max_query_len, **common)
    return out


def _prefill(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, num_seqs, max_query_len, *,
             qpk, head_dim, d_pad, block_size, window, use_window, use_softcap, qk_scale, softcap_log2):
    cfg = prefill_config(max_query_len, qpk, d_pad, q.dtype)
    block_q = cfg["block_m"] // qpk
    grid = (q.shape[0] // block_q + num_seqs, k_cache.shape[2])
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
        num_seqs, qk_scale, softcap_log2, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QPK=qpk, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=cfg["block_m"], BLOCK_Q=block_q,
        TILE_N=cfg["tile_n"], USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, IEEE_DOT=_ieee_dot(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _decode(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, num_seqs, num_splits, workspace, *,
            qpk, head_dim, d_pad, block_size, window, use_window, use_softcap, qk_scale, softcap_log2):
    num_heads = q.shape[1]
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace(num_seqs, num_heads, head_dim, num_splits, q.device)
        elif workspace.max_batch < num_seqs or workspace.num_heads != num_heads or workspace.head_dim != head_dim:
            raise ValueError(f"DecodeWorkspace(max_batch={workspace.max_batch}, num_heads={workspace.num_heads}, "
                             f"head_dim={workspace.head_dim}) does not fit {num_seqs} x {num_heads} x {head_dim}")
        part_acc, part_m, part_l = workspace.acc, workspace.max, workspace.sum
    else:
        part_acc = part_m = part_l = out  # unused: the kernel writes `out` directly
    pstrides = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2)) if num_splits > 1 else (0, 0, 0)
    mstrides = (part_m.stride(0), part_m.stride(1)) if num_splits > 1 else (0, 0)
    cfg = decode_config(qpk, d_pad, q.dtype)
    _decode_split_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, cu_seqlens_q, seq_lens, block_tables,
        num_splits, qk_scale, softcap_log2, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        *pstrides, *mstrides,
        QPK=qpk, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg["block_m"], TILE_N=cfg["tile_n"], DIRECT_OUT=num_splits == 1,
        USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, IEEE_DOT=_ieee_dot(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, cu_seqlens_q, num_splits,
            out.stride(0), out.stride(1), *pstrides, *mstrides,
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter k, v [T, KVH, D] into the caches [num_blocks, block_size, KVH, D] at the flat slots
    slot_mapping [T] (block * block_size + offset); a negative slot (a padding row) is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes k={tuple(k.shape)} v={tuple(v.shape)} cache={tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], num_warps=4,
    )

