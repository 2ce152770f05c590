"""Which drafted tokens a sequence keeps: exact match for greedy, rejection sampling when it samples.

Rejection sampling for a deterministic draft (the n-gram draft puts all its mass on one token x):
accept x with probability p(x); on reject draw from p with x removed and renormalised. Then
P(x) = p(x) and P(y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y) for y != x: the target distribution,
position by position. When every draft is accepted, the last position gives a bonus token.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sampler import inverse_cdf

Uniform = Callable[[], float]


def accept_greedy(scores: torch.Tensor, draft: list[int]) -> list[int]:
    """`scores` [k + 1, vocab] of the positions after the last real token and after each draft token:
    the drafts up to the first that is not the argmax, then the argmax there (or the bonus)."""
    best = scores.argmax(dim=-1).tolist()
    tokens = []
    for j, token in enumerate(draft):
        if best[j] != token:
            break
        tokens.append(token)
    tokens.append(best[len(tokens)])
    return tokens


def accept_sampled(logprobs: torch.Tensor, draft: list[int], uniform: Uniform) -> list[int]:
    """`logprobs` [k + 1, vocab] of the distributions the row samples from at each position; `uniform()`
    draws from the request's own generator (one per accept test, one per resampled or bonus token)."""
    k = len(draft)
    draft_probs = logprobs[:k].gather(1, torch.tensor(draft, device=logprobs.device)[:, None]).exp().tolist() \
        if k else []
    tokens = []
    for j, token in enumerate(draft):
        if uniform() < draft_probs[j][0]:
            tokens.append(token)
            continue
        residual = _residual(logprobs[j].double().exp(), token)
        # p(x) rounded below 1 with nothing else left: x was certain after all
        tokens.append(_draw(residual, uniform()) if residual.sum() > 0 else token)
        return tokens
    tokens.append(_draw(logprobs[k].double().exp(), uniform()))
    return tokens


def _residual(probs: torch.Tensor, rejected: int) -> torch.Tensor:
    """p with the rejected draft removed (inverse_cdf renormalises)."""
    probs = probs.clone()
    probs[rejected] = 0.0
    return probs


def _draw(probs: torch.Tensor, u: float) -> int:
    return int(inverse_cdf(probs[None], torch.tensor([u], dtype=torch.float64))[0])
