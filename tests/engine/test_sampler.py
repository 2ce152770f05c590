"""Sampler: greedy, warper masks against transformers' processors, penalties, seeds, logprobs."""
import math

import pytest

torch = pytest.importorskip("torch")

from transformers.generation.logits_process import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from engine.sampler import (is_sampling, pick_on_device, pick_seed, sample, top_k_mask,  # noqa: E402
                            top_p_mask, typical_mask)
from engine.penalty_counts import PenaltyCounts  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

VOCAB = 50


def row(prompt=(1, 2, 3), generated=(), seed=None, **params):
    p = SamplingParams(**params)
    seq = Sequence(0, "r", list(prompt) + list(generated), p, max_tokens=1000, num_prompt_tokens=len(prompt))
    seq.seed = seed if seed is not None else pick_seed(p)
    return seq


def random_logits(n, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    logits = random_logits(6)
    out = sample(logits, [row() for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-5)


def test_setting_a_warper_turns_sampling_on_as_in_tgi():
    assert not is_sampling(SamplingParams())
    assert is_sampling(SamplingParams(do_sample=True))
    assert is_sampling(SamplingParams(temperature=0.5))
    assert is_sampling(SamplingParams(top_k=5))
    assert is_sampling(SamplingParams(top_p=0.9))
    assert is_sampling(SamplingParams(typical_p=0.9))
    assert not is_sampling(SamplingParams(top_p=1.0, repetition_penalty=1.3))
    assert pick_seed(SamplingParams()) is None
    assert isinstance(pick_seed(SamplingParams(do_sample=True)), int)
    assert pick_seed(SamplingParams(do_sample=True, seed=42)) == 42


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_mask_matches_transformers(k):
    logits = random_logits(4)
    ours = top_k_mask(logits, torch.tensor([k] * 4))
    theirs = TopKLogitsWarper(k)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_top_k_per_row_with_zero_meaning_all():
    logits = random_logits(2)
    masked = top_k_mask(logits, torch.tensor([2, 0]))
    assert torch.isfinite(masked[0]).sum() == 2
    assert torch.isfinite(masked[1]).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_mask_matches_transformers(p):
    logits = random_logits(4, seed=1)
    ours = top_p_mask(logits, torch.tensor([p] * 4))
    theirs = TopPLogitsWarper(p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(top_p_mask(logits, torch.tensor([0.7]))).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_mask(logits, torch.tensor([0.85]))).tolist() == [[True, True, True, False]]
    assert torch.isfinite(top_p_mask(logits, torch.tensor([1.0]))).all()


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.95])
def test_typical_mask_matches_transformers(mass):
    logits = random_logits(4, seed=2)
    ours = typical_mask(logits, torch.tensor([mass] * 4))
    theirs = TypicalLogitsWarper(mass)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_repetition_penalty_matches_transformers_over_prompt_and_generated():
    logits = random_logits(2, seed=3)
    rows = [row(prompt=(1, 2, 2), generated=(5, 9), repetition_penalty=1.7), row()]
    out = sample(logits, rows)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 2, 5, 9]]), logits[:1].clone())
    assert out.token_ids[0] == int(expected.argmax())
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(expected, -1).max()), abs=1e-5)
    assert out.token_ids[1] == int(logits[1].argmax())      # the other row is untouched


def test_frequency_penalty_counts_generated_tokens_only():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0     # prompt token: not penalised
    logits[0, 4] = 1.5     # generated twice: 1.5 - 2 * 0.5 = 0.5
    logits[0, 5] = 0.8
    out = sample(logits, [row(prompt=(3, 3), generated=(4, 4), frequency_penalty=0.5)])
    assert out.token_ids == [3]
    expected = torch.log_softmax(torch.tensor([1.0, 0.5, 0.8] + [0.0] * (VOCAB - 3)), -1)[0]
    assert out.logprobs[0] == pytest.approx(float(expected), abs=1e-5)


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = random_logits(1, seed=4).expand(3, VOCAB)

    def draws(seed, batch_with_noise):
        r = row(seed=seed, do_sample=True)
        if not batch_with_noise:
            return [sample(logits[:1], [r]).token_ids[0] for _ in range(20)]
        others = [row(seed=1, do_sample=True), row()]
        return [sample(logits, [others[0], r, others[1]]).token_ids[1] for _ in range(20)]

    assert draws(7, batch_with_noise=False) == draws(7, batch_with_noise=True)
    assert draws(7, batch_with_noise=False) != draws(8, batch_with_noise=False)


