"""Sampling among a row's few candidate tokens instead of over the whole vocabulary.

A row that samples with top-k, or with a top-p whose nucleus lies inside its best few hundred tokens (a
language model's usual case), can only ever draw one of those tokens. Here such rows take one `topk` of their
scores (after the grammar mask and penalties, which engine/sampler.py applies to the whole batch) and run
temperature, top-k, top-p, the log_softmax and the draw on that short list, with TGI's semantics as the
dense path (engine/sampler.py `process`) has them: top-k keeps ties with the k-th score; top-p keeps the
fewest best tokens whose probability reaches p (HF's ascending cumulative sum, the best always kept); the
reported logprobs are those of the processed distribution; one float64 uniform from the row's generator picks
the token by inverse CDF over the kept tokens in vocabulary order, as the dense draw does.

A row goes back to the dense path when the list cannot be shown to hold its answer: ties with the k-th score
that run past the list, or a top-p without top-k whose list holds less than p plus a margin of the
probability (`NUCLEUS_MARGIN`; a flat distribution, say at a high temperature). Rows with typical-p or
top_n_tokens stay dense too. The list's length depends on the batch (the widest top-k in it), so its sums (top-p's
cumulative one, the log_softmax's) run in float64: a row's tokens and logprobs do not depend on what else is in the
batch unless float64 rounding moves a float32 result. Against the dense path the candidates change what a row keeps
only where a cumulative probability lies within float32 rounding of 1 - p, and its logprobs by float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.sampling_params import SamplingParams

NUCLEUS_LISTS = (256, 4096)   # tokens fetched for a top-p row without top-k: the first, then the one after
NUCLEUS_MARGIN = 1e-3     # the probability those must hold beyond p to settle the nucleus


def fits(params: SamplingParams) -> bool:
    """Whether a sampling row may go through the candidate list: it keeps a short list (top-k or top-p) and
    needs nothing beyond the chosen token's logprob from the distribution."""
    return ((bool(params.top_k) or (params.top_p is not None and params.top_p < 1.0))
            and (params.typical_p is None or params.typical_p >= 1.0) and not params.top_n_tokens
            and params.temperature > 0)


@dataclass(slots=True)
class Drawn:
    rows: list[int]               # positions (in the rows given) that were drawn here
    token_ids: list[int]
    logprobs: list[float]
    dense: list[int]              # positions that must take the dense path


def draw(scores: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float],
         lists: Sequence[int] = NUCLEUS_LISTS) -> Drawn:
    """Rows of `scores` [n, vocab] (float32, masked and penalised) drawn among their candidates, each by its
    uniform in [0, 1); the rows the candidates cannot settle are returned in `dense`, undrawn. A top-p row
    whose nucleus the first of `lists` does not settle tries the next."""
    out, short = _draw_once(scores, params, uniforms, lists[0])
    if short and len(lists) > 1:
        wider = draw(scores.index_select(0, torch.tensor(short, device=scores.device)), [params[r] for r in short],
                     [uniforms[r] for r in short], lists[1:])
        out.dense += [short[r] for r in wider.dense]
        for r, token, logprob in zip(wider.rows, wider.token_ids, wider.logprobs):
            out.rows.append(short[r])
            out.token_ids.append(token)
            out.logprobs.append(logprob)
    else:
        out.dense += short
    return out


def _draw_once(scores: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float],
               nucleus_list: int) -> tuple[Drawn, list[int]]:
    """`draw` with one list length for top-p rows; also the rows whose nucleus it did not hold."""
    n, vocab = scores.shape
    device = scores.device
    top_k = [min(p.top_k or 0, vocab) for p in params]
    top_p = [p.top_p if p.top_p is not None and p.top_p < 1.0 else 1.0 for p in params]
    nucleus_only = [k == 0 and q < 1.0 for k, q in zip(top_k, top_p)]
    fetch = min(vocab, max([k + 1 for k in top_k if k] + ([nucleus_list] if any(nucleus_only) else [])))
    temps = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=device)[:, None]
    best = scores.topk(fetch, dim=-1)                       # descending: the order temperature keeps
    vals, ids = best.values / temps, best.indices
    neg_inf = torch.tensor(float("-inf"), dtype=vals.dtype, device=device)
    k = torch.tensor([kk if kk else fetch for kk in top_k], device=device)
    kth = vals.gather(1, (k - 1)[:, None])
    vals = torch.where(vals >= kth, vals, neg_inf)          # top-k, ties with the k-th kept
    # ties with a finite k-th score that may run past the fetched tokens: the last fetched still equals it
    dense = (torch.tensor(top_k, device=device) > 0) & (vals[:, -1] >= kth[:, 0]) & torch.isfinite(kth[:, 0])
    dense &= fetch < vocab
    short = torch.zeros_like(dense)
    # top-p: HF's cumulative sum of the probabilities in ascending order, the tokens at or below each one; after
    # a top-k over the kept tokens (what the dense path sorts), else over the whole row: the tokens not fetched
    # sit at the low end, their mass 1 - what the fetched hold (from the row's logsumexp)
    if any(q < 1.0 for q in top_p):
        p = torch.tensor(top_p, dtype=vals.dtype, device=device)[:, None]
        asc = vals.flip(-1)
        remove = asc.double().softmax(dim=-1).cumsum(dim=-1) <= (1 - p).double()   # float64: see the docstring
        if any(nucleus_only) and fetch < vocab:
            rows = torch.tensor([r for r, x in enumerate(nucleus_only) if x], device=device)
            whole = len(rows) == n
            lse = ((scores if whole else scores.index_select(0, rows))
                   / (temps if whole else temps.index_select(0, rows))).logsumexp(dim=-1, keepdim=True)
            probs = (asc.index_select(0, rows) - lse).exp().double()
            held = probs.sum(dim=-1, keepdim=True)
            cum = probs.cumsum(dim=-1) + (1.0 - held).clamp(min=0.0)
            remove[rows] = cum <= (1 - p.index_select(0, rows)).double()
            short[rows] = held[:, 0] < p.index_select(0, rows)[:, 0].double() + NUCLEUS_MARGIN
        remove &= p < 1.0
        remove[:, -1] = False                               # the best token always stays
        vals = torch.where(remove.flip(-1), neg_inf, vals)
    wide = vals.double()
    logprobs = (wide - wide.logsumexp(dim=-1, keepdim=True)).float()
    # inverse CDF over the kept tokens in vocabulary order (the dense draw's order); removed ones sort last
    order = torch.where(torch.isfinite(vals), ids, torch.full_like(ids, vocab)).argsort(dim=-1)
    probs = logprobs.gather(1, order).exp().double()
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor(list(uniforms), dtype=torch.float64, device=device)[:, None]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    slot = torch.searchsorted(cdf, target, right=True).clamp(max=fetch - 1)
    pick = order.gather(1, slot)
    chosen_ids = ids.gather(1, pick)[:, 0].tolist()
    chosen_lps = logprobs.gather(1, pick)[:, 0].tolist()
    out, retry = Drawn([], [], [], []), []
    for r, (back, wider) in enumerate(zip(dense.tolist(), short.tolist())):
        if back or wider:
            (retry if wider else out.dense).append(r)
        else:
            out.rows.append(r)
            out.token_ids.append(chosen_ids[r])
            out.logprobs.append(chosen_lps[r])
    return out, retry
