"""The few-row float32 linear (engine/kernels/cpu_gemv.py) against F.linear: random shapes around its panel
and row-pass edges, strided rows, biases, and hostile values; and its self-check."""
import random

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from engine.kernels import cpu_gemv  # noqa: E402
from engine.kernels.cpp_build import compiler  # noqa: E402
from vector_widths import build_for, widths_here  # noqa: E402

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) here")


@pytest.mark.parametrize("seed", range(12))
def test_matches_f_linear_on_random_shapes(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = rng.choice([1, 2, 3, 5, 8, 15, 16, 17, 31, 33])
    out_features = rng.choice([1, 15, 16, 17, 40, 96, 130])
    in_features = rng.choice([1, 7, 16, 64, 100, 576])
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if rng.random() < 0.5 else None
    wide = torch.randn(rows, in_features + 9, generator=gen)
    x = wide[:, 4:4 + in_features]  # rows evenly strided, as a slice of a wider activation
    got = cpu_gemv.linear(x, cpu_gemv.pack(weight), out_features, bias, threads=rng.choice([1, 2]))
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", range(1, 17))
def test_every_row_count_to_sixteen_with_three_panel_groups_and_any_tail(rows):
    gen = torch.Generator().manual_seed(rows)
    for out_features in (48, 100, 130, 3 * 48 + 16):
        weight = torch.randn(out_features, 72, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        x = torch.randn(rows, 72, generator=gen)
        got = cpu_gemv.linear(x, cpu_gemv.pack(weight), out_features, bias)
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cpu_gemv.linear(x, cpu_gemv.pack(weight), out_features), F.linear(x, weight),
                                   atol=1e-4, rtol=1e-4)


def test_pack_pads_the_last_panel_with_zeros():
    weight = torch.arange(17 * 3, dtype=torch.float32).view(17, 3)
    packed = cpu_gemv.pack(weight)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0].t(), weight[:16]) and torch.equal(packed[1, :, 0], weight[16])
    assert torch.count_nonzero(packed[1, :, 1:]) == 0


def test_huge_and_tiny_values_stay_as_f_linear_has_them():
    weight = torch.tensor([[1e30, -1e30], [1e-30, 1e-30]] * 9)
    x = torch.tensor([[1.0, 1.0], [float("inf"), 0.0]])
    got = cpu_gemv.linear(x, cpu_gemv.pack(weight), 18)
    want = F.linear(x, weight)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got[~torch.isnan(got)], want[~torch.isnan(want)])


def test_self_check_passes_here_and_reports_a_wrong_kernel(monkeypatch):
    assert cpu_gemv.self_check() is None
    monkeypatch.setattr(cpu_gemv, "linear", lambda x, packed, n, bias=None, threads=None: torch.zeros(x.shape[0], n))
    assert "disagrees with F.linear" in cpu_gemv.self_check()


@pytest.mark.parametrize("extra", widths_here(), ids=lambda extra: " ".join(extra) or "native")
def test_each_vector_width_gives_f_linear(monkeypatch, extra):
    """The kernel's tiles follow the vector registers (16 floats a register with AVX-512: three panels x 8 rows;
    8 with AVX2: 6 rows a pass), and on an AVX-512 CPU a build without it runs too: every row count of one pass and
    the next, panel tails, and the bfloat16 panels bit for bit."""
    monkeypatch.setattr(cpu_gemv, "_LIBRARY", build_for(cpu_gemv, extra))
    assert cpu_gemv.self_check() is None
    gen = torch.Generator().manual_seed(len(extra))
    for rows in (1, 2, 3, 6, 7, 12, 13, 16, 17):
        for out_features, in_features in ((48, 33), (130, 64), (3 * 48 + 16, 7)):
            weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16).float()
            bias = torch.randn(out_features, generator=gen)
            x = torch.randn(rows, in_features, generator=gen)
            got = cpu_gemv.linear(x, cpu_gemv.pack(weight), out_features, bias)
            torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
            assert torch.equal(cpu_gemv.linear(x, cpu_gemv.pack(weight, dtype=torch.bfloat16), out_features, bias),
                               got)


@pytest.mark.parametrize("seed", range(8))
def test_bfloat16_panels_give_the_float32_panels_products_bit_for_bit(seed):
    """Weights whose values are bfloat16s (a bfloat16 checkpoint served in float32) packed in half the bytes: the same
    result, not merely a close one, at every row count and shape edge (the fused step's tokens depend on it)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = rng.choice([1, 2, 3, 5, 8, 9, 15, 16, 17, 33])
    out_features = rng.choice([1, 15, 17, 48, 100, 3 * 48 + 16])
    in_features = rng.choice([1, 2, 3, 7, 33, 64, 100, 576])     # odd K: the last pair's second step is padding
    scale = 10 ** rng.uniform(-3, 3)
    weight = (torch.randn(out_features, in_features, generator=gen) * scale).to(torch.bfloat16).float()
    bias = torch.randn(out_features, generator=gen) if rng.random() < 0.5 else None
    x = torch.randn(rows, in_features + 3, generator=gen)[:, 1:1 + in_features]
    assert cpu_gemv.storage_dtype(weight) == torch.bfloat16
    narrow = cpu_gemv.pack(weight, dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and narrow.shape[1] == in_features + in_features % 2
    assert torch.equal(cpu_gemv.unpack(narrow, out_features, in_features).float(), weight)
    assert torch.equal(cpu_gemv.unpack(cpu_gemv.pack(weight), out_features, in_features), weight)
    threads = rng.choice([1, 2])
    got = cpu_gemv.linear(x, narrow, out_features, bias, threads=threads)
    assert torch.equal(got, cpu_gemv.linear(x, cpu_gemv.pack(weight), out_features, bias, threads=threads))
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_bfloat16_panels_hold_their_k_steps_in_pairs():
    """Line j of a bfloat16 panel: columns 0..15 of steps 2j and 2j + 1 interleaved (what the kernel's wpair reads)."""
    weight = torch.arange(20 * 5, dtype=torch.float32).view(20, 5).bfloat16()    # exact small integers
    packed = cpu_gemv.pack(weight, dtype=torch.bfloat16)
    assert packed.shape == (2, 6, 16)
    lines = packed.view(2, 3, 16, 2)
    for p, j, c, t in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 3, 1), (1, 2, 3, 0), (0, 2, 15, 0)]:
        assert lines[p, j, c, t] == weight[16 * p + c, 2 * j + t]
    assert (lines[:, 2, :, 1] == 0).all() and (lines[1, :, 4:] == 0).all()    # step 5 and columns 20.. are padding


def test_storage_is_bfloat16_only_when_every_value_survives_it():
    exact = torch.tensor([[1.0, -2.5, 0.0, 2.0 ** 127, float("inf"), 2.0 ** -130]])
    assert cpu_gemv.storage_dtype(exact) == torch.bfloat16
    for value in (1.0 + 2.0 ** -10, 0.1, float("nan")):   # a mantissa bit bfloat16 lacks; NaN never equals itself
        assert cpu_gemv.storage_dtype(torch.cat([exact, torch.tensor([[value] * 6])])) == torch.float32
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_gemv.pack(exact, dtype=torch.float16)
    # a bfloat16 model's weight is packed as it is, to the same panels as its float32 twin
    weight = torch.randn(20, 9, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert cpu_gemv.storage_dtype(weight) == torch.bfloat16
    assert torch.equal(cpu_gemv.pack(weight, dtype=torch.bfloat16), cpu_gemv.pack(weight.float(), dtype=torch.bfloat16))
