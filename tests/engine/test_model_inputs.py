"""validate_spans checks what the request limits do not rule out every step and walks the block ids only in debug
mode; each block id is range-checked once, as it reaches the runner's table (BlockTables)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from engine.attention.block_tables import BlockTables  # noqa: E402
from engine.attention.metadata import build_metadata  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.model_inputs import validate_spans  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_POS = 4, 10, 64
HOSTILE_IDS = [99, NUM_BLOCKS, -1, 2**31, -2**40]


def decode_span(table, start_pos, seq_id=0, version=0):
    return SeqSpan(seq_id, [1], start_pos, table, table_version=version)


def test_block_ids_are_walked_only_in_debug_mode(monkeypatch):
    spans = [decode_span([1, 2, 99], 9)]
    validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=False)
    with pytest.raises(ValueError, match="block id out of range"):
        validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=True)
    monkeypatch.setenv("TGI_HPC_DEBUG_SPANS", "1")
    with pytest.raises(ValueError, match="block id out of range"):
        validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS)
    monkeypatch.setenv("TGI_HPC_DEBUG_SPANS", "0")
    validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS)


@pytest.mark.parametrize("bad", HOSTILE_IDS)
@pytest.mark.parametrize("where", ["first allocation", "tail growth", "rewrite"])
def test_a_bad_block_id_is_caught_as_it_reaches_the_table(bad, where):
    tables = BlockTables(torch.device("cpu"), rows=2, width=2, num_blocks=NUM_BLOCKS)
    table = [1, 2]
    if where != "first allocation":
        tables.gather([decode_span(table, 5)])
    if where == "tail growth":
        table = table + [bad]
    else:
        table = [bad] + table
    version = 1 if where == "rewrite" else 0
    with pytest.raises(ValueError, match=r"sequence 0: block id out of range \[0, 10\)"):
        tables.gather([decode_span(table, len(table) * BLOCK - 1, version=version)])
    # the row is not left half-trusted: once the table is right again, the whole row is rewritten
    good = [3, 4, 5]
    got = tables.gather([decode_span(good, 9, version=version)])
    assert got.tolist() == [good]


def test_decode_slots_come_from_the_kept_rows_as_from_the_lists():
    rng = np.random.default_rng(0)
    tables = BlockTables(torch.device("cpu"), rows=2, width=1, num_blocks=1000)
    lists = {seq: [] for seq in range(6)}
    for step in range(40):      # tables grow at their tails, some sequences sit steps out
        spans = []
        for seq, table in lists.items():
            if rng.random() < 0.3:
                continue
            if not table or rng.random() < 0.3:
                table.append(int(rng.integers(0, 1000)))
            start = int(rng.integers(max(0, (len(table) - 1) * BLOCK), len(table) * BLOCK))
            spans.append(decode_span(table, start, seq_id=seq))
        if not spans:
            continue
        kept = build_metadata(spans, BLOCK, torch.device("cpu"), tables)
        plain = build_metadata(spans, BLOCK, torch.device("cpu"))
        assert torch.equal(kept.slot_mapping, plain.slot_mapping)
        assert kept.slot_mapping.dtype == torch.int64


def test_cheap_checks_hold_in_both_modes():
    for check_all in (False, True):
        with pytest.raises(ValueError, match="cannot hold"):
            validate_spans([decode_span([1, 2], 9)], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=check_all)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            validate_spans([decode_span([1] * 20, 64)], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=check_all)
        with pytest.raises(ValueError, match="empty span"):
            validate_spans([SeqSpan(0, [], 0, [1])], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=check_all)
