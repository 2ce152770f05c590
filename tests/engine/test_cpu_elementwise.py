"""The fused CPU element-wise kernels (engine/kernels/cpu_elementwise.py) against the torch formulas they
replace, on random shapes, strided views and hostile values; their start-up choice and fallback; and a
model whose layers use them generating what the same model with torch's ops generates."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.kernels import cpu_elementwise  # noqa: E402
from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from engine.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_elementwise.compiler() is None, reason="no C++ compiler (g++) here")

CLOSE = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seed", range(6))
def test_add_rms_norm_matches_rmsnorm(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, width = rng.choice([1, 2, 7, 300, 1100]), rng.choice([1, 15, 16, 64, 576, 1000])
    base = torch.randn(rows, width + 5, generator=gen) * rng.choice([1e-3, 1.0, 1e3])
    x = base[:, 3:3 + width]  # a strided view, as a slice of a projection is
    residual = torch.randn(rows, width, generator=gen)
    norm = RMSNorm(width, rng.choice([1e-6, 1e-5]))
    norm.weight.data.uniform_(-2, 2, generator=gen)
    want, want_sum = norm(x, residual)
    norm.fused_cpu = True
    got, got_sum = norm(x, residual)
    torch.testing.assert_close(got, want, **CLOSE)
    assert torch.equal(got_sum, want_sum)  # the residual stream is bit-exact
    torch.testing.assert_close(norm(x), RMSNorm.norm(norm, x), **CLOSE)
    assert got.shape == want.shape and got_sum.shape == want_sum.shape


def test_rms_norm_of_zero_rows_and_three_dimensional_inputs():
    norm = RMSNorm(64)
    x = torch.zeros(2, 3, 64)
    x[1] = torch.randn(3, 64)
    want = norm(x)
    norm.fused_cpu = True
    got = norm(x)
    assert got.shape == (2, 3, 64) and torch.equal(got[0], torch.zeros(3, 64))
    torch.testing.assert_close(got, want, **CLOSE)


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (128, None), (80, 40), (16, 12)])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_in_place_matches_rotary_embedding(head_dim, rotary_dim, scaling):
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, scaling, rotary_dim)
    for tokens in (1, 5, 700):
        heads, kv_heads = 9, 3
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
        q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        rope.fused_cpu = False
        want_q, want_k = rope(positions, q, k)
        rope.fused_cpu = True
        got_q, got_k = rope(positions, q, k)
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated where they lie
        torch.testing.assert_close(got_q, want_q, **CLOSE)
        torch.testing.assert_close(got_k, want_k, **CLOSE)
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("rows,width", [(1, 1), (3, 15), (16, 1536), (513, 100), (2, 17)])
def test_silu_and_mul_matches_and_handles_extreme_values(rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, 2 * width, generator=gen) * 20
    x[0, 0] = 200.0
    if width > 1:
        x[0, 1] = -200.0
    act = SiluAndMul()
    want = act(x.clone())
    act.fused_cpu = True
    got = act(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=2e-5)
    assert torch.isfinite(got).all()


def one_bf16_step(got, want):
    """Every element equal, or one bfloat16 step apart (sums in another order, a polynomial exp): at most 2% of them."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got.float() != want.float()
    step = want.float().abs().clamp_min(2.0 ** -120) * 2.0 ** -7
    assert ((got.float() - want.float()).abs() <= step * 1.01).all()
    assert differ.float().mean() <= 0.02, differ.float().mean()


