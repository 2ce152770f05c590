"""The sampler's two-level inverse CDF (float32 probabilities, float64 block sums, one block's float64
cumsum) draws what the float64 inverse CDF over the whole vocabulary draws, never a zero-probability token,
at every edge: uniforms of 0 and just below 1, vocabularies that are no multiple of the block, the mass in
one token, in the last block only, or spread over many blocks."""
import pytest

torch = pytest.importorskip("torch")

from engine.sampler import inverse_cdf, inverse_cdf_blocked  # noqa: E402


def reference(logprobs, uniforms):
    return inverse_cdf(logprobs.double().exp(), uniforms)


@pytest.mark.parametrize("vocab, block", [(1000, 64), (1024, 64), (130, 64), (7, 64), (50000, 1024)])
def test_blocked_draws_equal_the_float64_draws(vocab, block):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=generator) * 3
    logits[::4, : vocab // 2] = float("-inf")                      # masked heads
    logits[1::4, vocab // 3:] = float("-inf")                      # masked tails (the last blocks empty)
    logprobs = logits.log_softmax(dim=-1)
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    uniforms[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 2**-40], dtype=torch.float64)
    drawn = inverse_cdf_blocked(logprobs, uniforms, block)
    assert torch.isfinite(logprobs.gather(1, drawn[:, None])).all(), "a zero-probability token was drawn"
    same = (drawn == reference(logprobs, uniforms)).float().mean().item()
    assert same >= 0.98    # they may differ only where a uniform falls within float32 rounding of a boundary


def test_one_possible_token_is_always_drawn_wherever_it_sits():
    for vocab, position in [(200, 0), (200, 199), (200, 63), (200, 64), (129, 128)]:
        logits = torch.full((3, vocab), float("-inf"))
        logits[:, position] = 0.0
        uniforms = torch.tensor([0.0, 0.5, 1 - 2**-53], dtype=torch.float64)
        assert inverse_cdf_blocked(logits.log_softmax(dim=-1), uniforms, 64).tolist() == [position] * 3


def test_the_drawn_frequencies_follow_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3] + [0.0] * 60)
    logprobs = probs.log()[None].expand(20000, -1)
    uniforms = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(inverse_cdf_blocked(logprobs, uniforms, 16), minlength=64).double() / 20000
    assert counts[1] == 0 and counts[4:].sum() == 0
    assert torch.allclose(counts[[0, 2, 3]], torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64), atol=0.015)
