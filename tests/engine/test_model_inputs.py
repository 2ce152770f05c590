"""validate_spans: the blocks a step writes are always checked, the whole tables only in debug mode."""
import pytest

pytest.importorskip("torch")
from engine.batch import SeqSpan  # noqa: E402
from engine.model_inputs import validate_spans  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_POS = 4, 10, 64


def decode_span(table, start_pos):
    return SeqSpan(0, [1], start_pos, table)


def test_a_bad_block_under_the_new_token_is_always_caught():
    with pytest.raises(ValueError, match="block id out of range"):
        validate_spans([decode_span([1, 2, 99], 9)], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=False)


def test_a_prefill_span_checks_every_block_it_writes():
    span = SeqSpan(0, list(range(12)), 0, [1, -1, 2])
    with pytest.raises(ValueError, match="block id out of range"):
        validate_spans([span], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=False)


def test_old_blocks_are_walked_only_in_debug_mode(monkeypatch):
    spans = [decode_span([99, 2, 3], 9)]   # block 0 was written (and checked) steps ago
    validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=False)
    with pytest.raises(ValueError, match="block id out of range"):
        validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=True)
    monkeypatch.setenv("TGI_HPC_DEBUG_SPANS", "1")
    with pytest.raises(ValueError, match="block id out of range"):
        validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS)
    monkeypatch.setenv("TGI_HPC_DEBUG_SPANS", "0")
    validate_spans(spans, BLOCK, NUM_BLOCKS, MAX_POS)


def test_cheap_checks_hold_in_both_modes():
    for check_all in (False, True):
        with pytest.raises(ValueError, match="cannot hold"):
            validate_spans([decode_span([1, 2], 9)], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=check_all)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            validate_spans([decode_span([1] * 20, 64)], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=check_all)
        with pytest.raises(ValueError, match="empty span"):
            validate_spans([SeqSpan(0, [], 0, [1])], BLOCK, NUM_BLOCKS, MAX_POS, check_all_blocks=check_all)
