"""Scheduler: a request whose next prompt block another running request is computing waits a step and
reads it from the prefix cache instead of computing it again (a shared system prompt, requests that
arrive together)."""
import pytest

pytest.importorskip("torch")

from engine.block_manager import BlockManager  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from test_scheduler import run_step  # noqa: E402  (one engine step without a model)

_ids = iter(range(10**6))


def make_seq(tokens, max_new=3, prefill_logprobs=False):
    params = SamplingParams(max_new_tokens=max_new, prefill_logprobs=prefill_logprobs)
    return Sequence(next(_ids), "r", list(tokens), params, max_tokens=len(tokens) + max_new)


def make_scheduler(budget=64, prefix=True, num_blocks=64):
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=prefix), budget)


def spans(batch):
    return {span.seq_id: (span.start_pos, len(span.token_ids)) for span in batch.spans}


SHARED = list(range(1, 11))  # 10 tokens: blocks of 4 -> two full blocks + 2


def test_identical_prompts_added_together_compute_the_shared_blocks_once():
    sched = make_scheduler()
    a, b, c = make_seq(SHARED), make_seq(SHARED), make_seq(SHARED)
    for seq in (a, b, c):
        sched.add(seq)
    first = run_step(sched)
    assert spans(first) == {a.seq_id: (0, 10)}
    second = run_step(sched)
    # a decodes; b and c find blocks 0-1 cached and compute only the last, partial block
    assert spans(second) == {a.seq_id: (10, 1), b.seq_id: (8, 2), c.seq_id: (8, 2)}
    assert first.num_prefill_tokens + second.num_prefill_tokens == 14  # not 30


def test_different_prompts_are_admitted_in_the_same_step():
    sched = make_scheduler()
    a, b = make_seq(range(1, 11)), make_seq(range(100, 110))
    sched.add(a)
    sched.add(b)
    assert spans(run_step(sched)) == {a.seq_id: (0, 10), b.seq_id: (0, 10)}


def test_a_prompt_sharing_only_the_first_block_waits_for_that_block_only():
    sched = make_scheduler()
    a, b = make_seq(SHARED), make_seq(SHARED[:4] + [50, 51, 52, 53, 54, 55])
    sched.add(a)
    sched.add(b)
    assert spans(run_step(sched)) == {a.seq_id: (0, 10)}
    assert spans(run_step(sched)) == {a.seq_id: (10, 1), b.seq_id: (4, 6)}


def test_without_prefix_caching_nothing_waits():
    sched = make_scheduler(prefix=False)
    a, b = make_seq(SHARED), make_seq(SHARED)
    sched.add(a)
    sched.add(b)
    assert spans(run_step(sched)) == {a.seq_id: (0, 10), b.seq_id: (0, 10)}


def test_prefill_logprobs_requests_never_wait_they_cannot_use_the_cache():
    sched = make_scheduler()
    a, b = make_seq(SHARED), make_seq(SHARED, prefill_logprobs=True)
    sched.add(a)
    sched.add(b)
    assert spans(run_step(sched)) == {a.seq_id: (0, 10), b.seq_id: (0, 10)}


def test_a_follower_waits_block_by_block_behind_a_chunked_leader():
    sched = make_scheduler(budget=4)
    a, b = make_seq(SHARED), make_seq(SHARED)
    sched.add(a)
    sched.add(b)
    assert spans(run_step(sched)) == {a.seq_id: (0, 4)}
    assert spans(run_step(sched)) == {a.seq_id: (4, 4)}   # b would need a's block 1, still in flight
    # blocks 0-1 are cached now; b's last, partial block is its own
    assert spans(run_step(sched)) == {a.seq_id: (8, 2), b.seq_id: (8, 2)}


def test_an_aborted_leader_does_not_block_its_followers():
    sched = make_scheduler(budget=4)
    a, b = make_seq(SHARED), make_seq(SHARED)
    sched.add(a)
    sched.add(b)
    run_step(sched)                       # a computed block 0; b waits for block 1
    sched.finish(a, "aborted")
    assert spans(run_step(sched)) == {b.seq_id: (4, 4)}   # block 0 from the cache, the rest computed


def test_a_preempted_leader_does_not_block_its_followers():
    sched = make_scheduler(budget=4)
    a, b = make_seq(SHARED), make_seq(SHARED)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.running.remove(a)
    sched.preempt(a)                      # back to the front of waiting, its blocks freed (block 0 stays cached)
    batch = run_step(sched)
    assert spans(batch) == {a.seq_id: (4, 4)}   # a is first in line again and reads its block 0 back
    assert b.seq_id not in spans(batch)         # b waits for a's block 1 again


def test_many_identical_requests_all_finish_and_free_every_block():
    sched = make_scheduler(budget=16, num_blocks=40)
    seqs = [make_seq(SHARED * 2, max_new=1 + i % 4) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    prefilled = 0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        prefilled += run_step(sched).num_prefill_tokens
    assert not sched.has_unfinished()
    assert all(s.num_generated_tokens == s.params.max_new_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == 40
    assert prefilled == 20 + 11 * 4   # the 20-token prompt once, then each follower's last, partial block
