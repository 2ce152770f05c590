"""The W4A16/W8A16 Triton kernel (on CUDA compiled, else under TRITON_INTERPRET=1) against its torch reference
on random shapes, group sizes and act-order, and the reference against the format spec (the test packer)."""
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from engine.kernels import quant_gemm  # noqa: E402
from engine.kernels.quant_gemm import TileConfig, dequantize, gemm_reference, wna16_gemm, wna16_gemv  # noqa: E402
from engine.layers.quantization.wna16 import sort_act_order  # noqa: E402
from quant_packers import pack_along_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def random_layer(generator, bits, k, n, group_size, act_order, dtype):
    q = torch.randint(0, 2 ** bits, (k, n), generator=generator)
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    g_idx = (torch.arange(k) // size).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    scales = (torch.rand(groups, n, generator=generator) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 2 ** bits, (groups, n), generator=generator).to(dtype)
    return q, pack_along_rows(q, bits), scales, zeros, g_idx


def test_dequantize_follows_the_packing_spec():
    generator = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        q, packed, scales, zeros, g_idx = random_layer(generator, bits, 64, 24, 16, True, torch.float32)
        expected = (q.float() - zeros[g_idx.long()]) * scales[g_idx.long()]
        assert torch.equal(dequantize(packed, scales, zeros, g_idx, bits), expected)


CASES = [(bits, group_size, act_order) for bits in (4, 8) for group_size in (32, 64, 128, -1)
         for act_order in (False, True) if not (act_order and group_size == -1)]


@pytest.mark.parametrize("bits,group_size,act_order", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_the_reference_on_random_shapes(bits, group_size, act_order, dtype):
    rng = random.Random(f"{bits}-{group_size}-{act_order}-{dtype}")
    generator = torch.Generator().manual_seed(rng.randrange(1000))
    for _ in range(3):
        m = rng.choice([1, 2, 7, 16, 33, 70])
        k = rng.choice([128, 256, 384]) if group_size == 128 else rng.choice([64, 96, 128, 192, 256])
        n = rng.choice([8, 40, 64, 72, 136])
        _, packed, scales, zeros, g_idx = random_layer(generator, bits, k, n, group_size, act_order, dtype)
        x = torch.randn(m, k, generator=generator).to(dtype)
        kernel_group = 0 if act_order else (k if group_size == -1 else group_size)
        got = wna16_gemm(*on_device(x, packed, scales, zeros, g_idx), bits, kernel_group).cpu()
        want = gemm_reference(x.float(), packed, scales.float(), zeros.float(), g_idx, bits)
        assert got.shape == (m, n) and got.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tolerance * max(1.0, want.abs().max().item()), rtol=0)


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (4, 128, True), (8, 64, False),
                                                      (8, -1, False), (4, 64, True)])
