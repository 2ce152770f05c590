"""Sampler: TGI's logits processors, greedy/seeded sampling and logprobs, vectorised over the batch.

Semantics (TGI's HeterogeneousNextTokenChooser, per row):
- repetition_penalty (HF: over prompt + generated; positive logits divided, negative multiplied),
  then frequency_penalty (OpenAI: minus penalty * count over generated tokens only);
- as in TGI, temperature != 1, top_k, top_p < 1 or typical_p < 1 turn sampling on even without
  do_sample; warpers apply in that order, each only to the rows that set it;
- logprobs (chosen token and top_n_tokens) are log_softmax of the *processed* scores, as TGI
  reports them: after penalties and warpers, so tokens cut by top-k/top-p have -inf.
A grammar's token bitmask (engine.structured) applies first, to greedy and sampling rows alike, so penalties,
warpers and the reported logprobs all see the constrained distribution.
Sampling rows with a top-k, or a top-p whose nucleus lies in their best few hundred tokens, run the warpers,
logprob and draw on those candidates alone (engine/candidate_sampling.py); the others over the vocabulary.
Each sampling row draws from its own (CPU) torch.Generator, one uniform per step whichever path draws it, so a
seeded request gives the same tokens whatever else is in the batch; across devices too, unless a uniform falls
within float32 rounding of a token's boundary (the draw's probabilities are float32: `inverse_cdf_blocked`).
On a GPU, with the engine's `PenaltyCounts`, penalties read token counts kept on the device between steps
instead of copying each history there (on CPU the per-history path is faster and stays, its histories kept
as arrays between steps: `TokenHistories`).
"""
from __future__ import annotations

import logging
import os
import random
import threading
from array import array
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Protocol, Sequence

import torch

from engine import candidate_sampling
from engine.device_copy import list_to_device, to_device
from engine.penalty_counts import PenaltyCounts
from engine.sampling_params import SamplingParams
from engine.structured.masks import TokenBitmask, apply_token_bitmask
from engine.token_histories import TokenHistories

logger = logging.getLogger(__name__)


class SampleRow(Protocol):
    """What the sampler reads from a sequence (engine.sequence.Sequence satisfies it)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None
    generator: torch.Generator | None


@dataclass(slots=True)
class SamplerOutput:
    """Read-only for its consumers: the rows without alternatives may share one empty list (no 2 x batch
    allocations per step for nothing)."""

    token_ids: list[int]
    logprobs: list[float]                 # nan for all rows when no row asked for logprobs (greedy shortcut)
    top_token_ids: list[list[int]]        # per row, its top_n_tokens best ids (empty if 0)
    top_logprobs: list[list[float]]


NO_TOP: list = []   # the empty row of top_token_ids / top_logprobs that rows without alternatives share


def is_sampling(params: SamplingParams) -> bool:
    return (params.do_sample or params.temperature != 1.0 or bool(params.top_k)
            or (params.top_p is not None and params.top_p < 1.0)
            or (params.typical_p is not None and params.typical_p < 1.0))


def pick_seed(params: SamplingParams) -> int | None:
    """The request's seed: its own, a fresh one when it samples without one, None for greedy."""
    if params.seed is not None:
        return params.seed
    return random.getrandbits(63) if is_sampling(params) else None


@dataclass(slots=True)
class ProcessedScores:
    scores: torch.Tensor                  # [n, vocab] after mask, penalties and warpers (greedy = their argmax)
    logprobs: torch.Tensor                # [n, vocab] log_softmax of the scores
    sampling: list[bool]                  # per row: draws (True) or takes the argmax


def penalized(logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: TokenBitmask | None = None,
              counts: PenaltyCounts | None = None, in_flight: torch.Tensor | None = None) -> torch.Tensor:
    """The scores after each row's grammar mask and penalties (float32; the logits themselves left alone).
    `in_flight`: the tokens in flight of the first rows, on the device and not yet in their histories (a step
    ahead's decodes, engine/async_scheduling.py); the penalties count them through `counts`, which must be given."""
    params = [row.params for row in rows]
    scores = logits.float()
    histories = None
    if counts is not None and scores.device.type == "cpu" and in_flight is None:
        # on CPU the sparse per-history path wins (kept counts cost vocabulary-wide passes); its histories are kept
        histories, counts = counts.histories, None
    if bitmask is not None:
        scores = apply_token_bitmask(scores, bitmask)
    if any(p.repetition_penalty not in (None, 1.0) for p in params):
        scores = apply_repetition_penalty(scores, rows, counts, histories, in_flight)
    if any(p.frequency_penalty for p in params):
        scores = apply_frequency_penalty(scores, rows, counts, histories, in_flight)
    return scores