PICKABLE = [dict(), dict(do_sample=True), dict(temperature=0.6), dict(top_k=4), dict(top_k=1, temperature=2.0),
            dict(top_p=0.7), dict(top_k=10, top_p=0.5), dict(typical_p=0.8), dict(temperature=3.0, top_p=0.99),
            dict(logprobs=True), dict(top_n_tokens=3), dict(top_p=0.8, top_n_tokens=5),
            dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, top_n_tokens=2),
            dict(repetition_penalty=0.7, frequency_penalty=-0.5, do_sample=True),
            dict(repetition_penalty=2.5, top_k=6, temperature=0.8)]


@pytest.mark.parametrize("kept_counts", [False, True])
def test_picks_on_the_device_are_the_samplers_picks(kept_counts):
    """What async scheduling draws without reading back (the dense path, its top-p sorting the vocabulary) equals
    `sample` (which takes its candidate lists and CPU kernels) step after step from the same seeds, beside greedy
    rows, token, logprob and alternatives; penalties read the histories as they grow, with the engine's kept
    counts or without."""
    rows = {mode: [row(seed=50 + i, **kw) for i, kw in enumerate(PICKABLE * 3)] for mode in ("sample", "device")}
    counts = {mode: PenaltyCounts() if kept_counts else None for mode in rows}
    changed = 0
    for step in range(25):
        logits = random_logits(len(PICKABLE) * 3, seed=step) * (1 + step % 3)
        expected = sample(logits, rows["sample"], counts=counts["sample"])
        picks = pick_on_device(logits, rows["device"], logprobs=True, counts=counts["device"])
        assert picks.token_ids.tolist() == expected.token_ids
        assert picks.logprobs.tolist() == pytest.approx(expected.logprobs, abs=1e-5)
        for r, (ids, lps) in enumerate(zip(expected.top_token_ids, expected.top_logprobs)):
            assert picks.top_token_ids[r, :len(ids)].tolist() == ids
            assert picks.top_logprobs[r, :len(ids)].tolist() == pytest.approx(lps, abs=1e-5)
        changed += int(logits[12].argmax()) != expected.token_ids[12]      # the greedy row's penalty bites
        for mode in rows:
            for seq, token in zip(rows[mode], expected.token_ids):
                seq.append_token(token)
        alone = pick_on_device(logits[:1], rows["device"][:1], logprobs=False)     # a greedy row alone
        assert alone.logprobs is None and alone.top_token_ids is None
        assert alone.token_ids.tolist() == [int(logits[0].argmax())]
    assert changed >= 3


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = probs.clamp(min=1e-30).log()[None]
    r = row(seed=123, do_sample=True)
    draws = [sample(logits, [r]).token_ids[0] for _ in range(2000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=0.04)
    assert set(draws) <= {0, 1, 2}


def test_sampled_tokens_respect_top_k_and_logprobs_are_renormalised():
    logits = random_logits(1, seed=5)
    top2 = set(logits[0].topk(2).indices.tolist())
    r = row(seed=3, top_k=2)
    for _ in range(30):
        out = sample(logits, [r])
        assert out.token_ids[0] in top2
        kept = logits[0, sorted(top2)]
        expected = torch.log_softmax(kept, -1)[sorted(top2).index(out.token_ids[0])]
        assert out.logprobs[0] == pytest.approx(float(expected), abs=1e-5)


def test_temperature_sharpens_the_processed_distribution():
    logits = random_logits(1, seed=6)
    out = sample(logits, [row(seed=1, temperature=0.01, top_n_tokens=2)])
    assert out.token_ids[0] == int(logits.argmax())
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-3)


def test_top_n_tokens_per_row():
    logits = random_logits(2, seed=7)
    out = sample(logits, [row(top_n_tokens=3), row()])
    assert out.top_token_ids[0] == logits[0].topk(3).indices.tolist()
    assert out.top_logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1).topk(3).values.tolist(), abs=1e-5)
    assert out.top_token_ids[1] == [] and out.top_logprobs[1] == []
    assert out.top_token_ids[0][0] == out.token_ids[0]
    assert all(not math.isnan(x) for x in out.top_logprobs[0])
