"""Scheduler: prefill budget, chunked prefill next to decodes, preemption order, freeing."""
import pytest

pytest.importorskip("torch")

from engine.block_manager import BlockManager  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence, SequenceStatus  # noqa: E402

_ids = iter(range(10**6))


def make_seq(num_prompt, max_new=4, first=1, prefill_logprobs=False):
    params = SamplingParams(max_new_tokens=max_new, prefill_logprobs=prefill_logprobs)
    return Sequence(next(_ids), f"r{first}", list(range(first, first + num_prompt)), params,
                    max_tokens=num_prompt + max_new)


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_batch_size=None, prefix=True, reserve_growth=False):
    """Without the growth reserve by default: these tests set up preemption on purpose."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, budget, max_batch_size, reserve_growth=reserve_growth)


def run_step(sched):
    """One engine step without a model: every sequence that reached its end gets token 7."""
    batch = sched.schedule()
    sched.on_run_done(batch)
    for seq, span in zip(batch.seqs, batch.spans):
        if span.logits != "none" and seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
            if seq.num_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
    return batch


def spans_by_seq(batch):
    return {span.seq_id: (span.start_pos, len(span.token_ids), span.logits) for span in batch.spans}


def test_prefill_budget_chunks_the_waiting_queue_fifo():
    sched = make_scheduler(budget=16)
    a, b, c = make_seq(10, first=1), make_seq(10, first=100), make_seq(10, first=200)
    for seq in (a, b, c):
        sched.add(seq)
    batch = run_step(sched)
    assert spans_by_seq(batch) == {a.seq_id: (0, 10, "last"), b.seq_id: (0, 6, "none")}
    assert batch.num_prefill_tokens == 16
    assert list(sched.waiting) == [c]
    batch = run_step(sched)
    # a decodes outside the budget, b finishes its prompt, c gets the rest of the budget
    assert spans_by_seq(batch) == {a.seq_id: (10, 1, "last"), b.seq_id: (6, 4, "last"),
                                   c.seq_id: (0, 10, "last")}
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 14


def test_long_prompt_is_chunked_while_running_sequences_keep_decoding():
    sched = make_scheduler(budget=8)
    short = make_seq(3, max_new=20, first=1)
    sched.add(short)
    run_step(sched)
    long = make_seq(40, first=100)
    sched.add(long)
    starts = []
    for _ in range(5):
        batch = run_step(sched)
        spans = spans_by_seq(batch)
        assert spans[short.seq_id][1] == 1                 # one decode token every step
        starts.append(spans[long.seq_id][:2])
    assert starts == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]
    assert long.num_generated_tokens == 1 and short.num_generated_tokens == 6


def test_chunk_spans_carry_the_right_tokens_and_block_table():
    sched = make_scheduler(budget=5, block_size=4)
    seq = make_seq(12, first=50)
    sched.add(seq)
    seen = []
    while seq.num_generated_tokens == 0:
        batch = run_step(sched)
        span = batch.spans[0]
        seen += span.token_ids
        assert len(span.block_table) * 4 >= span.start_pos + len(span.token_ids)
    assert seen == list(range(50, 62))


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 6 blocks of 4 slots; three 7-token prompts take 2 blocks each, the fourth must wait
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    seqs = [make_seq(7, max_new=6, first=1 + 100 * i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)
    run_step(sched)                          # 8th tokens still fit in 2 blocks
    assert sched.num_preempted_total == 0 and list(sched.waiting) == [seqs[3]]
    batch = run_step(sched)                  # 9th tokens need a 3rd block each
    assert sched.num_preempted_total == 1
    assert sched.running == seqs[:2]
    assert list(sched.waiting) == [seqs[2], seqs[3]]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    assert seqs[2].num_generated_tokens == 2   # kept across preemption
    assert [span.seq_id for span in batch.spans] == [seqs[0].seq_id, seqs[1].seq_id]


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_seq(7, max_new=8, first=1), make_seq(8, max_new=8, first=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)                          # a: 2 blocks, b: 2 blocks, none free
    batch = run_step(sched)                  # a fits; b's 9th token needs a 3rd block
    assert [span.seq_id for span in batch.spans] == [a.seq_id]
    assert list(sched.waiting) == [b] and sched.num_preempted_total == 1


def test_preempted_sequence_recomputes_and_finishes():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    seqs = [make_seq(7, max_new=6, first=1 + 100 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    recomputed = False
    for _ in range(50):
        if not sched.has_unfinished():
            break
        batch = run_step(sched)
        for span in batch.spans:
            if span.start_pos == 0 and len(span.token_ids) > 7:
                recomputed = True           # prompt + generated tokens run again
    assert not sched.has_unfinished()
    assert recomputed and sched.num_preempted_total > 0
    assert all(s.num_generated_tokens == 6 and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_seq(8, max_new=8, first=1), make_seq(8, max_new=8, first=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    c = make_seq(2, first=300)
    sched.add(c)
    run_step(sched)                          # b is preempted for a's decode block
    assert sched.num_preempted_total == 1
    assert c.status is SequenceStatus.WAITING


def test_finish_frees_blocks_from_running_and_waiting():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=8)
    a, b = make_seq(8, max_new=50, first=1), make_seq(20, max_new=50, first=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    sched.finish(b, "aborted")
    sched.finish(a, "aborted")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8
    assert a.finish_reason == b.finish_reason == "aborted"


def test_abort_mid_prefill_frees_its_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8)
    seq = make_seq(30, first=1)
    sched.add(seq)
    run_step(sched)
    assert seq.num_computed_tokens == 8 and sched.block_manager.num_free_blocks == 14
    sched.finish(seq, "aborted")
    assert sched.block_manager.num_free_blocks == 16


def test_max_batch_size_caps_running():
    sched = make_scheduler(budget=100, max_batch_size=2)
    seqs = [make_seq(3, first=1 + 10 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = run_step(sched)
    assert len(batch) == 2 and list(sched.waiting) == [seqs[2]]


def test_prefill_logprobs_asks_for_all_logits_in_every_chunk():
    sched = make_scheduler(budget=4)
    seq = make_seq(10, prefill_logprobs=True)
    sched.add(seq)
    modes = [run_step(sched).spans[0].logits for _ in range(4)]
    assert modes == ["all", "all", "all", "last"]


def test_prefix_cache_skips_computed_prompt_blocks():
    sched = make_scheduler(budget=64, block_size=4)
    a = make_seq(10, max_new=1, first=1)
    sched.add(a)
    run_step(sched)
    b = make_seq(10, max_new=1, first=1)
    sched.add(b)
    batch = run_step(sched)
    assert spans_by_seq(batch)[b.seq_id] == (8, 2, "last")


def test_all_blocks_free_after_many_mixed_requests():
    sched = make_scheduler(num_blocks=12, block_size=4, budget=10)
    seqs = [make_seq(3 + (i * 7) % 13, max_new=1 + i % 9, first=1 + 50 * i) for i in range(20)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    assert all(s.num_generated_tokens == s.params.max_new_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == 12


def test_schedule_is_cheap_for_a_batch_of_64_decodes():
    import time
    sched = make_scheduler(num_blocks=64 * 40, block_size=16, budget=4096)
    for i in range(64):
        sched.add(make_seq(100, max_new=1000, first=1 + 1000 * i))
    run_step(sched)
    t0 = time.perf_counter()
    for _ in range(100):
        run_step(sched)
    per_step = (time.perf_counter() - t0) / 100
    assert per_step < 2e-3, f"{per_step * 1e3:.2f} ms per step"


def test_admission_waits_for_the_whole_prompt_and_the_running_sequences_growth():
    # 6 blocks of 4: a (7 tokens) takes 2; b's 7 tokens (2 blocks) + a block of growth for a fit in 4;
    # c's would leave no block for a's and b's next tokens, so it waits instead of being preempted later
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, reserve_growth=True)
    a, b, c = (make_seq(7, max_new=6, first=1 + 100 * i) for i in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    run_step(sched)
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    for _ in range(40):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished() and sched.num_preempted_total == 0


def test_a_long_prompt_is_not_admitted_chunk_by_chunk_into_a_full_cache():
    """The first chunk fits but the whole prompt does not: admitting it would only be undone."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=4, reserve_growth=True)
    a = make_seq(4, max_new=12, first=1)
    sched.add(a)
    run_step(sched)
    long = make_seq(24, max_new=2, first=100)
    sched.add(long)
    run_step(sched)
    assert long.status is SequenceStatus.WAITING and long.block_table == []


