"""The grammar bitmask's two unpackings (engine/structured/masks.py): numpy on the host for CPU logits, the packed
words copied and unpacked on the device otherwise. Random words, bit 31, whole words of ones and of zeros, rows in
any order, logits narrower and wider than the mask."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine.structured.masks import TokenBitmask, apply_token_bitmask, masked_on_device, masked_on_host  # noqa: E402


def random_masks(seed: int) -> list[tuple[torch.Tensor, TokenBitmask, list[set[int]]]]:
    """Random words (bit 31 and whole words of ones and zeros among them), masked rows in any order, logits as wide
    as the mask, narrower and wider; and each masked row's allowed tokens, read bit by bit."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for vocab, words in [(64, 2), (70, 2), (50, 2), (100, 4), (31, 1)]:
        n = 5
        bits = torch.randint(-2**31, 2**31, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
        bits[0, 0], bits[1, -1] = -1, 0
        bits[2, 0] = -2**31                              # only bit 31 of the first word
        rows = torch.randperm(n, generator=gen)[:3].tolist()
        allowed = [{t for t in range(vocab) if t < 32 * words and (int(bits[j, t // 32]) >> (t % 32)) & 1}
                   for j in range(3)]
        cases.append((torch.randn(n, vocab, generator=gen), TokenBitmask(rows, bits), allowed))
    return cases


@pytest.mark.parametrize("seed", range(3))
def test_masks_unpacked_on_the_device_equal_the_host_unpacking(seed):
    """On an accelerator the packed words are unpacked there (`masked_on_device`); on CPU numpy unpacks them. Both
    keep exactly each masked row's allowed tokens (all of a row that allows none), and leave the other rows."""
    for scores, mask, allowed in random_masks(seed):
        host, device = masked_on_host(scores, mask), masked_on_device(scores, mask)
        assert torch.equal(host, device)
        for r in range(scores.shape[0]):
            kept = set(range(scores.shape[1]))
            if r in mask.rows and allowed[mask.rows.index(r)]:
                kept = allowed[mask.rows.index(r)]
            assert {t for t in range(scores.shape[1]) if torch.isfinite(device[r, t])} == kept


@pytest.mark.gpu
def test_gpu_masks_unpacked_on_the_device_equal_the_host_unpacking():
    for seed in range(3):
        for scores, mask, _ in random_masks(seed):
            assert torch.equal(apply_token_bitmask(scores.cuda(), mask).cpu(), masked_on_host(scores, mask))
