"""The step's token bitmask: filled for the grammar rows of the batch in llguidance's thread pool, from a worker
thread started before the forward (the mask for step t depends only on tokens up to t-1), and applied to the
logits by the sampler. On CPU the bits are unpacked by numpy; on an accelerator the packed words (a bit a token,
4 MB for 256 rows of a 128k vocabulary, against 32 MB unpacked) are copied through pinned memory and unpacked there,
so the host does no vocabulary-wide work and the copy does not wait for queued kernels."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from engine.device_copy import list_to_device, to_device

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class TokenBitmask:
    """`bits[j]` (int32 words, bit i of word w = token 32*w + i) allows the tokens of logits row `rows[j]`."""

    rows: list[int]
    bits: torch.Tensor          # [len(rows), ceil(vocab / 32)] int32


def apply_token_bitmask(scores: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`scores` [n, vocab] with the disallowed tokens of the masked rows at -inf (a new tensor); tokens beyond the
    mask's words (a vocabulary padded past the tokenizer's) disallowed too. A row that allows nothing is a matcher
    bug: it is left unconstrained rather than sample from NaNs."""
    if scores.device.type == "cpu":
        return masked_on_host(scores, mask)
    return masked_on_device(scores, mask)


def masked_on_device(scores: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`apply_token_bitmask` with the packed words copied to `scores`' device and unpacked there."""
    vocab, device = scores.shape[1], scores.device
    words = to_device(mask.bits.contiguous(), device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)     # arithmetic shift: bit 31 is still 1
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed |= ~allowed.any(dim=1, keepdim=True)
    rows = list_to_device(mask.rows, torch.int64, device)
    return scores.index_copy(0, rows, scores.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def masked_on_host(scores: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`apply_token_bitmask` with the words unpacked by numpy (on CPU the fastest)."""
    n, vocab = scores.shape
    bits = mask.bits.contiguous()
    # int32 words are little-endian bytes, so byte k holds tokens 8k..8k+7, low bit first; numpy unpacks them in
    # one single-threaded C pass (torch's shift-and-mask is ~30x slower on a busy 2-core machine)
    unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = np.ones((n, max(vocab, unpacked.shape[1])), dtype=np.uint8)
    allowed[mask.rows, :unpacked.shape[1]] = unpacked
    allowed[mask.rows, unpacked.shape[1]:] = 0      # padded vocabulary rows beyond the tokenizer
    allowed = allowed[:, :vocab]
    allowed[[r for r in mask.rows if not allowed[r].any()]] = 1
    blocked = to_device(torch.from_numpy(allowed == 0), scores.device)
    return scores.masked_fill(blocked, float("-inf"))


class PendingMasks:
    """Masks being filled for `seqs` (in order); `for_rows` waits for them and maps them to the sampled rows."""

    def __init__(self, seqs: list[Any], future: Future[torch.Tensor]):
        self._row_of = {id(seq): j for j, seq in enumerate(seqs)}
        self._future = future

    def for_rows(self, sampled: Sequence[Any]) -> TokenBitmask | None:
        bits = self._future.result()
        rows = [r for r, seq in enumerate(sampled) if id(seq) in self._row_of]
        if not rows:
            return None
        return TokenBitmask(rows, bits[[self._row_of[id(sampled[r])] for r in rows]])


class MaskFiller:
    """One per engine. `start(seqs)` returns at once; llguidance computes the rows in parallel (num_threads,
    default: most cores) without the GIL, so the forward in the calling thread is not held up."""

    def __init__(self, vocab_size: int, num_threads: int | None = None):
        import llguidance
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def start(self, seqs: list[Any]) -> PendingMasks | None:
        """`seqs` all sample this step and carry a matcher in `.grammar`."""
        if not seqs:
            return None
        matchers = [seq.grammar for seq in seqs]
        return PendingMasks(seqs, self._pool.submit(self._fill, matchers))

    def _fill(self, matchers: list[Any]) -> torch.Tensor:
        import llguidance.torch
        bits = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m, j) for j, m in enumerate(matchers)], bits)
        return bits

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def draft_masks(matcher: Any, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """The grammar's masks at each position of a drafted decode: before each draft token and after the last
    ([1 + len(drafts), words]). Past the first draft the grammar refuses, every token is allowed: that draft is
    masked out at its own position, so acceptance never gets further. The matcher is left as it was."""
    import llguidance.torch
    bits = torch.full((len(drafts) + 1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    num_valid = matcher.validate_tokens(drafts)
    for j in range(num_valid + 1):
        llguidance.torch.fill_next_token_bitmask(matcher, bits, j)
        if j < num_valid:
            matcher.consume_token(drafts[j])
    if num_valid:
        matcher.rollback(num_valid)
    return bits