def test_gemv_matches_the_reference_at_decode_sizes_and_any_split(bits, group_size, act_order):
    """The split-K GEMV (M <= 4): every split count, including ones that leave the last split short or empty
    of whole groups, sums to the reference."""
    rng = random.Random(f"gemv-{bits}-{group_size}-{act_order}")
    generator = torch.Generator().manual_seed(rng.randrange(1000))
    for splits in (None, 1, 3, 64):
        m = rng.choice([1, 2, 3, 4])
        k = rng.choice([128, 256, 384]) if group_size == 128 else rng.choice([64, 96, 128, 192, 256])
        n = rng.choice([8, 40, 136, 200])
        _, packed, scales, zeros, g_idx = random_layer(generator, bits, k, n, group_size, act_order, torch.float32)
        x = torch.randn(m, k, generator=generator)
        kernel_group = 0 if act_order else (k if group_size == -1 else group_size)
        got = wna16_gemv(*on_device(x, packed, scales, zeros, g_idx), bits, kernel_group, splits=splits).cpu()
        want = gemm_reference(x, packed, scales, zeros, g_idx, bits)
        assert got.shape == (m, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_tile_and_split_k_launch_matches_the_reference(dtype):
    """What choose_configs may pick: random tiles (K tiles deeper than the group included, which gather scales),
    K split into partials summed by the second kernel, the GEMV and the tiled kernel, 1 to 40 rows."""
    rng = random.Random(f"tiles-{dtype}")
    generator = torch.Generator().manual_seed(11)
    for _ in range(6):
        bits, group_size, act_order = rng.choice([(4, 32, False), (4, 64, True), (8, 32, False), (4, 128, False)])
        k, n = rng.choice([128, 256, 384]), rng.choice([24, 64, 100])
        gemv = rng.random() < 0.4
        m = rng.randint(1, 4) if gemv else rng.choice([1, 5, 16, 40])
        config = TileConfig(0 if gemv else rng.choice([16, 32, 64]), rng.choice([32, 64]),
                            rng.choice([32, 64, 128]), splits=rng.choice([1, 2, 3, 5]))
        _, packed, scales, zeros, g_idx = random_layer(generator, bits, k, n, group_size, act_order, dtype)
        x = torch.randn(m, k, generator=generator).to(dtype)
        want = gemm_reference(x.float(), packed, scales.float(), zeros.float(), g_idx, bits)
        kernel_group, perm = (0 if act_order else group_size), None
        if act_order and rng.random() < 0.5:  # sorted by group at load, x read through the permutation
            packed, g_idx, perm = sort_act_order(packed, g_idx, bits, group_size)
            kernel_group, perm = group_size, perm.to(DEVICE)
        got = wna16_gemm(*on_device(x, packed, scales, zeros, g_idx), bits, kernel_group, config=config,
                         perm=perm).cpu()
        assert got.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tolerance * max(1.0, want.abs().max().item()), rtol=0,
                                   msg=lambda text: f"{config} {bits}-bit group {group_size} perm {perm is not None}"
                                                    f" {m}x{k}x{n}: {text}")


def test_act_order_sorted_at_load_is_the_same_layer():
    """sort_act_order: rows regrouped so each K tile has one scale row; x read through perm gives the same
    product; groups that are not whole runs (a row-parallel shard of an act-order layer) are left alone."""
    generator = torch.Generator().manual_seed(4)
    q, packed, scales, zeros, g_idx = random_layer(generator, 4, 256, 24, 32, True, torch.float32)
    sorted_q, sorted_g, perm = sort_act_order(packed, g_idx, 4, 32, columns=5)
    assert torch.equal(sorted_g, (torch.arange(256) // 32).to(torch.int32))
    assert torch.equal(dequantize(sorted_q, scales, zeros, sorted_g, 4),
                       dequantize(packed, scales, zeros, g_idx, 4)[perm.long()])
    assert sort_act_order(packed[:16], g_idx[:128], 4, 32) is None


def test_the_timed_choice_keeps_the_fastest_launch_that_works(monkeypatch):
    """choose_configs at load: a candidate that does not compile or gives another result is skipped, the
    fastest of the rest is what wna16_gemm then launches for that shape and row bucket (the timer faked)."""
    generator = torch.Generator().manual_seed(9)
    _, packed, scales, zeros, g_idx = random_layer(generator, 4, 128, 40, 32, False, torch.float32)
    args = on_device(packed, scales, zeros, g_idx)
    slow, broken, wrong, fast = (TileConfig(16, 32, 32, splits=s) for s in (1, 2, 3, 4))
    monkeypatch.setattr(quant_gemm, "candidates", lambda *a: [slow, broken, wrong, fast])
    monkeypatch.setattr(quant_gemm, "_chosen", {})
    launch = quant_gemm._launch

    def spy(*args):
        config = args[7]  # x, the four tensors, bits, group, config, perm
        launched.append(config)
        if config is broken:
            raise RuntimeError("PTX too new")
        return launch(*args) * (1.5 if config is wrong else 1.0)
    launched = []
    monkeypatch.setattr(quant_gemm, "_launch", spy)
    monkeypatch.setattr(quant_gemm, "_time", lambda fn: (fn(), {slow: 3.0, wrong: 0.5, fast: 1.0}[launched[-1]])[1])
    chosen = quant_gemm.choose_configs(torch.float32, *args, 4, 32, buckets=(16,))
    assert chosen == {16: fast}
    launched.clear()
    x = torch.randn(9, 128, generator=generator)
    got = wna16_gemm(*on_device(x), *args, 4, 32).cpu()
    assert launched == [fast]
    torch.testing.assert_close(got, gemm_reference(x, packed, scales, zeros, g_idx, 4), atol=1e-4, rtol=0)


def test_gemv_refuses_more_rows_than_it_unrolls():
    generator = torch.Generator().manual_seed(5)
    _, packed, scales, zeros, g_idx = random_layer(generator, 4, 64, 8, 32, False, torch.float32)
    with pytest.raises(ValueError, match="at most 4 rows, got 5"):
        wna16_gemv(*on_device(torch.randn(5, 64), packed, scales, zeros, g_idx), 4, 32)


def test_the_self_check_passes_and_names_a_kernel_that_is_wrong(monkeypatch):
    device = torch.device(DEVICE)
    assert quant_gemm.self_check(device, torch.float32) == {"gemm": "ok", "gemv": "ok"}
    monkeypatch.setattr(quant_gemm, "wna16_gemv", lambda x, *a, **k: wna16_gemm(x, *a, **k) * 1.01)
    report = quant_gemm.self_check(device, torch.float32)
    assert report["gemm"] == "ok" and report["gemv"].startswith("differs from the reference by")
    monkeypatch.setattr(quant_gemm, "wna16_gemm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no PTX")))
    assert quant_gemm.self_check(device, torch.float32)["gemm"] == "raised RuntimeError: no PTX"