def computed_tokens_under_pressure(reserve_growth):
    sched = make_scheduler(num_blocks=40, block_size=4, budget=32, reserve_growth=reserve_growth)
    seqs = [make_seq(20, max_new=24, first=1 + 100 * i) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    computed = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        computed += sum(len(span.token_ids) for span in run_step(sched).spans)
    assert not sched.has_unfinished()
    assert all(s.num_generated_tokens == 24 for s in seqs)
    return computed, sched.num_preempted_total


def test_the_growth_reserve_stops_preemption_thrash():
    """12 requests of 20 + 24 tokens in a cache of 160 slots: without the reserve, admissions are
    preempted and recomputed; with it, every token is computed about once."""
    thrash, preempted = computed_tokens_under_pressure(False)
    calm, calm_preempted = computed_tokens_under_pressure(True)
    minimum = 12 * (20 + 24 - 1)
    assert calm_preempted < preempted and calm < thrash
    assert calm <= minimum * 1.2, (calm, minimum)


def test_the_plain_decode_path_schedules_what_the_general_path_does():
    # the same mixed workload (block growth, preemption, prefix hits, prefill logprobs) twice: with the
    # scheduler's decode shortcut and with every sequence through the general path
    def workload(plain):
        sched = make_scheduler(num_blocks=14, block_size=4, budget=10)
        if not plain:
            sched._plain_decode = lambda batch, seq: False
        seqs = [make_seq(3 + (i * 7) % 13, max_new=1 + i % 9, first=1 + 50 * (i % 5), prefill_logprobs=i % 4 == 1)
                for i in range(16)]
        for seq in seqs:
            sched.add(seq)
        steps = []
        while sched.has_unfinished():
            batch = run_step(sched)
            steps.append(([(s.seq_id % 16, tuple(s.token_ids), s.start_pos, tuple(s.block_table), s.logits)
                           for s in batch.spans], batch.num_decode_tokens, batch.num_prefill_tokens,
                          sched.block_manager.num_free_blocks, sched.num_preempted_total))
        return steps

    plain, general = workload(True), workload(False)
    assert plain == general
    assert plain[-1][4] > 0                  # the workload did preempt


def with_image(seq, positions):
    """`seq` with image tokens at `positions` that attend to each other both ways (Gemma 3)."""
    from engine.multimodal.prompt import MultiModalPrompt

    seq.images = MultiModalPrompt({}, list(positions), [(positions[0], 1)], 1, bidirectional=True)
    return seq


def test_image_runs_and_where_a_chunk_may_end():
    from engine.multimodal.prompt import MultiModalPrompt

    images = MultiModalPrompt({}, [3, 4, 5, 9, 10], [(3, 1), (9, 2)], 2, bidirectional=True)
    assert images.runs == [(3, 6), (9, 11)] and images.longest_run == 3
    assert [images.chunk_end(0, end) for end in range(12)] == [0, 1, 2, 3, 3, 3, 6, 7, 8, 9, 9, 11]
    assert images.chunk_end(4, 5) == 4 and images.chunk_end(4, 8) == 8  # a chunk starting inside a cached run
    assert images.runs_in(6, 9) == [] and images.runs_in(5, 10) == [(3, 6), (9, 11)]
    causal = MultiModalPrompt({}, [3, 4, 5], [(3, 1)], 1)
    assert causal.runs == [] and causal.chunk_end(0, 4) == 4
    assert causal.attending_both_ways(3).runs == [(3, 6)]
    with pytest.raises(ValueError, match=r"an image of 3 tokens .* at most 2 tokens \(--max-batch-prefill-tokens\)"):
        causal.attending_both_ways(2)


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways():
    sched = make_scheduler(budget=8)
    a = with_image(make_seq(20, first=1), range(5, 11))
    b = with_image(make_seq(10, first=100), range(2, 6))
    c = with_image(make_seq(4, first=200), range(0, 4))
    for seq in (a, b, c):
        sched.add(seq)
    # each stops before its image: a at 5, b at 2; c's image does not fit the 1 token left, so c waits
    assert spans_by_seq(run_step(sched)) == {a.seq_id: (0, 5, "none"), b.seq_id: (0, 2, "none")}
    assert list(sched.waiting) == [c]
    assert spans_by_seq(run_step(sched)) == {a.seq_id: (5, 8, "none")}  # a's whole image takes the budget
    assert spans_by_seq(run_step(sched)) == {a.seq_id: (13, 7, "last")}  # the token left cannot start an image
    assert spans_by_seq(run_step(sched)) == {a.seq_id: (20, 1, "last"), b.seq_id: (2, 8, "last")}
    assert spans_by_seq(run_step(sched)) == {a.seq_id: (21, 1, "last"), b.seq_id: (10, 1, "last"),
                                             c.seq_id: (0, 4, "last")}


# --- bursts of prompts on CPU (split_bursts) ----------------------------------------------------------------------

def burst_scheduler(split=32, budget=256):
    return Scheduler(BlockManager(256, 4), budget, split_bursts=split)


def test_a_burst_of_prompts_is_prefilled_half_first_then_the_rest():
    sched = burst_scheduler()
    burst = [make_seq(16, first=100 * i + 1) for i in range(5)]   # 80 tokens >= 32: split 3 + 2
    for seq in burst:
        sched.add(seq)
    assert [s.seq_id for s in run_step(sched).seqs] == [s.seq_id for s in burst[:3]]
    late = make_seq(16, first=9001)                                 # arrives meanwhile: goes with the second half
    sched.add(late)
    second = run_step(sched)
    assert [s.seq_id for s in second.seqs if s in burst[3:] + [late]] == [s.seq_id for s in burst[3:] + [late]]
    assert all(seq.num_computed_tokens >= 16 for seq in burst + [late])    # every prompt computed in two steps


def test_what_a_split_does_not_pay_for_is_admitted_at_once():
    small = burst_scheduler(split=64)
    for i in range(3):                                              # 48 tokens < 64: one step
        small.add(make_seq(16, first=100 * i + 1))
    assert len(run_step(small).seqs) == 3
    one = burst_scheduler(split=8)
    one.add(make_seq(200, first=1))                                 # a single prompt is never split
    assert len(run_step(one).seqs) == 1 and one.running[0].num_computed_tokens == 200
    off = Scheduler(BlockManager(256, 4), 256)                      # GPU: no split
    for i in range(4):
        off.add(make_seq(16, first=100 * i + 1))
    assert len(run_step(off).seqs) == 4


def test_a_queue_the_budget_spreads_over_steps_is_not_split_again():
    sched = burst_scheduler(split=32, budget=40)
    burst = [make_seq(16, first=100 * i + 1) for i in range(6)]    # 96 tokens > 40: the budget takes 3 a step
    for seq in burst:
        sched.add(seq)
    assert [s.seq_id for s in run_step(sched).seqs] == [s.seq_id for s in burst[:3]]
