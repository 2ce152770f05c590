"""Token histories kept between steps (engine/token_histories.py) give the CPU penalties exactly the ids of
converting each history afresh, step after step, while sequences join, grow, leave and come back, roll back
(a shorter list, or another list object of the same length), and rows come without a sequence id."""
from __future__ import annotations

import random
import pytest

torch = pytest.importorskip("torch")

import engine.token_histories as token_histories  # noqa: E402
from engine.penalty_counts import PenaltyCounts  # noqa: E402
from engine.sampler import _padded_ids, sample  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.token_histories import TokenHistories  # noqa: E402
from sampler_rows import AnonymousRow, Row  # noqa: E402

VOCAB = 61


def penalised(rng: random.Random) -> SamplingParams:
    return SamplingParams(repetition_penalty=rng.choice([1.3, 0.7]), frequency_penalty=rng.choice([0.0, 0.5]),
                          do_sample=rng.random() < 0.5, top_k=rng.choice([0, 5]), seed=rng.randrange(100))


@pytest.mark.parametrize("seed", range(4))
def test_kept_histories_equal_fresh_ones_step_after_step(seed, monkeypatch):
    monkeypatch.setattr(token_histories, "IDLE_CALLS", 3)      # sequences that pause get dropped and come back
    rng = random.Random(seed)
    histories = TokenHistories()
    live: list[Row] = []
    for step in range(80):
        if rng.random() < 0.3 or not live:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 40))]    # empty prompts too
            live.append(Row(len(live) + 1000 * step, penalised(rng), prompt, len(prompt)))
        if rng.random() < 0.1 and len(live) > 1:
            live.pop(rng.randrange(len(live)))
        row = rng.choice(live)
        if rng.random() < 0.1:                  # a rollback: a shorter list
            row.token_ids = row.token_ids[:rng.randrange(len(row.token_ids) + 1)]
        elif rng.random() < 0.1:                # another list of the same length, other ids
            row.token_ids = [(t + 1) % VOCAB for t in row.token_ids]
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        if rng.random() < 0.2:
            batch.append(AnonymousRow(penalised(rng), [3, 3, 5, 3], 1))
        which = sorted(rng.sample(range(len(batch)), rng.randrange(1, len(batch) + 1)))
        for generated_only in (False, True):
            kept = histories.padded(batch, which, generated_only, torch.device("cpu"))
            fresh = _padded_ids(batch, which, generated_only, torch.device("cpu"))
            assert torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1]), (step, generated_only)
        for r in batch:
            r.token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 1, 3]))]   # drafts: several
    assert len(histories.kept) <= 2 * len(live) + 3 + 1


def test_the_cpu_sampler_reads_kept_histories_and_draws_the_same_tokens():
    counts = PenaltyCounts()
    rows = [Row(i, SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, do_sample=i % 2 == 1, seed=i,
                                  top_k=7), [i, 5, 5, 9, i + 1], 2, seed=i) for i in range(6)]
    twins = [Row(r.seq_id, r.params, list(r.token_ids), r.num_prompt_tokens, seed=r.seed) for r in rows]
    for step in range(5):
        logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(step))
        kept = sample(logits, rows, counts=counts)
        fresh = sample(logits, twins)
        assert kept == fresh
        for r, t, token in zip(rows, twins, kept.token_ids):
            r.token_ids.append(token)
            t.token_ids.append(token)
    assert set(counts.histories.kept) == set(range(6)) and not counts.tables