def test_a_group_size_that_is_not_a_tile_multiple_takes_the_gather_path():
    generator = torch.Generator().manual_seed(3)
    _, packed, scales, zeros, g_idx = random_layer(generator, 4, 144, 40, 48, False, torch.float32)
    x = torch.randn(5, 144, generator=generator)
    torch.testing.assert_close(wna16_gemm(*on_device(x, packed, scales, zeros, g_idx), 4, 48).cpu(),
                               gemm_reference(x, packed, scales, zeros, g_idx, 4), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_kernel_on_cuda_in_bfloat16_at_llama_shapes():
    generator = torch.Generator().manual_seed(0)
    _, packed, scales, zeros, g_idx = random_layer(generator, 4, 4096, 1024, 128, False, torch.bfloat16)
    args = [t.cuda() for t in (packed, scales, zeros, g_idx)]
    for m in (1, 16, 256):
        x = torch.randn(m, 4096, generator=generator).to(torch.bfloat16).cuda()
        got = wna16_gemm(x, *args, 4, 128).float()
        want = gemm_reference(x.float(), args[0], args[1].float(), args[2].float(), args[3], 4)
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.gpu
def test_the_launches_chosen_at_load_on_cuda_in_bfloat16():
    """What a layer runs after choose_configs (GEMV and tiled, split K, 1 to 256 rows), in bfloat16, which the
    interpreter cannot check; every candidate it timed was compared on 128 columns, this compares all."""
    generator = torch.Generator().manual_seed(1)
    for bits, group, act_order in ((4, 128, False), (4, 128, True)):
        _, packed, scales, zeros, g_idx = random_layer(generator, bits, 4096, 1536, group, act_order, torch.bfloat16)
        args = [t.cuda() for t in (packed, scales, zeros, g_idx)]
        perm = None
        if act_order:  # as the engine loads it: sorted by group, x read through perm
            sorted_q, sorted_g, perm = sort_act_order(args[0], args[3], bits, group)
            kernel = [sorted_q, args[1], args[2], sorted_g]
        else:
            kernel = args
        chosen = quant_gemm.choose_configs(torch.bfloat16, *kernel, bits, group, perm=perm)
        assert set(chosen) == {1, 16, 256}
        for m in (1, 3, 16, 100, 256):
            x = torch.randn(m, 4096, generator=generator).to(torch.bfloat16).cuda()
            got = wna16_gemm(x, *kernel, bits, group, perm=perm).float()
            want = gemm_reference(x.float(), args[0], args[1].float(), args[2].float(), args[3], bits)
            torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0,
                                       msg=lambda text: f"{chosen} {bits}-bit act {act_order} {m} rows: {text}")


@pytest.mark.parametrize("returned", [0.25, [0.25], (0.25, 0.3)])
def test_launch_timing_reads_do_bench_as_a_float_or_a_list(monkeypatch, returned):
    # Triton 3.6 returns one quantile as a bare float: indexing it skipped every candidate on the H200
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: returned)
    assert quant_gemm._time(lambda: None) == 0.25
