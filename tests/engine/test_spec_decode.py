"""N-gram speculative decoding: proposer, acceptance (exact and distribution-preserving), KV rollback, and
engine runs with --speculate equal to runs without, over a KV-reading fake runner (hostile schedules) and the
real tiny models and SmolLM2 (greedy token for token, sampling by a chi-square test, TP=2)."""
import random
import re
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import fakes  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from engine.spec_decode import acceptance  # noqa: E402
from engine.spec_decode.acceptance import accept_greedy, accept_sampled  # noqa: E402
from engine.spec_decode.ngram import NgramProposer  # noqa: E402
from fakes import FakeModelConfig, FakeRunner, test_model_path  # noqa: E402

VOCAB = 1024
_ids = iter(range(10**6))


def make_seq(tokens, max_new=16, **params):
    return Sequence(next(_ids), "r", list(tokens), SamplingParams(max_new_tokens=max_new, **params),
                    max_tokens=len(tokens) + max_new)


# --- proposer ------------------------------------------------------------------------------------

def reference_proposal(tokens, max_ngram, max_tokens):
    """Brute force: the longest suffix (<= max_ngram) with an earlier occurrence, its most recent one."""
    length = len(tokens)
    for n in range(min(max_ngram, length), 0, -1):
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[length - n:]:
                return tokens[start + n:start + n + max_tokens]
    return []


def test_proposer_prefers_the_longest_match_and_its_most_recent_occurrence():
    propose = NgramProposer(max_ngram=3).propose
    # "3" alone last occurred before 8, but "1 2 3" occurred before 9
    assert propose(make_seq([5, 1, 2, 3, 9, 7, 3, 8, 1, 2, 3]), 3) == [9, 7, 3]
    assert propose(make_seq([1, 2, 7, 1, 2, 8, 1, 2]), 5) == [8, 1, 2]     # most recent (1, 2)
    assert propose(make_seq([1, 2, 3, 4, 1, 2]), 2) == [3, 4]
    assert propose(make_seq([4, 5, 6]), 3) == []                          # nothing repeats
    assert propose(make_seq([4, 4]), 3) == [4]                            # the follower run ends at the end
    assert propose(make_seq([1, 2, 1]), 0) == []
    assert propose(make_seq([7]), 3) == []


def test_proposer_grows_its_index_incrementally_like_a_fresh_search():
    rng = random.Random(0)
    for trial in range(200):
        max_ngram, alphabet = rng.randint(1, 4), rng.randint(2, 6)
        proposer = NgramProposer(max_ngram)
        seq = make_seq([rng.randrange(alphabet) for _ in range(rng.randint(1, 8))])
        for _ in range(rng.randint(1, 30)):
            max_tokens = rng.randint(0, 5)
            assert proposer.propose(seq, max_tokens) == reference_proposal(seq.token_ids, max_ngram, max_tokens), \
                (trial, seq.token_ids)
            seq.token_ids += [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]  # several accepted at once


# --- acceptance ----------------------------------------------------------------------------------

def test_greedy_acceptance_keeps_the_matching_prefix_then_the_argmax():
    scores = torch.full((4, 10), -1.0)
    for position, best in enumerate([3, 5, 7, 9]):
        scores[position, best] = 1.0
    assert accept_greedy(scores, [3, 5, 7]) == [3, 5, 7, 9]                # all accepted + bonus
    assert accept_greedy(scores, [3, 4, 7]) == [3, 5]                      # corrected at the first miss
    assert accept_greedy(scores, [0, 5, 7]) == [3]
    assert accept_greedy(scores[:1], []) == [3]


