"""The CPU log_softmax kernels (engine/kernels/cpu_log_softmax.py) against torch's argmax and a float64
log_softmax, on random shapes, strided rows and hostile values; the sampler taking them (the same bits on every
path) or torch's passes."""
import math
import random

import pytest

torch = pytest.importorskip("torch")

import engine.sampler as sampler  # noqa: E402
from engine.kernels import cpu_log_softmax as kernels  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler (g++) here")

CLOSE = dict(rtol=kernels.RTOL, atol=kernels.ATOL, equal_nan=True)


def check(scores, logprobs=True):
    """Both kernels on `scores` against the float64 references; the greedy logprob is log_softmax's at the
    argmax, bit for bit."""
    ids, chosen = kernels.greedy(scores, logprobs)
    want_ids, want = kernels.greedy_reference(scores.double(), logprobs)
    assert torch.equal(ids, want_ids)
    full = kernels.log_softmax(scores)
    torch.testing.assert_close(full.double(), kernels.log_softmax_reference(scores.double()), **CLOSE)
    if logprobs:
        torch.testing.assert_close(chosen.double(), want, **CLOSE)
        torch.testing.assert_close(full.gather(1, ids[:, None]).squeeze(1), chosen, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.isnan(chosen).all()     # nobody asked: no exp pass
    return ids, chosen, full


@pytest.mark.parametrize("seed", range(8))
def test_random_rows_match_argmax_and_float64_log_softmax(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, width = rng.choice([1, 2, 5, 33]), rng.choice([1, 15, 16, 17, 1023, 1024, 1025, 4099, 49152])
    base = torch.randn(rows, width + 7, generator=gen) * rng.choice([1e-3, 1.0, 8.0, 40.0])
    scores = base[:, 3:3 + width]           # rows strided: a slice of wider logits
    check(scores)
    check(scores, logprobs=False)
    check(scores.contiguous())


def test_the_max_late_in_a_wide_row_rescales_the_earlier_blocks():
    scores = torch.linspace(-30, 5, 128256)[None].repeat(3, 1)      # rising: a new max in every block
    scores[1] = scores[1].flip(0)                                    # falling: the first block holds it
    scores[2, 70000] = 80.0                                          # one peak far from both
    ids, _, _ = check(scores)
    assert ids.tolist() == [128255, 0, 70000]


def test_hostile_rows_as_torch():
    scores = kernels.hostile_rows(torch.Generator().manual_seed(1))
    ids, chosen, full = check(scores)
    assert ids[:5].tolist() == [40, 0, 2999, 0, 7] and ids[7].item() == 1023
    for row in (0, 1, 2):                            # NaN, all -inf, +inf: NaN everywhere, as torch
        assert math.isnan(chosen[row]) and torch.isnan(full[row]).all()
    assert torch.isnan(torch.log_softmax(scores[:3], -1)).all()
    assert chosen[3].item() == pytest.approx(-math.log(3000), rel=1e-6)
    assert chosen[6].item() == 0.0 and full[6, 5].item() == pytest.approx(-1e30 - 1e30, rel=1e-6)
    assert torch.isneginf(full[5, :2000]).all() and torch.isneginf(full[8, ::2]).all()   # masked stay -inf


def test_threaded_rows_give_the_one_thread_results():
    scores = torch.randn(64, 40000, generator=torch.Generator().manual_seed(2)) * 5   # over PARALLEL_MIN
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.greedy(scores, True), kernels.log_softmax(scores)
        torch.set_num_threads(max(2, threads))
        many = kernels.greedy(scores, True), kernels.log_softmax(scores)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0][0], many[0][0]) and torch.equal(one[0][1], many[0][1]) and torch.equal(one[1], many[1])
    check(scores)


def test_empty_shapes_and_an_output_buffer():
    ids, chosen = kernels.greedy(torch.empty(0, 10), True)
    assert ids.shape == chosen.shape == (0,)
    assert kernels.log_softmax(torch.empty(3, 0)).shape == (3, 0)
    scores = torch.randn(4, 100)
    out = torch.full((4, 100), 7.0)
    assert kernels.log_softmax(scores, out) is out and torch.equal(out, kernels.log_softmax(scores))


def test_self_check_passes_here_and_fails_on_a_broken_kernel(monkeypatch):
    assert kernels.unusable_reason() is None
    monkeypatch.setattr(kernels, "log_softmax", lambda scores, out=None: torch.zeros_like(scores))
    assert kernels.unusable_reason() == "log_softmax disagrees with the float64 log_softmax on [3, 17]"


def _rows(n, **params):
    return [Sequence(i, f"r{i}", [1, 2, 3], SamplingParams(**params), max_tokens=10**6, num_prompt_tokens=3)
            for i in range(n)]


