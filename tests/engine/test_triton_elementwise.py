"""The fused GPU element-wise kernels (engine/kernels/triton_elementwise.py) against the torch formulas they
replace, on random shapes, strided views and hostile values; their start-up choice and fallback; and, on
CUDA, a model whose layers use them generating what the same model with torch's ops generates.

Without CUDA the kernels run in Triton's interpreter (fp32/fp16; bf16 is wrong there, so it runs only
compiled). The layers take the fused path only for CUDA tensors, so these tests call the kernels."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.kernels import triton_available, triton_interpreted  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")

if triton_available():
    from engine.kernels import triton_elementwise
from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from engine.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([] if triton_interpreted() or DEVICE == "cpu" else [torch.bfloat16])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_add_rms_norm_matches_rmsnorm(seed, dtype):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, width = rng.choice([1, 2, 7, 33]), rng.choice([1, 15, 64, 100, 576])
    base = (torch.randn(rows, width + 5, generator=gen) * rng.choice([1e-2, 1.0, 30.0])).to(DEVICE, dtype)
    x = base[:, 3:3 + width]  # a strided view, as a slice of a projection is
    residual = torch.randn(rows, width, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(width, rng.choice([1e-6, 1e-5])).to(DEVICE, dtype)
    norm.weight.data.copy_(torch.empty(width).uniform_(-2, 2, generator=gen))
    want, want_sum = norm(x, residual)
    got, got_sum = triton_elementwise.add_rms_norm(x, residual, norm.weight, norm.eps)
    close(got, want, dtype)
    assert torch.equal(got_sum, want_sum)  # the residual stream is bit-exact: one rounding of x + residual
    close(triton_elementwise.add_rms_norm(x, None, norm.weight, norm.eps), norm(x), dtype)
    assert got.shape == want.shape and got_sum.shape == want_sum.shape and got.dtype == dtype


def test_rms_norm_of_zero_rows_three_dimensional_inputs_and_an_empty_batch():
    norm = RMSNorm(64).to(DEVICE)
    x = torch.zeros(2, 3, 64, device=DEVICE)
    x[1] = torch.randn(3, 64, device=DEVICE)
    got = triton_elementwise.add_rms_norm(x, None, norm.weight, norm.eps)
    assert got.shape == (2, 3, 64) and torch.equal(got[0], torch.zeros(3, 64, device=DEVICE))
    close(got, norm(x), torch.float32)
    empty = torch.zeros(0, 64, device=DEVICE)
    out, summed = triton_elementwise.add_rms_norm(empty, empty, norm.weight, norm.eps)
    assert out.shape == summed.shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,heads,kv_heads", [(64, None, 9, 3), (128, None, 4, 1),
                                                                (80, 40, 5, 5), (16, 12, 3, 2)])
def test_rope_in_place_matches_rotary_embedding(head_dim, rotary_dim, heads, kv_heads, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, scaling if head_dim == 64 else None, rotary_dim).to(DEVICE)
    for tokens in (1, 6):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).mul(3).to(DEVICE, dtype)
        q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided views of the projection
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
        want_q, want_k = rope(positions, q.clone(), k.clone())
        v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
        got_q, got_k = triton_elementwise.rope_(q, k, positions, rope.cos, rope.sin)
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
        close(got_q, want_q, dtype)
        close(got_k, want_k, dtype)
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 50, 1500])
def test_silu_and_mul_matches_silu_and_mul(width, dtype):
    gen = torch.Generator().manual_seed(width)
    for rows in (1, 3):
        x = (torch.randn(rows, 2 * width, generator=gen) * 8).to(DEVICE, dtype)
        x[0, 0] = -200.0  # exp overflow side: silu -> -0
        x[-1, -1] = 200.0
        close(triton_elementwise.silu_and_mul(x), SiluAndMul()(x.clone()), dtype)
        three_d = x.view(rows, 1, 2 * width)
        assert triton_elementwise.silu_and_mul(three_d).shape == (rows, 1, width)


def test_the_self_check_passes_and_a_wrong_kernel_falls_back_to_aten(monkeypatch):
    device = torch.device(DEVICE)
    assert triton_elementwise.self_check(device, torch.float32) is None
    assert triton_elementwise.choose("auto", device, torch.float32) == "triton"
    assert triton_elementwise.choose("aten", device, torch.float32) == "aten"
    monkeypatch.setattr(triton_elementwise, "silu_and_mul", lambda x: torch.zeros_like(x[..., : x.shape[-1] // 2]))
    assert triton_elementwise.self_check(device, torch.float32) == "SiLU-and-mul disagrees with SiluAndMul"
    assert triton_elementwise.choose("auto", device, torch.float32) == "aten"
    with pytest.raises(ValueError, match="'triton' is not usable here: SiLU-and-mul disagrees"):
        triton_elementwise.choose("triton", device, torch.float32)
    with pytest.raises(ValueError, match="unknown GPU element-wise backend 'fused'"):
        triton_elementwise.choose("fused", device, torch.float32)


def test_install_marks_exact_classes_only():
    model = torch.nn.ModuleList([RMSNorm(8), GemmaRMSNorm(8), SiluAndMul(), RotaryEmbedding(8, 16, 10000.0)])
    assert triton_elementwise.install(model) == 3
    assert [getattr(m, "fused_gpu") for m in model] == [True, False, True, True]


@pytest.mark.gpu  # the fused layers run for CUDA tensors only
def test_greedy_on_cuda_is_identical_with_fused_and_aten_layers():
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from fakes import test_model_path

    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("triton", "aten"):
        config = EngineConfig(model_id=str(test_model_path("tiny-llama")), device="cuda", dtype="float32",
                              gpu_elementwise=backend)
        with LLMEngine(config) as engine:
            assert engine.runner.elementwise_backend == backend
            outputs[backend] = [[t.id for t in o.tokens] for o in engine.generate(prompts, params)]
    assert outputs["triton"] == outputs["aten"]