def chi_square_p(counts_a, counts_b, min_expected=5):
    """Two-sample chi-square (a contingency table of 2 rows): the p-value that both come from one
    distribution. Categories too rare for the test are pooled."""
    keys = sorted(set(counts_a) | set(counts_b))
    total_a, total_b = sum(counts_a.values()), sum(counts_b.values())
    rows, pooled = [], [0, 0]
    for key in keys:
        a, b = counts_a.get(key, 0), counts_b.get(key, 0)
        if (a + b) * min(total_a, total_b) / (total_a + total_b) < min_expected:
            pooled[0], pooled[1] = pooled[0] + a, pooled[1] + b
        else:
            rows.append((a, b))
    if sum(pooled):
        rows.append(tuple(pooled))
    if len(rows) < 2:
        return 1.0
    stat = 0.0
    for a, b in rows:
        for observed, total in ((a, total_a), (b, total_b)):
            expected = (a + b) * total / (total_a + total_b)
            stat += (observed - expected) ** 2 / expected
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(logprobs, draft, num_draws, seed):
    generator = torch.Generator().manual_seed(seed)
    first, second = {}, {}
    for _ in range(num_draws):
        tokens = accept_sampled(logprobs, draft, lambda: float(torch.rand((), dtype=torch.float64,
                                                                         generator=generator)))
        first[tokens[0]] = first.get(tokens[0], 0) + 1
        if len(tokens) > 1:  # the second position only exists after the first draft was accepted
            second[tokens[1]] = second.get(tokens[1], 0) + 1
    return first, second


def direct_counts(probs, num_draws, seed):
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.multinomial(probs, num_draws, replacement=True, generator=generator).tolist()
    return {t: drawn.count(t) for t in set(drawn)}


TARGET = torch.tensor([[0.05, 0.30, 0.10, 0.40, 0.15, 0.0],      # position 0: the draft (3) is likely
                       [0.20, 0.0, 0.25, 0.05, 0.10, 0.40]])     # position 1 (bonus): the draft (1) is impossible


def test_rejection_sampling_preserves_the_target_distribution():
    logprobs = TARGET.log()
    first, second = sample_counts(logprobs[:1].repeat(2, 1).index_copy(0, torch.tensor([1]), logprobs[1:]),
                                  [3], 20_000, seed=1)
    assert chi_square_p(first, direct_counts(TARGET[0], 20_000, seed=2)) > 1e-3
    assert chi_square_p(second, direct_counts(TARGET[1], 20_000, seed=3)) > 1e-3
    assert set(first) <= {0, 1, 2, 3, 4}                                  # zero probability is never drawn
    # a draft the target cannot produce is always rejected, and the residual is the target itself
    first, _ = sample_counts(TARGET[1:].log().repeat(2, 1), [1], 20_000, seed=4)
    assert 1 not in first and chi_square_p(first, direct_counts(TARGET[1], 20_000, seed=5)) > 1e-3


def test_the_chi_square_check_catches_a_biased_acceptance(monkeypatch):
    # on reject, drawing from p itself (x not removed) over-produces the draft: the test must notice
    monkeypatch.setattr(acceptance, "_residual", lambda probs, rejected: probs)
    first, _ = sample_counts(TARGET[:1].log().repeat(2, 1), [3], 20_000, seed=1)
    assert chi_square_p(first, direct_counts(TARGET[0], 20_000, seed=2)) < 1e-6


def test_certain_and_impossible_drafts():
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]).log()
    draws = iter([0.999999, 0.5])
    assert accept_sampled(certain, [1], lambda: next(draws)) == [1, 2]
    assert accept_sampled(certain, [0], lambda: 0.0) == [1]               # p(x) = 0: rejected even by u = 0


# --- block manager and scheduler rollback -----------------------------------------------------------

def test_truncate_gives_back_the_rejected_tail_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(6))
    bm.allocate(seq, 6 + 7)                                              # the real token and 6 drafts
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    tail = seq.block_table[2:]
    bm.truncate(seq, 8)                                                  # exactly two blocks full
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert all(block in bm.free_uncached for block in tail)     # reused first: no prefix can hit them
    bm.truncate(seq, 8)                                                  # nothing more to give back
    assert len(seq.block_table) == 2


def make_scheduler(proposal, num_blocks=64, block_size=4, budget=64, speculate=3):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, budget, num_speculative_tokens=speculate, propose=lambda seq, room: list(proposal))


