"""BlockManager: allocation, ref counts, prefix-cache hits, revival of freed blocks, eviction."""
import pytest

pytest.importorskip("torch")

from engine.block_manager import BlockManager  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

_ids = iter(range(10**6))


def make_seq(tokens, prefill_logprobs=False):
    return Sequence(next(_ids), "r", list(tokens), SamplingParams(prefill_logprobs=prefill_logprobs),
                    max_tokens=len(tokens) + 16)


def compute(bm, seq, num_tokens=None):
    """What the scheduler does around a model step: blocks, then mark the tokens computed."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    if seq.block_table:
        bm.append(seq, num_tokens)
    else:
        bm.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.mark_computed(seq)


def test_allocate_append_free_counts_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.append(seq, 12)                       # still fits in block 3
    assert bm.num_free_blocks == 5
    bm.append(seq, 13)
    assert bm.num_free_blocks == 4 and len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_predicates_refuse_what_does_not_fit():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(100, 112))
    bm.allocate(a, 12)
    b = make_seq(range(200, 206))
    assert not bm.can_allocate(b, 6)
    assert bm.can_allocate(b, 4)
    assert bm.can_append(a, 16) and not bm.can_append(a, 17)


def test_prefix_cache_shares_full_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(1, 11))               # 10 tokens: 2 full blocks
    compute(bm, a)
    b = make_seq(list(range(1, 9)) + [50, 51, 52])
    assert bm.num_cached_tokens(b) == 8
    free_before = bm.num_free_blocks
    bm.allocate(b, b.num_tokens)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.num_free_blocks == free_before - 1   # only the third block is new
    # a prompt made only of cached full blocks still recomputes its last token
    c = make_seq(range(1, 9))
    assert bm.num_cached_tokens(c) == 4


def test_shared_blocks_stay_until_last_owner_frees_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(1, 10))
    compute(bm, a)
    b = make_seq(range(1, 10))
    bm.allocate(b, 9)
    bm.free(a)
    assert bm.num_free_blocks == 8 - 3       # b still holds 2 shared + 1 own
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_freed_block_is_revived_by_a_later_request():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(1, 10))
    compute(bm, a)
    first_block = a.block_table[0]
    bm.free(a)
    b = make_seq(range(1, 10))
    assert bm.num_cached_tokens(b) == 8
    bm.allocate(b, 9)
    assert b.block_table[0] == first_block
    assert bm.num_free_blocks == 8 - 3


def test_reused_block_loses_its_cache_entry():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(1, 10))
    compute(bm, a)
    bm.free(a)
    other = make_seq(range(500, 512))        # needs all 3 blocks: evicts a's cached ones
    bm.allocate(other, 12)
    bm.free(other)
    assert bm.num_cached_tokens(make_seq(range(1, 10))) == 0


def test_collision_guard_compares_token_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(1, 10))
    compute(bm, a)
    # forge b's first block hash to equal a's: the token comparison must still refuse the hit
    b = make_seq([9, 9, 9, 9, 9, 9, 9, 9, 9])
    b.block_hashes = list(a.block_hashes[:2])
    assert bm.num_cached_tokens(b) == 0


def test_prefill_logprobs_request_bypasses_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, make_seq(range(1, 10)))
    assert bm.num_cached_tokens(make_seq(range(1, 10), prefill_logprobs=True)) == 0


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute(bm, make_seq(range(1, 10)))
    assert bm.num_cached_tokens(make_seq(range(1, 10))) == 0


def test_can_allocate_counts_revived_blocks_against_free_ones():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(1, 10))
    compute(bm, a)
    bm.free(a)                               # 3 free, 2 of them cached
    b = make_seq(list(range(1, 9)) + list(range(40, 48)))   # 2 cached + 2 new blocks = 4 > 3
    assert not bm.can_allocate(b, b.num_tokens)
    assert bm.can_allocate(b, 12)


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(5))
    bm.allocate(a, 5)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_image_hashes_key_the_block_of_an_images_first_token_and_every_later_one():
    from engine.multimodal.prompt import MultiModalPrompt

    tokens = list(range(100, 148))  # 3 blocks of 16; an image's tokens at 20..27

    def with_image(key):
        seq = make_seq(tokens)
        seq.images = MultiModalPrompt({}, list(range(20, 28)), [(20, key)], 1)
        return seq

    bm = BlockManager(num_blocks=16, block_size=16)
    plain, cat, cat_again, dog = make_seq(tokens), with_image(7), with_image(7), with_image(8)
    keys = {name: [bm.prefix_key(seq, i) for i in range(3)]
            for name, seq in [("plain", plain), ("cat", cat), ("cat_again", cat_again), ("dog", dog)]}
    assert keys["cat"] == keys["cat_again"]
    assert keys["cat"][0] == keys["dog"][0] == keys["plain"][0]  # block 0 holds no image token
    assert all(keys["cat"][i] != keys["dog"][i] != keys["plain"][i] for i in (1, 2))
    compute(bm, cat)
    assert bm.num_cached_tokens(cat_again) == 32 and bm.num_cached_tokens(dog) == 16


# --- which free block is handed out -------------------------------------------------------------------------------

def test_a_freed_block_no_prefix_can_hit_is_reused_before_any_other():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(1, 11))               # 2 full blocks (cached) + a partial tail (not)
    compute(bm, a)
    tail = a.block_table[2]
    bm.free(a)
    b = make_seq(range(50, 53))
    bm.allocate(b, 3)
    assert b.block_table == [tail]
    assert bm.num_cached_tokens(make_seq(range(1, 11))) == 8     # a's prefix is intact


def test_by_default_the_cache_grows_into_never_used_blocks_before_evicting_a_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(1, 9))
    compute(bm, a)
    bm.free(a)
    b = make_seq(range(50, 58))
    compute(bm, b)
    assert set(b.block_table).isdisjoint(a.block_table) and bm.num_used_blocks == 4
    assert bm.num_cached_tokens(make_seq(range(1, 9))) == 4


def test_past_its_eager_blocks_the_cache_reuses_freed_blocks_oldest_first_and_stays_small():
    bm = BlockManager(num_blocks=64, block_size=4, eager_blocks=4)
    for start in range(0, 400, 8):           # 50 different prompts, one at a time, 2 blocks each
        seq = make_seq(range(start + 1, start + 9))
        compute(bm, seq)
        bm.free(seq)
        assert bm.num_used_blocks <= 4
    assert bm.num_free_blocks == 64
    held = [make_seq(range(1000 + 8 * i, 1008 + 8 * i)) for i in range(5)]   # the load needs 10 blocks: it grows
    for seq in held:
        compute(bm, seq)
    assert bm.num_used_blocks == 10 and bm.num_free_blocks == 54


def test_a_prefix_evicted_to_keep_the_cache_small_lets_it_grow_by_what_was_missed():
    bm = BlockManager(num_blocks=64, block_size=4, eager_blocks=2)
    system = list(range(1, 13))              # 3 full blocks a later request shares
    first = make_seq(system + [90])
    compute(bm, first)
    bm.free(first)
    other = make_seq(range(500, 513))        # evicts the shared blocks (nothing left to grow through)
    compute(bm, other)
    bm.free(other)
    assert bm.num_used_blocks == 4
    again = make_seq(system + [91])
    assert bm.num_cached_tokens(again) == 0
    compute(bm, again)                       # missed 3 evicted blocks: the cache may grow by 3
    bm.free(again)
    later = make_seq(range(700, 713))
    compute(bm, later)
    assert bm.num_used_blocks == 4 + 3
    assert bm.num_cached_tokens(make_seq(system + [92])) == 12   # the prefix was kept this time


def test_a_full_cache_takes_never_used_blocks_past_its_eager_ones():
    bm = BlockManager(num_blocks=6, block_size=4, eager_blocks=1)
    a = make_seq(range(1, 25))
    assert bm.can_allocate(a, 24)
    compute(bm, a)
    assert sorted(a.block_table) == list(range(6)) and bm.num_free_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 6


def test_blocks_reused_together_lie_in_ascending_order_as_they_were_handed_out():
    bm = BlockManager(num_blocks=64, block_size=4, eager_blocks=8)
    a = make_seq(range(1, 33))               # 8 blocks, never used before: 0..7
    compute(bm, a)
    assert a.block_table == list(range(8))
    bm.free(a)                               # back tail first: 7, 6, ..., 0
    b = make_seq(range(100, 132))
    compute(bm, b)
    assert b.block_table == list(range(8))   # the same blocks, one run in the cache again