@pytest.mark.parametrize("seed", range(4))
def test_bfloat16_kernels_round_where_the_bfloat16_torch_ops_do(seed):
    """A bfloat16 model's layers: the residual sum bit for bit, norm, RoPE and SiLU-and-mul within one bfloat16 step
    of torch's bfloat16 ops (which round every op's result; the kernels compute in float32 between those points)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, width = rng.choice([1, 7, 300]), rng.choice([15, 64, 576])
    x = (torch.randn(rows, width + 3, generator=gen) * rng.choice([1e-2, 1.0, 1e2])).bfloat16()[:, 1:1 + width]
    residual = torch.randn(rows, width, generator=gen).bfloat16()
    norm = RMSNorm(width, 1e-5)
    norm.weight.data.uniform_(-2, 2, generator=gen)
    norm = norm.bfloat16()
    want, want_sum = norm(x, residual)
    norm.fused_cpu = True
    got, got_sum = norm(x, residual)
    assert torch.equal(got_sum, want_sum)
    one_bf16_step(got, want)
    one_bf16_step(norm(x), RMSNorm.norm(norm, x))

    # tables in bfloat16, or in float32 as a loaded model keeps them (eager casts them to q's dtype: so does the kernel)
    for rope in (RotaryEmbedding(64, 4096, 10000.0).bfloat16(), RotaryEmbedding(64, 4096, 10000.0)):
        qkv = torch.randn(rows, 15 * 64, generator=gen).bfloat16()
        q, k = qkv[:, :9 * 64].view(rows, 9, 64), qkv[:, 9 * 64:12 * 64].view(rows, 3, 64)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        want_q, want_k = rope(positions, q.clone(), k.clone())
        rope.fused_cpu = True
        got_q, got_k = rope(positions, q, k)
        assert got_q.data_ptr() == q.data_ptr()
        one_bf16_step(got_q, want_q)
        one_bf16_step(got_k, want_k)

    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 8).bfloat16()
    act = SiluAndMul()
    want = act(gate_up.clone())
    act.fused_cpu = True
    one_bf16_step(act(gate_up), want)


def test_other_dtypes_and_mixed_ones_take_the_torch_path():
    norm = RMSNorm(32)
    norm.fused_cpu = True
    x = torch.randn(4, 32, dtype=torch.float16)
    norm.weight.data = norm.weight.data.half()
    assert norm(x).dtype == torch.float16  # the torch path: no float16 kernel
    norm.weight.data = norm.weight.data.float()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(x), RMSNorm.norm(norm, x))   # a float32 weight on bfloat16 rows: torch's


def test_install_reaches_the_exact_classes_only():
    model = torch.nn.ModuleList([RMSNorm(8), GemmaRMSNorm(8), SiluAndMul(), RotaryEmbedding(8, 16, 10000.0)])
    assert cpu_elementwise.install(model) == 3
    assert model[0].fused_cpu and not model[1].fused_cpu and model[2].fused_cpu and model[3].fused_cpu


def test_choice_and_fallbacks(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_elementwise.choose("auto", cpu, torch.float32) == "fused"
    assert cpu_elementwise.choose("aten", cpu, torch.float32) == "aten"
    assert cpu_elementwise.choose("auto", cpu, torch.bfloat16) == "fused"
    assert cpu_elementwise.choose("auto", cpu, torch.float16) == "aten"
    assert cpu_elementwise.choose("auto", torch.device("meta"), torch.float32) == "aten"
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        cpu_elementwise.choose("fused", cpu, torch.float16)
    with pytest.raises(ValueError, match="unknown"):
        cpu_elementwise.choose("fast", cpu, torch.float32)
    monkeypatch.setattr(cpu_elementwise, "self_check", lambda: "RoPE disagrees with RotaryEmbedding")
    assert cpu_elementwise.choose("auto", cpu, torch.float32) == "aten"
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "no C++ compiler" in cpu_elementwise.unusable_reason(cpu, torch.float32)


def test_a_model_generates_the_same_tokens_fused_and_not(model_path):
    """Greedy tokens of a tiny Llama through the engine, --cpu-elementwise fused against aten."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    outputs = {}
    for backend in ("fused", "aten"):
        engine = LLMEngine(EngineConfig(model_id=str(model_path("tiny-llama")), device="cpu",
                                        cpu_elementwise=backend))
        with engine:
            assert engine.runner.elementwise_backend == backend
            params = SamplingParams(max_new_tokens=12, ignore_eos=True)
            outputs[backend] = [[t.id for t in o.tokens]
                                for o in engine.generate([[5, 9, 2, 44, 7], [3] * 40], [params, params])]
    assert outputs["fused"] == outputs["aten"]