def process(logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: TokenBitmask | None = None,
            counts: PenaltyCounts | None = None) -> ProcessedScores:
    """Grammar mask, penalties and warpers of each row, then log_softmax: the distribution a row draws from.
    `counts`: the engine's token counts kept between steps (else each history is counted afresh)."""
    return _warped(penalized(logits, rows, bitmask, counts), [row.params for row in rows])


def _warped(scores: torch.Tensor, params: list[SamplingParams], reads_back: bool = True) -> ProcessedScores:
    sampling = [is_sampling(p) for p in params]
    if any(sampling):
        scores = apply_warpers(scores, params, sampling, reads_back=reads_back)
    return ProcessedScores(scores, fresh_log_softmax(scores), sampling)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: TokenBitmask | None = None,
           counts: PenaltyCounts | None = None, *, all_greedy: bool = False,
           any_logprobs: bool = True) -> SamplerOutput:
    """Choose one token per row of `logits` [n, vocab] (float32) with that row's parameters, among the tokens
    `bitmask` allows for the rows it names. Sampling rows with a top-k or a top-p draw among their best few
    tokens (engine/candidate_sampling.py); the rest, and those the few cannot settle, over the vocabulary.
    `all_greedy`: the caller knows every row is `plain_greedy` (its engine serves no other request now), so the
    rows' parameters are not read at all; `any_logprobs` False then: no row reports a logprob (none computed)."""
    if all_greedy and bitmask is None:
        next_ids, chosen = greedy_chosen(logits.float(), any_logprobs)
        return SamplerOutput(next_ids, chosen, [NO_TOP] * len(next_ids), [NO_TOP] * len(next_ids))
    params = [row.params for row in rows]
    if bitmask is None and not any(map(_changes_scores, params)):
        # greedy rows only and nothing processes the scores: argmax, and the log_softmax only when a row
        # reports logprobs (on CPU the fused log_softmax beats logsumexp + gather)
        scores = logits.float()
        if any(map(_top_n_tokens, params)):
            next_ids = greedy_ids(scores)
            return report(log_softmax(scores), next_ids, params)
        next_ids, chosen = greedy_chosen(scores, any(p.logprobs for p in params))
        return SamplerOutput(next_ids, chosen, [NO_TOP] * len(params), [NO_TOP] * len(params))
    scores = penalized(logits, rows, bitmask, counts)
    sampling = [is_sampling(p) for p in params]
    # one uniform per sampling row and step, whichever path draws it: a seed gives the same tokens in any batch
    uniforms = {r: draw_uniform(rows[r]) for r, s in enumerate(sampling) if s}
    picked = [r for r, s in enumerate(sampling) if s and candidate_sampling.fits(params[r])]
    kernels = _on_kernels(scores)
    plain = [r for r, s in enumerate(sampling) if s and _temperature_only(params[r])] if kernels is not None else []
    argmax = [r for r, s in enumerate(sampling) if not s and not params[r].top_n_tokens]
    if not picked and not plain and len(argmax) < len(rows):
        return _dense(scores, rows, params, sampling, uniforms)
    n = len(rows)
    out = SamplerOutput([0] * n, [0.0] * n, [NO_TOP] * n, [NO_TOP] * n)
    done: set[int] = set()
    if picked:
        drawn = candidate_sampling.draw(_select(scores, picked), [params[r] for r in picked],
                                        [uniforms[r] for r in picked])
        for j, i in enumerate(drawn.rows):
            r = picked[i]
            out.token_ids[r], out.logprobs[r] = drawn.token_ids[j], drawn.logprobs[j]
            done.add(r)
    if plain:   # temperature alone: the CPU kernel draws over the vocabulary in one read of each row
        ids, chosen = kernels.sample(_select(scores, plain), torch.tensor([params[r].temperature for r in plain]),
                                     torch.tensor([uniforms[r] for r in plain], dtype=torch.float64))
        for r, token, logprob in zip(plain, ids.tolist(), chosen.tolist()):
            out.token_ids[r], out.logprobs[r] = token, logprob
            done.add(r)
    if argmax:  # greedy rows (penalised, masked, or beside sampling ones): argmax and logprob in one read
        ids, chosen = greedy_chosen(_select(scores, argmax), any(params[r].logprobs for r in argmax))
        for r, token, logprob in zip(argmax, ids, chosen):
            out.token_ids[r], out.logprobs[r] = token, logprob
            done.add(r)
    rest = [r for r in range(n) if r not in done]
    if rest:
        other = _dense(_select(scores, rest), [rows[r] for r in rest], [params[r] for r in rest],
                       [sampling[r] for r in rest], {j: uniforms[r] for j, r in enumerate(rest) if sampling[r]})
        for j, r in enumerate(rest):
            out.token_ids[r], out.logprobs[r] = other.token_ids[j], other.logprobs[j]
            out.top_token_ids[r], out.top_logprobs[r] = other.top_token_ids[j], other.top_logprobs[j]
    return out


