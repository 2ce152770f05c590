"""BlockTables (device-resident block tables, updated by what changed) gives, step after step, exactly the
table rebuilt from the spans' lists, through every way the block manager changes a table: allocation
with prefix-cache hits, tail appends, truncation of rejected drafts, preemption and re-admission, and
sequences that skip steps, leave, or come back; with rows and width too small at first."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from engine.attention.block_tables import BlockTables  # noqa: E402
from engine.attention.metadata import build_metadata  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

BLOCK = 4


def span_of(seq: Sequence, versioned: bool = True) -> SeqSpan:
    return SeqSpan(seq.seq_id, [1], max(seq.num_computed_tokens - 1, 0), seq.block_table,
                   table_version=seq.block_table_version if versioned else -1)


def rebuilt(spans: list[SeqSpan]) -> torch.Tensor:
    return build_metadata(spans, BLOCK, torch.device("cpu")).block_tables


def simulate(device: torch.device, seed: int, steps: int = 150) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=400, block_size=BLOCK)
    tables = BlockTables(device, rows=2, width=1)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 20))] for _ in range(6)]  # shared prefixes
    live: list[Sequence] = []
    ids = iter(range(10**6))
    for _ in range(steps):
        action = rng.random()
        if action < 0.15 or not live:          # a new sequence, maybe hitting the prefix cache
            tokens = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(6))]
            seq = Sequence(next(ids), "r", tokens, SamplingParams(), max_tokens=10**6)
            if bm.can_allocate(seq, len(tokens)):
                bm.allocate(seq, len(tokens))
                seq.num_computed_tokens = len(tokens)
                bm.mark_computed(seq)
                live.append(seq)
        elif action < 0.25:                    # finished or preempted (freed); a preempted one comes back
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            if rng.random() < 0.5 and bm.can_allocate(seq, seq.num_tokens):
                bm.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif action < 0.35:                    # drafts appended, then rejected: the tail is given back
            seq = rng.choice(live)
            extra = rng.randrange(1, 3 * BLOCK)
            if bm.can_append(seq, seq.num_computed_tokens + extra):
                bm.append(seq, seq.num_computed_tokens + extra)
                bm.truncate(seq, seq.num_computed_tokens + rng.randrange(extra))
        for seq in live:                       # decode growth
            if rng.random() < 0.7 and bm.can_append(seq, seq.num_computed_tokens + 1):
                seq.token_ids.append(rng.randrange(50))
                bm.append(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
        if not live:
            continue
        chosen = rng.sample(live, rng.randrange(1, len(live) + 1))   # some sit a step out, order shuffled
        spans = [span_of(seq, versioned=rng.random() > 0.1) for seq in chosen]
        assert torch.equal(tables.gather(spans).cpu(), rebuilt(spans))


@pytest.mark.parametrize("seed", range(6))
def test_incremental_tables_equal_rebuilt_tables_through_every_kind_of_change(seed):
    simulate(torch.device("cpu"), seed)


def test_a_sequence_truncated_and_regrown_to_its_old_length_is_rewritten():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = Sequence(0, "r", [1] * 8, SamplingParams(), max_tokens=100)
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 8
    tables = BlockTables(torch.device("cpu"))
    tables.gather([span_of(seq)])
    bm.append(seq, 12)
    bm.truncate(seq, 8)
    bm.take_free_block()                                             # the next block handed out differs
    bm.append(seq, 12)                                               # same length as before, new tail block
    spans = [span_of(seq)]
    assert torch.equal(tables.gather(spans), rebuilt(spans))


def test_metadata_with_and_without_the_device_tables_is_the_same():
    spans = [SeqSpan(3, [5, 6], 3, [7, 2], table_version=0), SeqSpan(9, [1], 0, [4], table_version=0)]
    plain = build_metadata(spans, BLOCK, torch.device("cpu"))
    kept = build_metadata(spans, BLOCK, torch.device("cpu"), BlockTables(torch.device("cpu")))
    for name in ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
        assert torch.equal(getattr(plain, name), getattr(kept, name)), name
        assert getattr(plain, name).dtype == getattr(kept, name).dtype


@pytest.mark.gpu
def test_cuda_tables_through_pinned_staging_equal_rebuilt_tables():
    for seed in range(3):
        simulate(torch.device("cuda"), seed, steps=100)