def decode_ready(sched, *seqs):
    """Prefill `seqs` in one step and give each its first token, as the engine would."""
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    sched.on_run_done(batch)
    for seq in seqs:
        seq.append_token(99)
    return seqs[0] if len(seqs) == 1 else seqs


def test_drafts_never_pass_max_tokens_even_when_the_proposer_offers_more():
    sched = make_scheduler(proposal=range(100, 200), budget=64)
    seq = decode_ready(sched, make_seq(range(5), max_new=4))          # 1 generated, room for 3 more
    batch = sched.schedule()
    assert seq.draft_token_ids == [100, 101] and batch.num_draft_tokens == 2   # all accepted + bonus = 4
    (span,) = batch.spans
    assert span.token_ids == [99, 100, 101] and span.start_pos == 5 and span.logits == "all"
    assert span.start_pos + len(span.token_ids) <= seq.max_tokens - 1


def test_drafts_take_prefill_budget_and_grammar_rows_draft_too():
    sched = make_scheduler(proposal=range(100, 200), budget=8)
    a = decode_ready(sched, make_seq(range(5), max_new=20))
    b = make_seq(range(50, 60))
    sched.add(b)
    batch = sched.schedule()
    assert a.draft_token_ids == [100, 101, 102]
    assert [len(span.token_ids) for span in batch.spans] == [4, 5]      # b's prefill chunk gets 8 - 3
    sched = make_scheduler(proposal=range(100, 200))
    seq = decode_ready(sched, make_seq(range(5), max_new=20))
    seq.grammar = object()     # verified under the grammar's masks (test_grammar_rows_take_drafts_...)
    assert sched.schedule().num_draft_tokens == 3 and seq.draft_token_ids == [100, 101, 102]


def test_drafts_never_take_blocks_a_later_decode_needs():
    # two sequences exactly filling their blocks: the first must not draft into the last free block
    sched = make_scheduler(proposal=[7, 7, 7], num_blocks=5, block_size=4)
    a, b = decode_ready(sched, make_seq(range(7), max_new=20), make_seq(range(50, 57), max_new=20))
    assert sched.block_manager.num_free_blocks == 1
    batch = sched.schedule()
    assert a.draft_token_ids == [] and b.draft_token_ids == [7, 7, 7]   # the last decode may take it
    assert sched.num_preempted_total == 0 and len(batch.spans) == 2


def test_commit_rolls_back_rejected_kv_and_registers_only_accepted_blocks():
    sched = make_scheduler(proposal=[11, 12, 13, 14, 15, 16], speculate=6)
    bm = sched.block_manager
    seq = decode_ready(sched, make_seq(range(6), max_new=20))           # 7 tokens, 6 computed
    sched.schedule()                                                    # span: 99 + 6 drafts at 6..12
    assert len(seq.block_table) == 4
    sched.on_run_done(SimpleNamespace(seqs=[seq], spans=[SimpleNamespace(token_ids=[99] + list(range(11, 17)))]))
    assert seq.num_computed_tokens == 7                                  # only the real token
    seq.token_ids += [11, 42]                                            # one draft accepted, then a correction
    sched.commit_draft(seq, 1)
    assert seq.num_computed_tokens == 8 and seq.num_tokens == 9 and seq.draft_token_ids == []
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 64 - 3   # blocks of rejected drafts freed
    registered = {block: bm.block_token_ids[block] for block in seq.block_table if bm.block_hash[block] is not None}
    assert registered == {seq.block_table[0]: (0, 1, 2, 3), seq.block_table[1]: (4, 5, 99, 11)}


def test_decode_graphs_never_replay_a_drafted_step():
    graphs = SimpleNamespace(max_batch_size=8, max_blocks=16)
    decode = SimpleNamespace(token_ids=[5], logits="last", block_table=[1])
    drafted = SimpleNamespace(token_ids=[5, 6, 7], logits="all", block_table=[1])
    assert DecodeGraphs.can_run(graphs, [decode, decode])
    assert not DecodeGraphs.can_run(graphs, [decode, drafted])