def _temperature_only(p: SamplingParams) -> bool:
    """A sampling row whose only warper is its temperature, with nothing to report beyond the chosen logprob."""
    return (not p.top_k and (p.top_p is None or p.top_p >= 1.0) and (p.typical_p is None or p.typical_p >= 1.0)
            and not p.top_n_tokens and p.temperature > 0)


def _select(scores: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == scores.shape[0]:
        return scores
    return scores.index_select(0, torch.tensor(rows, device=scores.device))


def _dense(scores: torch.Tensor, rows: Sequence[SampleRow], params: list[SamplingParams], sampling: list[bool],
           uniforms: dict[int, float]) -> SamplerOutput:
    """Warpers, log_softmax and the draw over the whole vocabulary; `uniforms`: the sampling rows' draws."""
    processed = _warped(scores, params)
    return report(processed.logprobs, _chosen_ids(processed, uniforms), params)


def _chosen_ids(processed: ProcessedScores, uniforms: dict[int, float]) -> torch.Tensor:
    """Each row's token [n] on the scores' device: the argmax, or a sampling row's draw by its uniform."""
    if all(processed.sampling):   # no row takes the argmax
        return _draw(processed.logprobs, None, processed.sampling, uniforms)
    next_ids = processed.scores.argmax(dim=-1)
    if any(processed.sampling):
        next_ids = _draw(processed.logprobs, next_ids, processed.sampling, uniforms)
    return next_ids


_cpu_kernels: Any = None           # engine.kernels.cpu_log_softmax once `use_cpu_kernels` turned it on
_cpu_kernels_unusable: list[str | None] = []     # the kernels' self-check verdict, once per process
SAMPLER_ENV = "TGI_HPC_CPU_SAMPLER"              # auto | fused | torch


def use_cpu_kernels() -> str:
    """Turn the CPU log_softmax kernels (engine/kernels/cpu_log_softmax.py) on for this process's CPU float32
    logits, once they have built and passed their self-check: every logprob then comes from them (the same bits
    whichever path chose the token), and greedy rows take their argmax and logprob in one read of the logits.
    Returns "fused"; else "torch (why not)", and torch's passes run. $TGI_HPC_CPU_SAMPLER: auto (the default),
    fused (raises ValueError when the kernels cannot run) or torch."""
    global _cpu_kernels
    from engine.kernels import cpu_log_softmax
    wanted = os.environ.get(SAMPLER_ENV, "") or "auto"
    if wanted not in ("auto", "fused", "torch"):
        raise ValueError(f"{SAMPLER_ENV}={wanted!r}; use auto, fused or torch")
    _cpu_kernels = None
    if wanted == "torch":
        return f"torch ({SAMPLER_ENV}=torch)"
    if not _cpu_kernels_unusable:
        _cpu_kernels_unusable.append(cpu_log_softmax.unusable_reason())
    reason = _cpu_kernels_unusable[0]
    if reason is not None:
        if wanted == "fused":
            raise ValueError(f"{SAMPLER_ENV}=fused, but the CPU sampler kernels cannot run here: {reason}")
        logger.info("CPU sampler kernels not used: %s", reason)
        return f"torch ({reason})"
    _cpu_kernels = cpu_log_softmax
    return "fused"


def _on_kernels(scores: torch.Tensor) -> Any:
    """The CPU kernels module when it serves `scores`, else None."""
    kernels = _cpu_kernels
    if kernels is not None and scores.device.type == "cpu" and scores.dtype == torch.float32 \
            and scores.dim() == 2 and scores.stride(-1) == 1:
        return kernels
    return None


def greedy_ids(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first one on ties; NaN counts as the largest, as in torch). On CPU through
    numpy, whose SIMD argmax is ~10x torch's (0.07 vs 0.9 ms at 256 x 4,096, 6 vs 27 ms at 256 x 128k)."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2 and scores.shape[-1]:
        return torch.from_numpy(scores.numpy().argmax(axis=-1))
    return scores.argmax(dim=-1)


_top_n_tokens = attrgetter("top_n_tokens")

GREEDY_CHUNK = 1 << 20   # scores per chunk of rows in greedy_chosen (4 MB of float32)


def greedy_chosen(scores: torch.Tensor, logprobs: bool) -> tuple[list[int], list[float]]:
    """Each row's argmax and, with `logprobs`, its log_softmax value (else nan). On CPU float32 through the
    one-pass kernel when `use_cpu_kernels` turned them on (the bits of their log_softmax at the argmax);
    else `greedy_ids` and `log_softmax` (torch's values, bit for bit) on chunks of rows of GREEDY_CHUNK scores
    at most, so that a wide vocabulary is read from memory once, into the cache, for both, and the log_softmax
    buffer written stays small."""
    n, vocab = scores.shape
    if (kernels := _on_kernels(scores)) is not None:
        next_ids, chosen = kernels.greedy(scores, logprobs)
        return next_ids.tolist(), chosen.tolist()
    step = max(1, GREEDY_CHUNK // max(vocab, 1))
    if step >= n or scores.device.type != "cpu":
        next_ids = greedy_ids(scores)
        if not logprobs:
            return next_ids.tolist(), [float("nan")] * n
        chosen = log_softmax(scores).gather(1, next_ids[:, None]).squeeze(1)    # queued before the first sync
        return next_ids.tolist(), chosen.tolist()
    ids: list[int] = []
    chosen: list[float] = []
    for start in range(0, n, step):
        chunk = scores[start:start + step]
        chunk_ids = greedy_ids(chunk)
        ids += chunk_ids.tolist()
        if logprobs:
            chosen += log_softmax(chunk).gather(1, chunk_ids[:, None]).squeeze(1).tolist()
    return ids, chosen if logprobs else [float("nan")] * n


_workspace = threading.local()   # per step thread: a float32 buffer the CPU log_softmax writes into


def log_softmax(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary. On CPU into a buffer kept between calls (one per thread), valid until
    the next call: a fresh [256, 128k] result costs more in page faults than in math (81 vs 25 ms)."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32:
        return torch.log_softmax(scores, dim=-1)
    buffer = getattr(_workspace, "buffer", None)
    if buffer is None or buffer.numel() < scores.numel():
        buffer = _workspace.buffer = torch.empty(scores.numel(), dtype=torch.float32)
    out = buffer[:scores.numel()].view(scores.shape)
    if (kernels := _on_kernels(scores)) is not None:
        return kernels.log_softmax(scores, out)
    return torch._log_softmax(scores, -1, False, out=out)


def fresh_log_softmax(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary into a new tensor (the CPU kernels' when on, as `log_softmax`)."""
    if (kernels := _on_kernels(scores)) is not None:
        return kernels.log_softmax(scores)
    return torch.log_softmax(scores, dim=-1)


@dataclass(slots=True)
class DevicePicks:
    """The chosen tokens, their logprobs and the alternatives asked for, on the device (`reported`)."""

    token_ids: torch.Tensor                 # [n] int64
    logprobs: torch.Tensor | None           # [n] the chosen tokens' (None: not asked for)
    top_token_ids: torch.Tensor | None      # [n, max top_n_tokens] the best alternatives, when a row asks for them
    top_logprobs: torch.Tensor | None


def pick_on_device(logits: torch.Tensor, rows: Sequence[SampleRow], logprobs: bool,
                   counts: PenaltyCounts | None = None, bitmask: TokenBitmask | None = None,
                   in_flight: torch.Tensor | None = None) -> DevicePicks:
    """Each row's next token, left on the device, its logprob in the processed distribution (for a batch of plain
    greedy rows only with `logprobs`), and the best `top_n_tokens` alternatives of the rows that ask (as `sample`
    reports them); nothing waits for the device. Greedy rows take the argmax; sampling rows draw by inverse CDF over
    their warped distribution with this step's uniform from their own generator, the one `sample` would draw, so a
    seed gives the same tokens either way (up to float32 rounding at a token's boundary, as across devices).
    Penalties read each row's history as it is on the host (`counts`: the engine's, as for `sample`) and, for the
    first rows, its token in flight (`in_flight`, on the device: `penalized`); the rows `bitmask` names keep only
    the tokens their grammar allows; their inputs are copied through pinned memory."""
    params = [row.params for row in rows]
    if bitmask is None and all(map(plain_greedy, params)):
        scores = logits.float()
        ids = scores.argmax(dim=-1)
        chosen = scores.gather(1, ids[:, None]).squeeze(1) - scores.logsumexp(dim=-1) if logprobs else None
        return DevicePicks(ids, chosen, None, None)
    processed = _warped(penalized(logits, rows, bitmask, counts, in_flight), params, reads_back=False)
    uniforms = {r: draw_uniform(rows[r]) for r, s in enumerate(processed.sampling) if s}
    return reported(processed.logprobs, _chosen_ids(processed, uniforms), params)


def plain_greedy(params: SamplingParams) -> bool:
    """Nothing processes this request's scores and it reports no alternatives: each token is the argmax."""
    return not _changes_scores(params) and not params.top_n_tokens


def _changes_scores(p: SamplingParams) -> bool:
    # is_sampling's test written out: this runs for every row of every step
    return (p.do_sample or p.temperature != 1.0 or bool(p.top_k) or (p.top_p is not None and p.top_p < 1.0)
            or (p.typical_p is not None and p.typical_p < 1.0) or p.repetition_penalty not in (None, 1.0)
            or bool(p.frequency_penalty))


def report(logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> SamplerOutput:
    """The chosen tokens' logprobs and each row's top_n_tokens alternatives."""
    picks = reported(logprobs, token_ids, params)
    return host_output(*(None if t is None else t.tolist() for t in
                         (picks.token_ids, picks.logprobs, picks.top_token_ids, picks.top_logprobs)), params)


def reported(logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> DevicePicks:
    """`report`'s tensors, left where `logprobs` [n, vocab] is: the chosen tokens' logprobs and the best
    max(top_n_tokens) alternatives of every row."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top_n = max((p.top_n_tokens for p in params), default=0)
    if top_n == 0:
        return DevicePicks(token_ids, chosen, None, None)
    top = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
    return DevicePicks(token_ids, chosen, top.indices, top.values)


def host_output(token_ids: list[int], logprobs: list[float] | None, top_ids: list[list[int]] | None,
                top_logprobs: list[list[float]] | None, params: Sequence[SamplingParams]) -> SamplerOutput:
    """A `DevicePicks` read back (as lists) as the sampler's output: each row's own top_n_tokens of the
    alternatives, logprobs nan when none were computed."""
    n = len(token_ids)
    if logprobs is None:
        logprobs = [float("nan")] * n
    if top_ids is None:
        return SamplerOutput(token_ids, logprobs, [NO_TOP] * n, [NO_TOP] * n)
    wanted = [p.top_n_tokens for p in params]
    return SamplerOutput(token_ids, logprobs, [row[:k] if k else NO_TOP for row, k in zip(top_ids, wanted)],
                         [row[:k] if k else NO_TOP for row, k in zip(top_logprobs, wanted)])


def generator_for(row: SampleRow) -> torch.Generator:
    """The request's own CPU generator, seeded on its first draw."""
    if row.generator is None:
        row.generator = torch.Generator()
        row.generator.manual_seed(row.seed if row.seed is not None else random.getrandbits(63))
    return row.generator


def draw_uniform(row: SampleRow) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator_for(row)))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids [n] drawn from unnormalised `probs` [n, vocab] (float64) by one uniform per row: the
    whole-vocabulary reference of `inverse_cdf_blocked`."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so zero-probability tokens at the tail can never be picked
    target = torch.minimum(uniforms.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=cdf.shape[-1] - 1)


CDF_BLOCK = 1024   # probabilities per block of the two-level inverse CDF


def inverse_cdf_blocked(logprobs: torch.Tensor, uniforms: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """Token ids [n] drawn from exp(`logprobs`) [n, vocab] by one float64 uniform per row, with no float64
    copy of the vocabulary: float64 sums of blocks of `block` float32 probabilities pick a block, then a
    float64 cumulative sum inside that one block picks the token (a zero-probability token never)."""
    n, vocab = logprobs.shape
    probs = logprobs.exp()
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, -vocab % block))
    blocks = probs.view(n, -1, block)
    cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)           # [n, num_blocks]
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)          # [n, 1]
    before = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, j[:, :, None].expand(n, 1, block)).squeeze(1).double()      # [n, block]
    k = torch.searchsorted(inner.cumsum(dim=-1) + before, target, right=True)
    offsets = torch.arange(block, device=inner.device).expand_as(inner)
    last = torch.where(inner > 0, offsets, torch.full_like(offsets, -1)).amax(dim=-1, keepdim=True)
    return (j * block + torch.minimum(k, last)).squeeze(1)   # the block's last token with p > 0 at its edge


def _draw(logprobs: torch.Tensor, next_ids: torch.Tensor | None, sampling: list[bool],
          uniforms: dict[int, float]) -> torch.Tensor:
    # inverse CDF: one uniform per row from the request's own CPU generator, so a seed gives the
    # same draws on any device and batch; the vocab-wide work is a float32 exp, block sums and one block's
    # cumsum per row. `next_ids` None: every row samples.
    idx = [r for r, s in enumerate(sampling) if s]
    device = logprobs.device
    uniform = list_to_device([uniforms[r] for r in idx], torch.float64, device)
    if next_ids is None:
        return inverse_cdf_blocked(logprobs, uniform)
    index = list_to_device(idx, torch.int64, device)
    return next_ids.index_copy(0, index, inverse_cdf_blocked(logprobs.index_select(0, index), uniform))


def _padded_ids(rows: Sequence[SampleRow], which: list[int], generated_only: bool,
                device: torch.device, histories: TokenHistories | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(which), max_len] token ids per row, padded with that row's first id, and a 0/1 mask; from
    `histories` (kept between steps) when given."""
    if histories is not None:
        return histories.padded(rows, which, generated_only, device)
    lists = [rows[r].token_ids[rows[r].num_prompt_tokens:] if generated_only else rows[r].token_ids
             for r in which]
    width = max(1, max(len(ids) for ids in lists))
    ids = torch.zeros(len(lists), width, dtype=torch.long)
    mask = torch.zeros(len(lists), width)
    for j, row_ids in enumerate(lists):
        if row_ids:
            # through array('q'): ~15x faster than torch.tensor(list) on a 2k-token history
            ids[j, :len(row_ids)] = torch.frombuffer(array("q", row_ids), dtype=torch.int64)
            ids[j, len(row_ids):] = row_ids[0]
            mask[j, :len(row_ids)] = 1.0
    return to_device(ids, device), to_device(mask, device)


def apply_repetition_penalty(scores: torch.Tensor, rows: Sequence[SampleRow], counts: PenaltyCounts | None = None,
                             histories: TokenHistories | None = None,
                             in_flight: torch.Tensor | None = None) -> torch.Tensor:
    which = [r for r, row in enumerate(rows) if row.params.repetition_penalty not in (None, 1.0)]
    penalty = list_to_device([rows[r].params.repetition_penalty for r in which], scores.dtype, scores.device)[:, None]
    index = list_to_device(which, torch.int64, scores.device)
    if counts is not None:
        present = counts.presence(rows, which, scores.shape[-1], scores.device, in_flight)
        picked = scores[index]
        picked = torch.where(present, torch.where(picked < 0, picked * penalty, picked / penalty), picked)
        return scores.index_copy(0, index, picked)      # out of place: the caller's logits stay
    ids, _ = _padded_ids(rows, which, generated_only=False, device=scores.device, histories=histories)
    row_ids = index[:, None].expand_as(ids)
    picked = scores[row_ids, ids]       # only the penalised entries: no copy of the penalised rows
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    # out of place (the caller's logits stay as they were); padding repeats a row's first id, same value
    return scores.index_put((row_ids, ids), picked)


def apply_frequency_penalty(scores: torch.Tensor, rows: Sequence[SampleRow], counts: PenaltyCounts | None = None,
                            histories: TokenHistories | None = None,
                            in_flight: torch.Tensor | None = None) -> torch.Tensor:
    which = [r for r, row in enumerate(rows) if row.params.frequency_penalty]
    penalty = list_to_device([rows[r].params.frequency_penalty for r in which], scores.dtype, scores.device)[:, None]
    if counts is not None:
        times = counts.generated(rows, which, scores.shape[-1], scores.device, in_flight).to(scores.dtype)
    else:
        ids, mask = _padded_ids(rows, which, generated_only=True, device=scores.device, histories=histories)
        times = torch.zeros(len(which), scores.shape[-1], dtype=scores.dtype, device=scores.device)
        times.scatter_add_(1, ids, mask.to(scores.dtype))
    index = list_to_device(which, torch.int64, scores.device)
    return scores.index_copy(0, index, scores[index] - penalty * times)     # out of place


def apply_warpers(scores: torch.Tensor, params: list[SamplingParams], sampling: list[bool], *,
                  reads_back: bool = True) -> torch.Tensor:
    """Temperature, top-k, top-p, typical-p, each on the rows that sample and set it. `reads_back` False: nothing
    waits for the device (no top-k prefilter count before top-p, which then sorts the vocabulary)."""
    device, dtype = scores.device, scores.dtype
    temps = [p.temperature if s else 1.0 for p, s in zip(params, sampling)]
    if any(t != 1.0 for t in temps):
        scores = scores / list_to_device(temps, dtype, device)[:, None]
    top_k = [(p.top_k or 0) if s else 0 for p, s in zip(params, sampling)]
    if any(top_k):
        rows = [r for r, k in enumerate(top_k) if k]  # rows without a top-k (greedy ones too) skip the topk
        scores = _on_rows(scores, rows, lambda sub: top_k_mask(
            sub, list_to_device([top_k[r] for r in rows], torch.int64, device), max(top_k)))
    top_p = [p.top_p if s and p.top_p is not None else 1.0 for p, s in zip(params, sampling)]
    if any(v < 1.0 for v in top_p):
        rows = [r for r, v in enumerate(top_p) if v < 1.0]  # only these rows are sorted
        # top-k prefilter: when every top-p row also has a top-k, only its survivors need sorting (ties with
        # the k-th survive too, so they are counted, not assumed)
        max_kept = None
        if reads_back and all(top_k[r] for r in rows):
            max_kept = max(1, int(torch.isfinite(scores[rows]).sum(dim=-1).max()))
        scores = _on_rows(scores, rows, lambda sub: top_p_mask(
            sub, list_to_device([top_p[r] for r in rows], dtype, device), max_kept))
    typical = [p.typical_p if s and p.typical_p is not None else 1.0 for p, s in zip(params, sampling)]
    if any(v < 1.0 for v in typical):
        scores = typical_mask(scores, list_to_device(typical, dtype, device))
    return scores


def _on_rows(scores: torch.Tensor, rows: list[int], mask: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`mask` applied to `rows` of scores only (all of them: in place of the whole); out of place."""
    if len(rows) == scores.shape[0]:
        return mask(scores)
    index = list_to_device(rows, torch.int64, scores.device)
    return scores.index_copy(0, index, mask(scores.index_select(0, index)))


def top_k_mask(scores: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keep each row's `top_k` best scores (ties with the k-th kept too); 0 = keep all."""
    vocab = scores.shape[-1]
    k = top_k.clamp(max=vocab)
    max_k = min(max_k if max_k is not None else int(k.max()), vocab)  # pass max_k: no device sync
    kth = scores.topk(max_k, dim=-1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_mask(scores: torch.Tensor, top_p: torch.Tensor, max_kept: int | None = None) -> torch.Tensor:
    """Nucleus: keep the fewest best tokens whose probability reaches `top_p` (HF semantics).

    `max_kept`: no row with top_p < 1 has more finite scores than this (a top-k ran first), so only
    the best `max_kept` of each row are sorted instead of the whole vocabulary: the -inf scores left out
    have probability 0 and would only have sat at the head of the ascending sort.
    """
    if max_kept is not None and max_kept < scores.shape[-1]:
        best = scores.topk(max_kept, dim=-1)                # descending
        sorted_scores, order = best.values.flip(-1), best.indices.flip(-1)
    else:
        sorted_scores, order = scores.sort(dim=-1)          # ascending
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)[:, None]
    remove[:, -1] = False                                # always keep the best token
    remove &= (top_p < 1.0)[:, None]
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, order, remove)
    return scores.masked_fill(mask, float("-inf"))


def typical_mask(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy, up to `mass`."""
    logp = scores.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)
    deviation = (-logp - entropy).abs()
    sorted_dev, order = deviation.sort(dim=-1)          # most typical first
    cum = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass[:, None]).sum(dim=-1).clamp(max=scores.shape[-1] - 1)
    remove = sorted_dev > sorted_dev.gather(1, last[:, None])
    remove &= (mass < 1.0)[:, None]
    return scores.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))