def test_sampler_takes_the_kernels_and_every_path_gives_the_same_bits(monkeypatch):
    assert sampler.use_cpu_kernels() == "fused"
    logits = torch.randn(12, 5000, generator=torch.Generator().manual_seed(4)) * 3
    logits[3, 17] = math.nan
    calls = []
    monkeypatch.setattr(kernels, "greedy", lambda s, lp, f=kernels.greedy: calls.append(1) or f(s, lp))
    fused = sampler.sample(logits, _rows(12))
    assert calls == [1]                                             # the greedy kernel, once for the batch
    general = sampler.process(logits, _rows(12))                    # the general sampler's log_softmax
    slow = sampler.report(general.logprobs, general.scores.argmax(dim=-1), [SamplingParams()] * 12)
    assert fused.token_ids == slow.token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(torch.tensor(fused.logprobs).nan_to_num(), torch.tensor(slow.logprobs).nan_to_num())
    top = sampler.sample(logits, _rows(12, top_n_tokens=2))         # alternatives: the buffered log_softmax
    finite = [i for i in range(12) if i != 3]                       # row 3's NaN: NaN everywhere
    assert [top.top_token_ids[i][0] for i in finite] == [fused.token_ids[i] for i in finite]
    assert [top.top_logprobs[i][0] for i in finite] == [fused.logprobs[i] for i in finite]
    monkeypatch.setattr(sampler, "_cpu_kernels", None)              # torch's passes: within float32 rounding
    torch_path = sampler.sample(logits, _rows(12))
    assert torch_path.token_ids == fused.token_ids
    assert torch_path.logprobs == pytest.approx(fused.logprobs, rel=1e-4, abs=1e-5, nan_ok=True)
    assert all(math.isnan(lp) for lp in sampler.sample(logits, _rows(12, logprobs=False)).logprobs)


def test_unusable_kernels_leave_torch_passes(monkeypatch):
    monkeypatch.setattr(sampler, "_cpu_kernels", None)
    monkeypatch.setattr(sampler, "_cpu_kernels_unusable", [])
    monkeypatch.setattr(kernels, "self_check", lambda: "greedy ids disagree with torch.argmax on [1, 1]")
    monkeypatch.delenv(sampler.SAMPLER_ENV, raising=False)
    assert sampler.use_cpu_kernels() == "torch (greedy ids disagree with torch.argmax on [1, 1])"
    assert sampler._cpu_kernels is None
    monkeypatch.setenv(sampler.SAMPLER_ENV, "fused")                 # asked for: a clear error at start-up
    with pytest.raises(ValueError, match="TGI_HPC_CPU_SAMPLER=fused, but the CPU sampler kernels cannot run here: "
                                         "greedy ids disagree"):
        sampler.use_cpu_kernels()
    monkeypatch.delenv(sampler.SAMPLER_ENV)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    out = sampler.sample(logits, _rows(4))
    want = torch.log_softmax(logits, dim=-1).gather(1, logits.argmax(dim=-1)[:, None]).squeeze(1)
    assert out.logprobs == want.tolist()                           # torch's values, bit for bit


@pytest.mark.parametrize("value, choice", [("torch", "torch (TGI_HPC_CPU_SAMPLER=torch)"), ("auto", "fused"),
                                           ("", "fused"), ("fused", "fused")])
def test_the_environment_picks_the_path(monkeypatch, value, choice):
    monkeypatch.setattr(sampler, "_cpu_kernels", None)
    monkeypatch.setenv(sampler.SAMPLER_ENV, value)
    assert sampler.use_cpu_kernels() == choice
    assert (sampler._cpu_kernels is kernels) == (choice == "fused")
    monkeypatch.setenv(sampler.SAMPLER_ENV, "Fused")
    with pytest.raises(ValueError, match="TGI_HPC_CPU_SAMPLER='Fused'; use auto, fused or torch"):
        sampler.use_cpu_kernels()


def make_engine():
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from fakes import FakeModelConfig, FakeRunner, test_model_path
    runner = FakeRunner(1024, 64, 4)
    engine = LLMEngine(EngineConfig(), runner=runner, model_config=FakeModelConfig(1024, 512),
                       tokenizer=AutoTokenizer.from_pretrained(test_model_path("tiny-llama")))
    return engine, runner


