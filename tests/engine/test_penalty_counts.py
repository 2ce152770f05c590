"""Penalties from token counts kept between steps (engine/penalty_counts.py) give exactly the scores and
the seeded draws of counting each history afresh, step after step, while sequences join, grow, leave,
get their rows taken by others, and come back; with duplicate ids, ids at the vocabulary's ends and
rows without a sequence id."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from engine.penalty_counts import PenaltyCounts  # noqa: E402
from engine.sampler import apply_frequency_penalty, apply_repetition_penalty, sample  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 97


@dataclass(eq=False)
class Row:
    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None = None
    generator: torch.Generator | None = field(default=None)


@dataclass(eq=False)
class AnonymousRow:     # as the verifier's draft positions: no seq_id
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None = None
    generator: torch.Generator | None = None


def params(rng: random.Random) -> SamplingParams:
    return SamplingParams(repetition_penalty=rng.choice([None, 1.0, 1.3, 0.7]),
                          frequency_penalty=rng.choice([0.0, 0.5, -0.4]),
                          do_sample=rng.random() < 0.5, top_k=rng.choice([0, 5]), seed=rng.randrange(100))


@pytest.mark.parametrize("seed", range(5))
def test_kept_counts_equal_fresh_counts_step_after_step(seed):
    rng = random.Random(seed)
    counts = PenaltyCounts(rows=2)          # small: rows are taken over and the table grows
    live: list[Row] = []
    next_id = 0
    for step in range(60):
        if rng.random() < 0.3 or not live:
            prompt = [rng.choice([0, VOCAB - 1, rng.randrange(VOCAB)]) for _ in range(rng.randrange(1, 9))]
            live.append(Row(next_id, params(rng), prompt, len(prompt), seed=rng.randrange(10)))
            next_id += 1
        if rng.random() < 0.15 and len(live) > 1:
            live.pop(rng.randrange(len(live)))
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        if rng.random() < 0.2:
            batch.append(AnonymousRow(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3), [3, 3, 5, 3], 1))
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(step))
        if any(r.params.repetition_penalty not in (None, 1.0) for r in batch):
            assert torch.equal(apply_repetition_penalty(logits, batch, counts), apply_repetition_penalty(logits, batch))
        if any(r.params.frequency_penalty for r in batch):
            assert torch.equal(apply_frequency_penalty(logits, batch, counts), apply_frequency_penalty(logits, batch))
        states = [r.generator.get_state() if r.generator is not None else None for r in batch]
        fresh = sample(logits, batch)
        for r, state in zip(batch, states):
            if state is not None:
                r.generator.set_state(state)
            elif r.generator is not None:
                r.generator = None
        kept = sample(logits, batch, counts=counts)
        assert kept.token_ids == fresh.token_ids
        assert torch.equal(torch.tensor(kept.logprobs).nan_to_num(7.0), torch.tensor(fresh.logprobs).nan_to_num(7.0))
        for r, token in zip(batch, kept.token_ids):
            r.token_ids.append(token)


def test_a_history_that_got_shorter_is_recounted():
    counts = PenaltyCounts()
    row = Row(0, SamplingParams(frequency_penalty=1.0), [1, 2, 3, 3, 3], 2)
    logits = torch.zeros(1, 8)
    apply_frequency_penalty(logits, [row], counts)
    row.token_ids = [1, 2, 4]                      # e.g. a rollback
    assert torch.equal(apply_frequency_penalty(logits, [row], counts), apply_frequency_penalty(logits, [row]))


def test_the_callers_logits_are_left_alone():
    counts = PenaltyCounts()
    row = Row(0, SamplingParams(repetition_penalty=2.0), [1, 2], 1)
    logits = torch.ones(1, 4)
    apply_repetition_penalty(logits, [row], counts)
    assert torch.equal(logits, torch.ones(1, 4))
