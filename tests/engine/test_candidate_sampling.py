"""Sampling rows among their candidates gives the dense path's tokens and logprobs, row by row, and hands back
the rows it cannot settle (ties past the list, a flat nucleus)."""
import pytest

torch = pytest.importorskip("torch")
import engine.candidate_sampling as candidates  # noqa: E402
from engine.candidate_sampling import draw  # noqa: E402
from engine.sampler import sample  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from engine.structured.masks import TokenBitmask  # noqa: E402

VOCAB = 6000     # wider than the second list (4,096), so a flat nucleus reaches the dense path


def row(prompt=(1, 2, 3), seed=None, **params):
    p = SamplingParams(**params)
    seq = Sequence(0, "r", list(prompt), p, max_tokens=10**6, num_prompt_tokens=len(prompt))
    seq.seed = seed
    return seq


def peaked(n, seed=0, spread=1.0):
    """A language model's shape: a few likely tokens over a long tail (Zipf scores plus noise), shuffled."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float32)
    rows = [(-2.5 * ranks.log() + spread * torch.randn(VOCAB, generator=g))[torch.randperm(VOCAB, generator=g)]
            for _ in range(n)]
    return torch.stack(rows)


def flat(n, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.1


def run(logits, make_rows, steps, dense=False, monkeypatch=None):
    if dense:
        monkeypatch.setattr(candidates, "fits", lambda params: False)
    rows = make_rows()
    outs = [sample(logits, rows) for _ in range(steps)]
    if dense:
        monkeypatch.undo()
    return [o.token_ids for o in outs], [o.logprobs for o in outs], [o.top_token_ids for o in outs]


CASES = [
    dict(top_k=40),
    dict(top_p=0.9),
    dict(top_k=40, top_p=0.8, temperature=0.7),
    dict(top_p=0.95, temperature=1.3),
    dict(top_k=1),
    dict(top_p=1e-6),
    dict(top_k=VOCAB + 10),                       # wider than the vocabulary: the whole row is the list
    dict(top_p=0.9, repetition_penalty=1.3),
    dict(top_k=20, frequency_penalty=0.5, temperature=0.5),
]


@pytest.mark.parametrize("params", CASES, ids=[str(c) for c in CASES])
def test_candidates_draw_the_dense_paths_tokens_and_logprobs(params, monkeypatch):
    logits = peaked(6, seed=len(str(params)))

    def make_rows():
        return [row(prompt=(5, 9, 5), seed=100 + i, do_sample=True, **params) for i in range(6)]

    fast_ids, fast_lps, _ = run(logits, make_rows, 25)
    slow_ids, slow_lps, _ = run(logits, make_rows, 25, dense=True, monkeypatch=monkeypatch)
    assert fast_ids == slow_ids
    for a, b in zip(fast_lps, slow_lps):
        assert a == pytest.approx(b, abs=1e-5)
    assert len({tuple(ids) for ids in fast_ids}) > 1 or params.get("top_k") == 1 or params.get("top_p") == 1e-6


def test_a_batch_of_settled_dense_and_greedy_rows_keeps_each_rows_result(monkeypatch):
    logits = torch.cat([peaked(2, seed=1), flat(2, seed=2), peaked(3, seed=3)])

    def make_rows():
        return [row(seed=1, do_sample=True, top_p=0.9), row(seed=2, top_k=30, temperature=0.8),
                row(seed=3, do_sample=True, top_p=0.9),            # flat: no list holds its nucleus
                row(seed=4, do_sample=True, top_p=0.5, top_k=4000),
                row(top_n_tokens=3),                               # greedy, with alternatives
                row(seed=6, do_sample=True, typical_p=0.9),        # typical-p stays dense
                row(prompt=(7,), repetition_penalty=2.0)]          # greedy, penalised

    assert draw(logits[2:3], [SamplingParams(top_p=0.9)], [0.5]).dense == [0]   # row 2 takes the dense path
    fast = run(logits, make_rows, 12)
    slow = run(logits, make_rows, 12, dense=True, monkeypatch=monkeypatch)
    assert fast[0] == slow[0]
    assert fast[2] == slow[2]
    for a, b in zip(fast[1], slow[1]):
        assert a == pytest.approx(b, abs=1e-5)
    assert all(out[4] == int(logits[4].argmax()) for out in fast[0])


def test_rows_the_lists_cannot_settle_are_handed_back():
    nucleus = torch.cat([peaked(1, seed=4, spread=0.0), flat(1, seed=5)])
    drawn = draw(nucleus, [SamplingParams(top_p=0.5), SamplingParams(top_p=0.9)], [0.5] * 2, lists=(16, 64))
    assert (drawn.rows, drawn.dense) == ([0], [1])      # a peaked nucleus settles, a flat one goes dense
    ties = torch.zeros(2, VOCAB)
    ties[:, :3] = torch.tensor([5.0, 4.0, 3.0])
    ties[0, 3:10] = 2.0                     # top-k 4: seven ties at the 4th place, past the list of 5
    drawn = draw(ties, [SamplingParams(top_k=4), SamplingParams(top_k=3)], [0.5] * 2)
    assert (drawn.rows, drawn.dense) == ([1], [0])
    assert drawn.token_ids[0] in (0, 1, 2)
    ties[1] = peaked(1, seed=7)[0]
    wider = draw(ties, [SamplingParams(top_k=4), SamplingParams(top_k=10)], [0.5] * 2)  # a list of 11 holds them
    assert (wider.rows, wider.dense) == ([0, 1], [])


def test_a_second_list_settles_a_nucleus_the_first_does_not_hold():
    scores = peaked(1, seed=8, spread=0.5)
    params = [SamplingParams(top_p=0.99)]
    assert draw(scores, params, [0.3], lists=(8,)).dense == [0]
    assert draw(scores, params, [0.3], lists=(8, VOCAB // 2)).rows == [0]


def test_a_grammar_allowing_fewer_tokens_than_top_k_stays_on_the_list():
    logits = peaked(2, seed=9)
    allowed = [11, 500, 4321]
    words = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[:, t // 32] |= 1 << (t % 32)
    mask = TokenBitmask([0, 1], words.to(torch.int32))
    rows = [row(seed=s, do_sample=True, top_k=50) for s in (1, 2)]
    scores = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).index_fill(1, torch.tensor(allowed), False),
                                float("-inf"))
    assert draw(scores, [r.params for r in rows], [0.1, 0.9]).dense == []
    for _ in range(10):
        out = sample(logits, rows, mask)
        assert set(out.token_ids) <= set(allowed)
        assert all(lp <= 0.0 for lp in out.logprobs)


def test_a_tiny_top_p_keeps_the_best_token_and_its_logprob_is_zero():
    logits = flat(3, seed=10)
    out = sample(logits, [row(seed=s, do_sample=True, top_p=1e-9) for s in range(3)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("params", [dict(top_k=40, top_p=0.8), dict(top_p=0.9, temperature=0.8)])
def test_a_rows_tokens_and_logprobs_do_not_depend_on_a_wider_row_beside_it(params):
    logits = peaked(2, seed=11)

    def alone():
        r = row(seed=5, do_sample=True, **params)
        return [sample(logits[:1], [r]) for _ in range(30)]

    def beside_a_wider_row():          # the other row's top-k lengthens the list the first row is drawn from
        rows = [row(seed=5, do_sample=True, **params), row(seed=6, do_sample=True, top_k=3000)]
        return [sample(logits, rows) for _ in range(30)]

    a, b = alone(), beside_a_wider_row()
    assert [o.token_ids[0] for o in a] == [o.token_ids[0] for o in b]
    assert [o.logprobs[0] for o in a] == [o.logprobs[0] for o in b]     # the same bits
