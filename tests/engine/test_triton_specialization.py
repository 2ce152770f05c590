"""Triton kernels leave the integers that change from step to step unspecialized (no compile stall per new
value under live traffic), and name them as compiled Triton requires: real, non-constexpr arguments."""
import inspect

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from engine.kernels import moe, quant_gemm, triton_attention  # noqa: E402

EXPECTED = {
    (triton_attention, "_unified_attention_kernel"): {"num_seqs", "stride_bt"},
    (triton_attention, "_decode_split_kernel"): {"num_splits", "stride_bt"},
    (triton_attention, "_decode_reduce_kernel"): {"num_splits"},
    (moe, "_grouped_gemm_kernel"): {"num_pairs"},
    (quant_gemm, "_wna16_kernel"): {"M"},
    (quant_gemm, "_wna16_gemv_kernel"): {"M"},
    (quant_gemm, "_sum_splits_kernel"): {"numel"},
}


def declared(kernel) -> tuple[list, list[str], set[str]]:
    """(do_not_specialize, argument names, constexpr argument names), interpreted or compiled."""
    names = list(kernel.arg_names)
    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters
    constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    if hasattr(kernel, "params"):      # compiled: what each parameter will do
        return [p.name for p in kernel.params if p.do_not_specialize], names, constexpr
    return list(kernel.kwargs.get("do_not_specialize") or []), names, constexpr


@pytest.mark.parametrize("module, name", list(EXPECTED), ids=[name for _, name in EXPECTED])
def test_runtime_integers_are_not_specialized_and_are_real_arguments(module, name):
    unspecialized, names, constexpr = declared(getattr(module, name))
    assert set(unspecialized) == EXPECTED[(module, name)]
    for arg in unspecialized:
        assert arg in names and arg not in constexpr, f"{name}: {arg} is no runtime argument"