# --- engine over the KV-reading fake runner ---------------------------------------------------------

_random_logits = fakes.fake_logits


def copying_logits(context, vocab_size):
    """An "induction head": mostly predicts what followed the last token's previous occurrence, so
    drafts are often but not always right; otherwise the fake's pseudo-random logits, mostly over 20 tokens."""
    logits = _random_logits(context, vocab_size)
    logits[10:30] += 8.0                    # a small working vocabulary, so that tokens come back
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last:
            if hash((len(context), last)) % 5:
                logits[context[i + 1]] += 20.0
            break
    return logits


def reference_greedy(prompt, max_new_tokens, eos_token_ids=frozenset()):
    context = list(prompt)
    for _ in range(max_new_tokens):
        token = int(copying_logits(context, VOCAB).argmax())
        context.append(token)
        if token in eos_token_ids:
            break
    return context[len(prompt):]


@pytest.fixture
def copying(monkeypatch):
    monkeypatch.setattr(fakes, "fake_logits", copying_logits)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(test_model_path("tiny-llama"))


def fake_engine(tokenizer, speculate, num_kv_blocks=256, block_size=4, **config):
    runner = FakeRunner(VOCAB, num_kv_blocks, block_size)
    engine = LLMEngine(EngineConfig(speculate=speculate, **config), runner=runner,
                       model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    return engine, runner


def check_prefix_cache(engine, runner):
    """Every registered block holds, in the runner's KV slots, exactly the tokens it is registered with."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    for block, tokens in enumerate(bm.block_token_ids):
        if tokens is not None:
            assert tuple(runner.slots[block * bs:(block + 1) * bs]) == tokens, f"block {block}"


def run_all(engine, runner, requests):
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    streams = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
        check_prefix_cache(engine, runner)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return streams, stats


def summary(outputs):
    final = outputs[-1]
    return ([t.id for o in outputs for t in o.tokens], [t.logprob for o in outputs for t in o.tokens],
            final.generated_text, final.finish_reason, final.stop_text)


def repetitive_prompt(i, length):
    period = 3 + i % 5
    return [(11 * i + j % period) % 900 + 10 for j in range(length)]


def test_greedy_with_drafts_equals_without_under_preemption_and_block_boundaries(tokenizer, copying):
    # 24 requests in 48 blocks of 4 tokens: preemption, block edges at every offset, drafts clipped by room
    # penalties on some rows: each drafted position must count the drafts before it as context
    requests = {f"r{i}": (repetitive_prompt(i, 3 + (i * 7) % 29),
                          SamplingParams(max_new_tokens=1 + (i * 13) % 60, top_n_tokens=i % 3,
                                         repetition_penalty=1.05 if i % 4 == 1 else None,
                                         frequency_penalty=0.3 if i % 4 == 2 else None)) for i in range(24)}
    results = {}
    for speculate in (0, 1, 3, 5):
        engine, runner = fake_engine(tokenizer, speculate, num_kv_blocks=48, max_batch_prefill_tokens=32,
                                     max_total_tokens=96)
        streams, stats = run_all(engine, runner, requests)
        results[speculate] = {rid: summary(outs) for rid, outs in streams.items()}
        if speculate:
            assert stats.num_preempted_total > 0
            assert 0 < stats.num_speculative_accepted_total < stats.num_speculative_proposed_total
            assert any(len(out.tokens) == speculate + 1 for outs in streams.values() for out in outs)
            for outs in streams.values():
                for out in outs:
                    assert out.token_texts is None or "".join(out.token_texts) == out.text
    for rid, (ids, params) in requests.items():
        if params.repetition_penalty is None and params.frequency_penalty is None:
            assert results[0][rid][0] == reference_greedy(ids, params.max_new_tokens)
        for speculate in (1, 3, 5):
            assert results[speculate][rid] == results[0][rid], (speculate, rid)


def test_stop_sequences_eos_and_length_truncate_an_accepted_run(tokenizer, copying):
    ids = repetitive_prompt(0, 20)
    expected = reference_greedy(ids, 30)
    engine, runner = fake_engine(tokenizer, 0)
    full = run_all(engine, runner, {"full": (ids, SamplingParams(max_new_tokens=30, ignore_eos=True))})[0]["full"]
    text = full[-1].generated_text
    requests = {
        # stop strings starting at several offsets: most land inside a run of accepted drafts
        **{f"stop{k}": (ids, SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[text[k:k + 3]]))
           for k in range(2, len(text) - 3, 3) if "\ufffd" not in text[k:k + 3]},
        "eos": (ids, SamplingParams(max_new_tokens=30)),
        **{f"len{n}": (ids, SamplingParams(max_new_tokens=n, ignore_eos=True)) for n in range(1, 12)},
    }
    eos = expected[9]
    results = {}
    for speculate in (0, 4):
        engine, runner = fake_engine(tokenizer, speculate)
        engine.eos_token_ids = {eos}
        streams, stats = run_all(engine, runner, requests)
        results[speculate] = {rid: summary(outs) for rid, outs in streams.items()}
    assert stats.num_speculative_accepted_total > 0
    assert any(len(outs[-1].tokens) > 1 for rid, outs in streams.items() if rid.startswith("stop"))  # mid-run
    assert results[4] == results[0]
    assert results[4]["eos"][3] == "eos_token" and results[4]["eos"][0][-1] == eos
    assert all(results[4][f"len{n}"][0] == expected[:n] for n in range(1, 12))
    stops = [rid for rid in requests if rid.startswith("stop")]
    assert len(stops) >= 8 and all(results[4][rid][3] == "stop_sequence" for rid in stops)


def test_seeded_sampling_with_drafts_is_reproducible_and_batch_independent(tokenizer, copying):
    params = SamplingParams(do_sample=True, seed=5, temperature=0.7, top_k=20, repetition_penalty=1.2,
                            max_new_tokens=25, ignore_eos=True)
    ids = repetitive_prompt(3, 30)
    engine, runner = fake_engine(tokenizer, 3)
    alone = summary(run_all(engine, runner, {"a": (ids, params)})[0]["a"])
    crowd = {"b": (repetitive_prompt(4, 12), SamplingParams(do_sample=True, max_new_tokens=9)), "a": (ids, params),
             "c": (repetitive_prompt(5, 7), SamplingParams(max_new_tokens=14))}
    engine, runner = fake_engine(tokenizer, 3)
    streams, stats = run_all(engine, runner, crowd)
    assert summary(streams["a"]) == alone and stats.num_speculative_accepted_total > 0


# --- real models ------------------------------------------------------------------------------------

def real_engine(name, **config):
    config.setdefault("cpu_kv_cache_bytes", 32 * 1024**2)
    return LLMEngine(EngineConfig(model_id=str(test_model_path(name)), device="cpu", dtype="float32", **config))


CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
TEXTS = [f"Repeat this code, renaming add to plus:\n{CODE}\n", "Hello world", CODE,
         "one two three one two three one two", "x"]


def mixed_requests(tokenizer, count=16, max_new=30):
    """Different lengths, stop sequences, and sampling rows in the mix (indexes 3, 8, 13)."""
    prompts, params = [], []
    for i in range(count):
        prompts.append(tokenizer.encode(TEXTS[i % len(TEXTS)] * (1 + i % 3)))
        if i % 5 == 3:
            params.append(SamplingParams(do_sample=True, seed=i, temperature=0.8, max_new_tokens=12))
        else:
            params.append(SamplingParams(max_new_tokens=6 + (i * 7) % max_new, stop=["\n\n"] if i % 4 == 1 else [],
                                         top_n_tokens=i % 2, repetition_penalty=1.1 if i % 6 == 5 else None))
    return prompts, params


def assert_same(got, expected, label=None):
    """Same tokens, text and ending; logprobs equal up to the batch's float rounding."""
    ids, logprobs, *rest = got
    ids0, logprobs0, *rest0 = expected
    assert ids == ids0 and rest == rest0, label
    assert logprobs == pytest.approx(logprobs0, abs=1e-4), label


def record_head_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(token ids, drafts) of every drafted row HeadDrafter fills from now on (Medusa, EAGLE-3), in order."""
    from engine.spec_decode.head_drafter import HeadDrafter

    seen: list[tuple[list[int], list[int]]] = []
    fill = HeadDrafter.fill

    def recording_fill(self, batch):
        fill(self, batch)
        seen.extend((list(seq.token_ids), list(seq.draft_token_ids)) for seq in batch.seqs if seq.draft_token_ids)
    monkeypatch.setattr(HeadDrafter, "fill", recording_fill)
    return seen


def compare_greedy(name, speculate_config, base_config=None, count=16, max_new=30, require_accepted=True):
    """The spec tests' one comparison: `count` mixed requests at once and the first alone, with and without
    speculation (`speculate_config` adds to speculate=3); every greedy row the same. The engines' stats
    (without, with speculation)."""
    results, stats = {}, {}
    for speculate, config in ((0, base_config or {}), (3, speculate_config)):
        with real_engine(name, speculate=speculate, **config) as engine:
            prompts, params = mixed_requests(engine.tokenizer, count, max_new)
            outs = engine.generate(prompts, params)
            results[speculate] = [summary([o]) for o in outs]
            alone = engine.generate(prompts[:1], params[:1])[0]              # batch 1
            assert_same(summary([alone]), results[speculate][0])
            stats[speculate] = engine.stats()
    for i, p in enumerate(params):
        if not p.do_sample:
            assert_same(results[3][i], results[0][i], i)
    assert stats[3].num_speculative_accepted_total > 0 or not require_accepted
    return stats[0], stats[3]


_LOOP_COUNTS = {}


def loop_sampled_counts(config, num_draws=200, max_new=4):
    """Seeded top-2 samples of tiny-llama after its own greedy loop (likely tokens there to be drafted):
    per generated position, token -> count, and the engine's stats. Without speculation computed once."""
    key = repr(sorted(config.items()))
    if not config and key in _LOOP_COUNTS:
        return _LOOP_COUNTS[key]
    params = [SamplingParams(do_sample=True, seed=seed, temperature=1.0, top_k=2, max_new_tokens=max_new,
                             ignore_eos=True) for seed in range(num_draws)]
    with real_engine("tiny-llama", **config) as engine:
        start = engine.tokenizer.encode("one two three")
        ids = start + [t.id for t in engine.generate([start], SamplingParams(max_new_tokens=24))[0].tokens]
        outs = engine.generate([ids] * num_draws, params)
        stats = engine.stats()
    counts = [{} for _ in range(max_new)]
    for out in outs:
        for position, token in enumerate(out.tokens):
            counts[position][token.id] = counts[position].get(token.id, 0) + 1
    _LOOP_COUNTS[key] = counts, stats
    return counts, stats


def assert_same_distribution(base, drafted, stats):
    """Drafts were both accepted and rejected (both branches of the rule shaped the sample), and each position's
    marginal is the same by chi-square (Bonferroni over the positions)."""
    assert 0.05 < stats.num_speculative_accepted_total / stats.num_speculative_proposed_total < 0.95, stats
    p_values = [chi_square_p(a, b) for a, b in zip(base, drafted)]
    assert min(p_values) > 1e-3 / len(p_values), p_values


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_greedy_on_tiny_models_is_identical_with_speculate_3(name):
    compare_greedy(name, {})


def test_greedy_with_the_triton_backend_is_identical_with_speculate_3():
    # Triton's kernels run interpreted on CPU: a few short requests
    compare_greedy("tiny-mistral", {"attention_backend": "triton"}, {"attention_backend": "triton"}, count=4,
                   max_new=8)


def test_greedy_on_smollm2_is_identical_with_speculate_3():
    compare_greedy("smollm2", {}, max_new=8)


def test_greedy_with_two_shards_is_identical_with_speculate_3():
    compare_greedy("tiny-llama", {"num_shard": 2}, {"num_shard": 1})


def test_sampled_token_distribution_is_the_same_with_speculate_3():
    # same seed stream with and without drafts; each generated position's marginal compared by chi-square
    num_draws = 500
    params = [SamplingParams(do_sample=True, seed=seed, temperature=1.0, top_k=4, repetition_penalty=1.1,
                             max_new_tokens=5, ignore_eos=True) for seed in range(num_draws)]
    counts = {}
    for speculate in (0, 3):
        with real_engine("tiny-llama", speculate=speculate) as engine:
            # the model's own greedy loop as the prompt: its likely tokens are there to be drafted
            start = engine.tokenizer.encode("one two three")
            ids = start + [t.id for t in engine.generate([start], SamplingParams(max_new_tokens=24))[0].tokens]
            outs = engine.generate([ids] * num_draws, params)
            stats = engine.stats()
        counts[speculate] = [{} for _ in range(5)]
        for out in outs:
            for position, token in enumerate(out.tokens):
                counts[speculate][position][token.id] = counts[speculate][position].get(token.id, 0) + 1
    # drafts were both accepted and rejected, so both branches of the rule shaped the sample
    assert 0.1 < stats.num_speculative_accepted_total / stats.num_speculative_proposed_total < 0.9, stats
    p_values = [chi_square_p(counts[0][k], counts[3][k]) for k in range(5)]
    assert min(p_values) > 1e-3 / 5, p_values                            # Bonferroni over the positions


def test_drafted_rows_keep_their_lora_adapter(model_path, tmp_path):
    from lora_adapters import make_adapter
    base = model_path("tiny-llama")
    make_adapter(base, tmp_path / "a1", seed=1)
    results = {}
    for speculate in (0, 3):
        with real_engine("tiny-llama", speculate=speculate, lora_adapters=[("a1", str(tmp_path / "a1"))]) as engine:
            ids = engine.tokenizer.encode(TEXTS[3] * 2)
            outs = engine.generate([ids] * 4, [SamplingParams(max_new_tokens=24, adapter_id=a)
                                               for a in ("a1", None, "a1", None)])
            results[speculate] = [[t.id for t in out.tokens] for out in outs]
            stats = engine.stats()
    assert stats.num_speculative_accepted_total > 0
    assert results[3] == results[0] and results[0][0] != results[0][1]


def test_grammar_rows_take_drafts_verified_under_the_grammar():
    # n-gram drafts from a repetitive prompt: the grammar's masks at every drafted position keep greedy output
    # the same, refuse drafts the grammar does not allow (the digits row drafts words), and sampled rows valid
    from engine.structured.spec import regex_spec
    words, digits = r"(one two three ){1,2}four", r"[0-9]{3}-[0-9]{4}"
    specs = [regex_spec(words, "w"), regex_spec(digits, "d")]
    results, stats = {}, None
    for speculate in (0, 3):
        with real_engine("tiny-llama", speculate=speculate) as engine:
            prompt = engine.tokenizer.encode("one two three one two three one two three one two")
            params = [SamplingParams(max_new_tokens=32, grammar=specs[i % 2], do_sample=i >= 4, seed=i)
                      for i in range(6)]
            outs = engine.generate([prompt] * 6, params)
            results[speculate] = [(o.text, [t.id for t in o.tokens]) for o in outs]
            stats = engine.stats()
    assert results[3][:4] == results[0][:4]                                 # greedy rows
    for i, (text, _) in enumerate(results[3]):
        assert re.fullmatch(words if i % 2 == 0 else digits, text), (i, text)
    assert stats.num_speculative_accepted_total > 0
    assert stats.num_speculative_accepted_total < stats.num_speculative_proposed_total   # the digits rows refuse