def test_an_engine_reports_its_choice_and_a_bad_value_stops_it_before_serving(monkeypatch):
    monkeypatch.setattr(sampler, "_cpu_kernels", None)
    monkeypatch.setenv(sampler.SAMPLER_ENV, "torch")
    engine, _ = make_engine()
    assert engine.sampler_backend == "torch (TGI_HPC_CPU_SAMPLER=torch)" and sampler._cpu_kernels is None
    monkeypatch.delenv(sampler.SAMPLER_ENV)
    engine, _ = make_engine()
    assert engine.sampler_backend == "fused" and sampler._cpu_kernels is kernels
    monkeypatch.setenv(sampler.SAMPLER_ENV, "gpu")
    closed = []
    monkeypatch.setattr("fakes.FakeRunner.close", lambda self: closed.append(self), raising=False)
    with pytest.raises(ValueError, match="use auto, fused or torch"):
        make_engine()
    assert len(closed) == 1                                         # the runner it built is let go


@pytest.mark.parametrize("seed", range(6))
def test_sample_draws_the_float64_inverse_cdfs_token_with_log_softmaxs_bits(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, width = rng.choice([1, 3, 16, 40]), rng.choice([1, 17, 1023, 1024, 1025, 4099, 49152])
    scores = (torch.randn(rows, width + 5, generator=gen) * rng.choice([0.1, 2.0, 9.0]))[:, 2:2 + width]
    temps = torch.rand(rows, generator=gen) * 1.5 + 0.2
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    ids, chosen = kernels.sample(scores, temps, uniforms)
    want_ids, want, margin = kernels.sample_reference(scores.double(), temps.double(), uniforms)
    assert all(a == b or m < 1e-5 for a, b, m in zip(ids.tolist(), want_ids.tolist(), margin.tolist()))
    torch.testing.assert_close(chosen.double(), want, **CLOSE)
    at_ids = kernels.log_softmax(scores / temps[:, None]).gather(1, ids[:, None]).squeeze(1)
    assert torch.equal(at_ids, chosen)


def test_sample_follows_the_distribution_across_blocks_and_skips_masked_tokens():
    scores = torch.full((1, 5000), -math.inf)
    scores[0, [3, 1500, 4999]] = torch.tensor([0.6, 0.3, 0.1]).log()   # three blocks apart; the rest masked
    grid = torch.arange(2000, dtype=torch.float64) / 2000
    ids, chosen = kernels.sample(scores.expand(2000, -1), torch.ones(2000), grid)
    freq = [(ids == t).double().mean().item() for t in (3, 1500, 4999)]
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=1e-3) and sum(freq) == 1.0
    assert chosen[0].item() == pytest.approx(math.log(0.6), abs=1e-6)
    hot = kernels.sample(scores, torch.tensor([0.05]), torch.tensor([0.99], dtype=torch.float64))[0]
    assert hot.tolist() == [3]                    # a low temperature leaves the best token all the mass


def test_sample_on_hostile_rows_gives_the_argmax_and_a_nan_logprob():
    scores = kernels.hostile_rows(torch.Generator().manual_seed(3))
    ids, chosen = kernels.sample(scores, torch.ones(9), torch.full((9,), 0.5, dtype=torch.float64))
    assert ids[:3].tolist() == [40, 0, 2999] and torch.isnan(chosen[:3]).all()
    assert torch.isfinite(chosen[3:]).all() and bool(torch.isfinite(scores[5, ids[5]]))   # a masked token never
    assert kernels._check_sample(scores, torch.Generator().manual_seed(4)) is None


def test_self_check_fails_on_a_broken_sample_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "sample", lambda scores, temps, uniforms: (
        torch.zeros(len(scores), dtype=torch.int64), torch.zeros(len(scores))))
    assert kernels.unusable_reason().startswith("sample: ")


def test_temperature_only_rows_take_the_sample_kernel_with_the_dense_paths_bits(monkeypatch):
    assert sampler.use_cpu_kernels() == "fused"
    logits = torch.randn(10, 5000, generator=torch.Generator().manual_seed(6)) * 3

    def rows():
        out = [Sequence(i, f"r{i}", [1, 2, 3], SamplingParams(do_sample=True, temperature=0.5 + 0.1 * i),
                        max_tokens=10**6, num_prompt_tokens=3) for i in range(8)]
        for r, seq in enumerate(out):
            seq.seed = 40 + r
        return out + _rows(2)                                       # and two greedy rows

    calls = []
    monkeypatch.setattr(kernels, "sample", lambda s, t, u, f=kernels.sample: calls.append(len(s)) or f(s, t, u))
    first = rows()
    fast = [sampler.sample(logits, first) for _ in range(6)]
    assert calls == [8] * 6                                        # the sampling rows, once a step
    monkeypatch.setattr(sampler, "_temperature_only", lambda p: False)      # the dense path, the same kernels
    second = rows()
    dense = [sampler.sample(logits, second) for _ in range(6)]
    for a, b in zip(fast, dense):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs     # the same bits
        assert a.token_ids[8:] == logits[8:].argmax(dim=-1).tolist()
