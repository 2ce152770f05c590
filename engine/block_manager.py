"""BlockManager: paged KV-cache blocks with ref counts and an optional prefix cache of full blocks."""
from __future__ import annotations

from collections import OrderedDict

from engine.sequence import Sequence


class BlockManager:
    """Hands out KV blocks of `block_size` token slots; the API is predicate/action pairs.

    Prefix cache: a full, computed block is registered under a hash chained over every token
    before it, so equal hashes mean equal prefixes (token ids are compared too, against
    collisions). The chain starts from the sequence's LoRA adapter, so adapters never share KV; the block
    holding an image's first token mixes in the image's content hash, so different images never share KV.
    A freed block keeps its hash and stays revivable until it is handed out again.

    Which free block is handed out: first a freed one no prefix can hit (a partial tail, rejected drafts); then,
    while the cache may grow, a never-used one (in id order); then the least recently freed cached one; a never-used
    one last. The cache may grow through its first `eager_blocks` blocks (all by default), and past them by one
    block for each block a request missed because it had been evicted to keep the cache small (a prefix found in
    `evicted`, counted at the request's first admission). `eager_blocks` is for a CPU cache: a never-used block's
    pages are untouched memory that page-faults on first write (on a VM, ~3 s a GiB), so the cache grows past what
    the load needs only when the load shows the room would bring prefix hits (engine/kv_prefault.py).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eager_blocks: int | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.next_unused = 0                                        # blocks [next_unused, num_blocks) never used
        self.free_uncached: OrderedDict[int, None] = OrderedDict()  # freed, no hash: nothing lost by reuse
        self.free_cached: OrderedDict[int, None] = OrderedDict()    # freed with a hash: revivable, oldest first
        self.grow_to = num_blocks if eager_blocks is None else max(0, min(num_blocks, eager_blocks))
        self.evicted: OrderedDict[int, None] = OrderedDict()        # hashes evicted while the cache could grow
        self.hash_to_block_id: dict[int, int] = {}
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        # prompt tokens looked up / found at each sequence's first admission (not recomputes)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached) + self.num_blocks - self.next_unused

    @property
    def num_used_blocks(self) -> int:
        """Blocks handed out at least once: the part of the cache whose memory is touched."""
        return self.next_unused

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_full_blocks):
            prev = hashes[-1] if hashes else seq.adapter_key  # the chain starts at the adapter: none shares KV
            images = seq.images.keys_in(i * bs, (i + 1) * bs) if seq.images is not None else ()  # image content
            hashes.append(hash((prev, *seq.token_ids[i * bs:(i + 1) * bs], *images)))
        return hashes

    def prefix_key(self, seq: Sequence, index: int) -> int:
        """The prefix-cache key of `seq`'s full block `index` (its tokens and every token before them)."""
        return self._block_hashes(seq, index + 1)[index]

    def _cached_block_ids(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or seq.wants_prefill_logprobs:
            return []
        # at least one token must be computed to get logits for the next one
        num_full = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, num_full)
        bs, block_ids = self.block_size, []
        for i in range(num_full):
            block_id = self.hash_to_block_id.get(hashes[i])
            if block_id is None or self.block_token_ids[block_id] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            block_ids.append(block_id)
        return block_ids

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` (a sequence without blocks) that the prefix cache already holds."""
        return len(self._cached_block_ids(seq)) * self.block_size

    # allocate: a sequence without blocks
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        cached = self._cached_block_ids(seq)
        num_revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        num_new = self.num_blocks_for(num_tokens) - len(cached)
        return num_new + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens; cached prefix blocks are shared."""
        assert not seq.block_table, f"seq {seq.seq_id} already has blocks"
        cached = self._cached_block_ids(seq)
        for block_id in cached:
            if self.ref_counts[block_id] == 0:
                del self.free_cached[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(cached)
        seq.block_table_version += 1
        seq.num_computed_tokens = len(cached) * self.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
            if self.enable_prefix_caching and not seq.wants_prefill_logprobs:
                self.num_queried_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += seq.num_computed_tokens
                self._grow_for_evicted(seq, len(cached))
        seq.num_registered_blocks = len(cached)
        self.append(seq, num_tokens)

    # append: grow a sequence that has blocks
    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq` hold `num_tokens` tokens in all. Blocks taken together go in ascending id order: freed
        blocks come back tail first, and blocks that lie one after another in the cache are read as one run by
        the CPU attention kernels (engine/kernels/cpu_attention.py)."""
        taken = [self._take_free_block() for _ in range(self.num_blocks_for(num_tokens) - len(seq.block_table))]
        seq.block_table.extend(sorted(taken) if len(taken) > 1 else taken)

    def take_free_block(self) -> int:
        """One free block, now referenced once (the caller appends it to a sequence's table)."""
        return self._take_free_block()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks `seq` needs no more once it holds `num_tokens` tokens (the KV of
        rejected draft tokens). Their content was never registered in the prefix cache, and the slots
        past num_computed_tokens in the blocks kept are rewritten before anything reads them."""
        keep = self.num_blocks_for(num_tokens)
        assert keep >= seq.num_registered_blocks, f"seq {seq.seq_id}: truncating registered blocks"
        if len(seq.block_table) > keep:
            seq.block_table_version += 1
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] == 0, f"block {block_id} of seq {seq.seq_id} is shared"
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        (self.free_uncached if self.block_hash[block_id] is None else self.free_cached)[block_id] = None

    def _take_free_block(self) -> int:
        if self.free_uncached:
            block_id, _ = self.free_uncached.popitem(last=False)
        elif self.next_unused < self.grow_to or (not self.free_cached and self.next_unused < self.num_blocks):
            block_id = self.next_unused
            self.next_unused += 1
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            old_hash = self.block_hash[block_id]
            if self.hash_to_block_id.get(old_hash) == block_id:
                del self.hash_to_block_id[old_hash]
                if self.next_unused < self.num_blocks:      # the cache could have kept it by growing
                    self.evicted[old_hash] = None
                    if len(self.evicted) > self.num_blocks:
                        self.evicted.popitem(last=False)
            self.block_hash[block_id] = None
            self.block_token_ids[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _grow_for_evicted(self, seq: Sequence, num_hit: int) -> None:
        """Let the cache grow by the blocks of `seq`'s prompt, after its hits, that were evicted to keep it small."""
        if not self.evicted:
            return
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        missed = 0
        for h in hashes[num_hit:]:
            if h not in self.evicted:
                break
            del self.evicted[h]
            missed += 1
        self.grow_to = min(self.num_blocks, max(self.grow_to, self.next_unused) + missed)

    def free(self, seq: Sequence) -> None:
        # tail blocks first, so they are also the first to be reused: prefixes live longer
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self._release(block_id)
        seq.block_table = []
        seq.block_table_version += 1
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def mark_computed(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V are now computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            # the same content computed twice in one step: keep the first copy
            if self.block_hash[block_id] is None and h not in self.hash_to_block_id:
                self.hash_to_block_id[h] = block_id
                self.block_hash[block_id] = h
                self.block_token_ids[block_id] = tuple(seq.token_ids[i * bs:(i + 1) * bs])
        seq.num_registered_blocks = num_full
