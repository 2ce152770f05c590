"""The step's token bitmask: filled for the grammar rows of the batch in llguidance's thread pool, from a worker
thread started before the forward (the mask for step t depends only on tokens up to t-1), and applied to the
logits by the sampler."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class TokenBitmask:
    """`bits[j]` (int32 words, bit i of word w = token 32*w + i) allows the tokens of logits row `rows[j]`."""

    rows: list[int]
    bits: torch.Tensor          # [len(rows), ceil(vocab / 32)] int32


def apply_token_bitmask(scores: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`scores` [n, vocab] with the disallowed tokens of the masked rows at -inf (a copy)."""
    vocab = scores.shape[-1]
    allowed = ((mask.bits[:, :, None] >> _BITS) & 1).bool().reshape(len(mask.rows), -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab].to(scores.device)
    # a row with nothing allowed is a matcher bug; leave it unconstrained rather than sample from NaNs
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    rows = torch.tensor(mask.rows, device=scores.device)
    scores = scores.clone()
    scores[rows] = scores[rows].masked_fill(~allowed, float("-inf"))
    return scores


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
