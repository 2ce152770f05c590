"""The sampler's shortcuts give what the general path gives: greedy-only batches, the top-k prefilter
before the top-p sort, the repetition penalty written in place of a row copy."""
import pytest

torch = pytest.importorskip("torch")
import engine.sampler as sampler  # noqa: E402
from engine.sampler import process, report, sample, top_k_mask, top_p_mask  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

VOCAB = 3000


def row(prompt=(1, 2, 3), generated=(), seed=None, **params):
    p = SamplingParams(**params)
    seq = Sequence(0, "r", list(prompt) + list(generated), p, max_tokens=10**6, num_prompt_tokens=len(prompt))
    seq.seed = seed
    return seq


def logits_for(n, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_greedy_only_batch_matches_the_general_path(top_n):
    logits = logits_for(16)
    rows = [row(top_n_tokens=top_n) for _ in range(16)]
    fast = sample(logits, rows)
    general = process(logits, rows)
    slow = report(general.logprobs, general.scores.argmax(dim=-1), [r.params for r in rows])
    assert fast.token_ids == slow.token_ids == logits.argmax(dim=-1).tolist()
    assert fast.logprobs == slow.logprobs
    assert fast.top_token_ids == slow.top_token_ids
    assert fast.top_logprobs == slow.top_logprobs


def test_greedy_rows_without_logprobs_skip_them():
    logits = logits_for(4)
    out = sample(logits, [row(logprobs=False) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert all(lp != lp for lp in out.logprobs)         # nan: nobody asked


@pytest.mark.parametrize("logprobs", [True, False])
def test_all_greedy_hint_reads_no_parameters_and_gives_the_scanned_result(logprobs):
    logits = logits_for(16, seed=3)
    rows = [row(logprobs=logprobs) for _ in range(16)]
    scanned = sample(logits, rows)

    class NoParams:                 # the hint's promise: the rows' parameters are never read
        @property
        def params(self):
            raise AssertionError("read")

    hinted = sample(logits, [NoParams()] * 16, all_greedy=True, any_logprobs=logprobs)
    assert hinted.token_ids == scanned.token_ids
    assert (hinted.logprobs == scanned.logprobs) if logprobs else all(lp != lp for lp in hinted.logprobs)
    assert hinted.top_token_ids == scanned.top_token_ids == [[]] * 16


def test_all_greedy_hint_never_overrides_a_grammar_mask():
    from engine.structured.masks import TokenBitmask
    bits = torch.zeros(2, -(-VOCAB // 32), dtype=torch.int32)
    bits[0, 0], bits[1, 0] = 1 << 5, 1 << 9             # row 0 may only say token 5, row 1 token 9
    out = sample(logits_for(2), [row(), row()], TokenBitmask([0, 1], bits), all_greedy=True)
    assert out.token_ids == [5, 9]


def test_greedy_fast_path_is_not_taken_when_anything_processes_scores():
    logits = logits_for(2)
    logits[0, 7] = 50.0                                  # the argmax, then penalised away
    rows = [row(prompt=(7,), repetition_penalty=1e6), row()]
    out = sample(logits, rows)
    assert out.token_ids[0] != 7


@pytest.mark.parametrize("k,p", [(1, 0.5), (5, 0.9), (50, 0.95), (200, 0.3), (50, 1.0)])
def test_top_p_after_top_k_prefilter_equals_the_full_sort(k, p):
    scores = top_k_mask(logits_for(8, seed=k), torch.tensor([k] * 8), k)
    top_p = torch.tensor([p] * 7 + [1.0])
    full = top_p_mask(scores, top_p)
    kept = int(torch.isfinite(scores).sum(dim=-1).max())
    assert kept == k
    assert torch.equal(torch.isfinite(top_p_mask(scores, top_p, kept)), torch.isfinite(full))
    assert torch.equal(top_p_mask(scores, top_p, kept), full)


def test_top_k_ties_are_counted_before_the_prefilter(monkeypatch):
    # ties with the k-th score all survive top-k: the prefilter must sort them all (sorting only k of
    # them would leave 6 tied tokens that the full sort removes)
    logits = torch.zeros(2, VOCAB)
    logits[:, :3] = torch.tensor([5.0, 4.0, 3.0])
    logits[:, 3:10] = 2.0                                # 7 ties at the 4th place
    rows = [row(do_sample=True, top_k=4, top_p=0.7, seed=s) for s in (1, 2)]
    fast = process(logits, rows).scores
    original = sampler.top_p_mask
    monkeypatch.setattr(sampler, "top_p_mask", lambda scores, top_p, max_kept=None: original(scores, top_p))
    assert torch.equal(fast, process(logits, rows).scores)
    assert torch.isfinite(fast).sum(dim=-1).tolist() == [2, 2]


def test_mixed_batch_draws_the_same_tokens_with_and_without_the_prefilter(monkeypatch):
    def make_rows():
        return [row(do_sample=True, top_k=40, top_p=0.8, temperature=0.7, seed=11 + i) if i % 2 else
                row(top_n_tokens=2) for i in range(12)]

    logits = logits_for(12, seed=3)
    monkeypatch.setattr(sampler.candidate_sampling, "fits", lambda params: False)   # the dense path's prefilter
    with_prefilter = [sample(logits, rows) for rows in [make_rows()]][0]
    original = sampler.top_p_mask
    monkeypatch.setattr(sampler, "top_p_mask", lambda scores, top_p, max_kept=None: original(scores, top_p))
    without = sample(logits, make_rows())
    assert with_prefilter.token_ids == without.token_ids
    assert with_prefilter.logprobs == pytest.approx(without.logprobs, abs=1e-6)


def test_repetition_penalty_matches_the_hf_formula_and_leaves_the_logits_alone():
    logits = logits_for(3, seed=5)
    before = logits.clone()
    history = [[4, 4, 9, 2999], [], [7]]
    rows = [row(prompt=h or (1,), repetition_penalty=1.3) for h in history]
    rows[1] = row(prompt=(1,))                           # no penalty on this row
    scores = sampler.apply_repetition_penalty(logits, rows)
    assert torch.equal(logits, before)
    expected = logits.clone()
    for r, ids in ((0, {4, 9, 2999}), (2, {7})):
        for i in ids:
            v = expected[r, i]
            expected[r, i] = v * 1.3 if v < 0 else v / 1.3
    assert torch.equal(scores, expected)


def test_cpu_greedy_ids_match_torch_argmax_on_ties_nan_and_infinities():
    from engine.sampler import greedy_ids
    scores = logits_for(6)
    scores[0, 10] = scores[0, 20] = 99.0                 # a tie: the first wins
    scores[1, 5] = float("nan")                          # NaN counts as the largest
    scores[1, 7] = float("inf")
    scores[2] = float("-inf")                            # nothing allowed: index 0
    scores[3, -1] = float("inf")
    for view in (scores, scores[1:5], scores.t().contiguous().t()):   # contiguous, a slice, strided
        assert torch.equal(greedy_ids(view), view.argmax(dim=-1))
    assert torch.equal(greedy_ids(scores.double()), scores.double().argmax(dim=-1))


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 8, 100])
def test_greedy_in_chunks_of_rows_gives_torch_values_bit_for_bit(monkeypatch, rows_per_chunk):
    """Without the CPU kernels, greedy rows take the argmax and its log_softmax chunk by chunk (a wide vocabulary
    is read once): the ids and logprobs are torch's on the whole batch, whatever the chunk size, on ties, NaN and
    -inf rows too."""
    monkeypatch.setattr(sampler, "GREEDY_CHUNK", rows_per_chunk * VOCAB)
    monkeypatch.setattr(sampler, "_cpu_kernels", None)  # torch's passes (the kernels: test_cpu_log_softmax.py)
    logits = logits_for(8, seed=3)
    logits[0, 10] = logits[0, 20] = 99.0                 # a tie: the first wins
    logits[4, 5] = float("nan")
    logits[7] = float("-inf")                            # nothing allowed: index 0, logprob nan
    expected_ids = logits.argmax(dim=-1)
    expected = torch.log_softmax(logits, dim=-1).gather(1, expected_ids[:, None]).squeeze(1)
    rows = [row(logprobs=r % 3 != 1) for r in range(8)]  # mixed: the rows without logprobs get them too
    out = sample(logits, rows)
    assert out.token_ids == expected_ids.tolist()
    assert all(a == b or (a != a and b != b) for a, b in zip(out.logprobs, expected.tolist(), strict=True))
    assert out.top_token_ids == [[]] * 8 and out.top_logprobs == [[]] * 8
    none = sample(logits, [row(logprobs=False) for _ in range(8)])
    assert none.token_ids == expected_ids.tolist() and all(lp != lp for lp in none.logprobs)


@pytest.mark.parametrize("kernels", [False, True])
def test_cpu_log_softmax_buffer_gives_its_values_whatever_came_before(monkeypatch, kernels):
    from engine.kernels import cpu_log_softmax
    from engine.sampler import log_softmax
    monkeypatch.setattr(sampler, "_cpu_kernels", cpu_log_softmax if kernels else None)
    reference = cpu_log_softmax.log_softmax if kernels else (lambda x: torch.log_softmax(x, dim=-1))
    big, small = logits_for(8, seed=1), logits_for(3, seed=2)
    for logits in (small, big, small, big[2:5]):          # the buffer grows, then serves smaller shapes
        assert torch.equal(log_softmax(logits), reference(logits))
    first = sample(big, [row(top_n_tokens=2) for _ in range(8)])
    again = sample(big, [row(top_n_tokens=2) for _ in range(8)])
    sample(small, [row(top_n_tokens=2) for _ in range(3)])   # reuses the buffer: earlier outputs are plain lists
    assert first == again


def test_warpers_on_a_mixed_batch_equal_each_row_warped_alone():
    """top-k and top-p run only on the rows that set them (greedy rows skip the topk and the sort): every row of
    a mixed batch gets exactly the scores it gets alone."""
    params = [SamplingParams(), SamplingParams(do_sample=True, top_k=7), SamplingParams(do_sample=True, top_p=0.8),
              SamplingParams(do_sample=True, top_k=50, top_p=0.5), SamplingParams(do_sample=True, temperature=0.7),
              SamplingParams(do_sample=True, top_k=3, temperature=1.5)]
    sampling = [p.do_sample for p in params]
    logits = logits_for(len(params), seed=3)
    batch = sampler.apply_warpers(logits, params, sampling)
    for i, p in enumerate(params):
        alone = sampler.apply_warpers(logits[i:i + 1], [p], [sampling[i]])
        assert torch.equal(batch[i:i + 1], alone), i
    assert torch.equal(batch[0], logits[0])  # the greedy row is untouched
    assert int(torch.isfinite(batch[1]).sum()) == 7 and int(torch.isfinite(batch[5]).sum()) == 3


def test_greedy_rows_beside_sampling_or_penalised_ones_take_the_one_read_argmax(monkeypatch):
    logits = logits_for(6, seed=8)
    logits[0, 11] = 40.0                                  # row 0's argmax, penalised away below
    rows = [row(prompt=(11,), repetition_penalty=1e6), row(), row(do_sample=True, top_k=5, seed=3),
            row(logprobs=False), row(do_sample=True, temperature=0.7, seed=4), row(top_n_tokens=2)]
    calls = []
    original = sampler.greedy_chosen
    monkeypatch.setattr(sampler, "greedy_chosen", lambda s, lp: calls.append(len(s)) or original(s, lp))
    fast = sample(logits, rows)
    assert calls == [3]                                   # rows 0, 1 and 3; row 5 reports alternatives: dense
    general = process(logits, rows)                       # the general path's scores and logprobs
    for r in (0, 1, 3, 5):
        assert fast.token_ids[r] == int(general.scores[r].argmax())
    assert fast.token_ids[0] != 11
    assert [fast.logprobs[r] for r in (0, 1, 3)] == pytest.approx(
        [float(general.logprobs[r, fast.token_ids[r]]) for r in (0, 1, 3)], abs=1e-6)
    assert fast.top_token_ids[5] == general.logprobs[5].topk(2).indices.tolist()
