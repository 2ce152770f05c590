"""The element-wise layers written with fewer ops (one rms_norm, RoPE as one addcmul with its tables looked
up once per step, SiLU-and-mul in place) against the plain formulas, in float64."""
import pytest

torch = pytest.importorskip("torch")

from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.layernorm import RMSNorm  # noqa: E402
from engine.layers.rotary_embedding import RotaryEmbedding, inverse_frequencies  # noqa: E402


def rope_reference(x, positions, theta, rotary_dim):
    """HF's x * cos + rotate_half(x) * sin over the first rotary_dim channels: the angles in float32 as
    transformers computes them (position * inv_freq), the rest in float64."""
    inv_freq = inverse_frequencies(rotary_dim, theta, None).float()
    freqs = (positions.float()[:, None] * inv_freq[None, :]).double()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rot, rest = x.double()[..., :rotary_dim], x.double()[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


@pytest.mark.parametrize("rotary_dim", [64, 32])   # full and partial (Phi-3 / StarCoder2 style)
def test_rope_matches_the_reference_step_after_step(rotary_dim):
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64, 4096, 10000.0, None, rotary_dim)
    for step in range(4):   # a new positions tensor every step: the per-step tables must follow it
        num = [7, 1, 300, 16][step]
        positions = torch.randint(0, 4096, (num,), generator=gen)
        q, k = torch.randn(num, 9, 64, generator=gen), torch.randn(num, 3, 64, generator=gen)
        for _ in range(2):  # the same positions for a second layer: the cached tables
            got_q, got_k = rope(positions, q, k)
            torch.testing.assert_close(got_q.double(), rope_reference(q, positions, 10000.0, rotary_dim),
                                       atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(got_k.double(), rope_reference(k, positions, 10000.0, rotary_dim),
                                       atol=2e-5, rtol=1e-5)


def test_rope_tables_follow_a_positions_tensor_changed_in_place_between_steps():
    """Identity is the cache key, so an engine that refilled one positions tensor would read stale tables;
    the tables are only reused for the tensor object they were made for, and a new object gets its own."""
    rope = RotaryEmbedding(64, 128, 10000.0)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    first = torch.tensor([0, 1, 2])
    rope(first, q, k)
    second = torch.tensor([50, 60, 70])
    got_q, _ = rope(second, q, k)
    torch.testing.assert_close(got_q.double(), rope_reference(q, second, 10000.0, 64), atol=2e-5, rtol=1e-5)


def test_rms_norm_float32_is_the_plain_formula_and_adds_the_residual():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x, residual = torch.randn(33, 576, generator=gen) * 50, torch.randn(33, 576, generator=gen)
    summed = (x + residual).double()
    expected = norm.weight.double() * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    got, got_residual = norm(x, residual)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_residual, x + residual)
    tiny = torch.full((2, 576), 1e-30)   # eps dominates: no division by ~zero
    assert torch.isfinite(norm(tiny)).all()


def test_rms_norm_bfloat16_rounds_before_the_weight_as_transformers_does():
    norm = RMSNorm(64)
    norm.weight.data = torch.linspace(0.5, 2.0, 64)
    x = torch.randn(5, 64).bfloat16()
    y = x.float()
    expected = norm.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps)).bfloat16()
    assert torch.equal(norm(x), expected)


def test_silu_and_mul_leaves_its_input_alone():
    x = torch.randn(4, 2 * 48)
    before = x.clone()
    got = SiluAndMul()(x)
    gate, up = before.chunk(2, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
    assert torch.equal(x, before)
