"""Penalties from token counts kept between steps (engine/penalty_counts.py) give exactly the scores of
counting each history afresh, step after step, while sequences join, grow, leave,
get their rows taken by others, and come back; with duplicate ids, ids at the vocabulary's ends and
rows without a sequence id."""
from __future__ import annotations

import random
import pytest

torch = pytest.importorskip("torch")

from engine.penalty_counts import PenaltyCounts  # noqa: E402
from engine.sampler import apply_frequency_penalty, apply_repetition_penalty, sample  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from sampler_rows import AnonymousRow, Row  # noqa: E402

VOCAB = 97


def params(rng: random.Random) -> SamplingParams:
    return SamplingParams(repetition_penalty=rng.choice([None, 1.0, 1.3, 0.7]),
                          frequency_penalty=rng.choice([0.0, 0.5, -0.4]),
                          do_sample=rng.random() < 0.5, top_k=rng.choice([0, 5]), seed=rng.randrange(100))


def simulate(seed: int, device: torch.device) -> None:
    rng = random.Random(seed)
    counts = PenaltyCounts(rows=2)          # small: rows are taken over and the table grows
    live: list[Row] = []
    next_id = 0
    for step in range(60):
        if rng.random() < 0.3 or not live:
            prompt = [rng.choice([0, VOCAB - 1, rng.randrange(VOCAB)]) for _ in range(rng.randrange(1, 9))]
            live.append(Row(next_id, params(rng), prompt, len(prompt), seed=rng.randrange(10)))
            next_id += 1
        if rng.random() < 0.15 and len(live) > 1:
            live.pop(rng.randrange(len(live)))
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        if rng.random() < 0.2:
            batch.append(AnonymousRow(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3), [3, 3, 5, 3], 1))
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(step))
        on = logits.to(device)
        if any(r.params.repetition_penalty not in (None, 1.0) for r in batch):
            kept = apply_repetition_penalty(on, batch, counts).cpu()
            assert torch.equal(kept, apply_repetition_penalty(logits, batch))
        if any(r.params.frequency_penalty for r in batch):
            kept = apply_frequency_penalty(on, batch, counts).cpu()
            assert torch.equal(kept, apply_frequency_penalty(logits, batch))
        tokens = sample(logits.to(device), batch, counts=counts if device.type == "cuda" else None).token_ids
        for r, token in zip(batch, tokens):
            r.token_ids.append(token)


@pytest.mark.parametrize("seed", range(5))
def test_kept_counts_equal_fresh_counts_step_after_step(seed):
    simulate(seed, torch.device("cpu"))


@pytest.mark.gpu
def test_kept_counts_on_cuda_equal_fresh_counts_on_cpu():
    for seed in range(3):
        simulate(seed, torch.device("cuda"))


def test_on_cpu_the_sampler_keeps_its_per_history_path():
    counts = PenaltyCounts()
    row = Row(0, SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5), [1, 2, 2], 1)
    sample(torch.randn(1, 8), [row], counts=counts)
    assert not counts.tables        # nothing was kept: the vocabulary-wide passes cost more than they save here


def test_a_history_that_got_shorter_is_recounted():
    counts = PenaltyCounts()
    row = Row(0, SamplingParams(frequency_penalty=1.0), [1, 2, 3, 3, 3], 2)
    logits = torch.zeros(1, 8)
    apply_frequency_penalty(logits, [row], counts)
    row.token_ids = [1, 2, 4]                      # e.g. a rollback
    assert torch.equal(apply_frequency_penalty(logits, [row], counts), apply_frequency_penalty(logits, [row]))


def test_the_callers_logits_are_left_alone():
    counts = PenaltyCounts()
    row = Row(0, SamplingParams(repetition_penalty=2.0), [1, 2], 1)
    logits = torch.ones(1, 4)
    apply_repetition_penalty(logits, [row], counts)
    assert torch.equal(logits, torch.ones(1, 4))


def picks_ahead_equal_picks_after(seed: int, device: torch.device) -> None:
    """A step ahead's picks (engine/async_scheduling.py): the first k rows' last tokens are still in flight, on the
    device and not in their histories (k changes every step, the other rows' tokens are appended), and the
    penalties count them from `in_flight`. The picks, logprobs and alternatives equal those of the same rows with
    every token appended."""
    from engine.sampler import pick_on_device

    rng = random.Random(seed)
    prompts = [[rng.choice([0, VOCAB - 1, rng.randrange(VOCAB)]) for _ in range(rng.randrange(1, 9))]
               for _ in range(12)]
    kinds = [params(rng) for _ in prompts]
    kinds[0] = SamplingParams(repetition_penalty=1.8, frequency_penalty=1.0, top_n_tokens=3)  # greedy, both kinds
    rows = {mode: [Row(i, p, list(prompt), len(prompt), seed=i) for i, (p, prompt) in enumerate(zip(kinds, prompts))]
            for mode in ("after", "ahead")}
    counts = {mode: PenaltyCounts(rows=4) for mode in rows}
    in_flight = None
    for step in range(30):
        logits = (torch.randn(len(prompts), VOCAB, generator=torch.Generator().manual_seed(step)) * 3).to(device)
        expected = pick_on_device(logits, rows["after"], logprobs=True, counts=counts["after"])
        picks = pick_on_device(logits, rows["ahead"], logprobs=True, counts=counts["ahead"], in_flight=in_flight)
        if in_flight is not None:           # N resolved after N+1 is picked, as the engine does
            for r, token in zip(rows["ahead"], in_flight.tolist()):
                r.token_ids.append(token)
        assert picks.token_ids.tolist() == expected.token_ids.tolist()
        assert picks.logprobs.tolist() == pytest.approx(expected.logprobs.tolist(), abs=1e-5)
        assert torch.equal(picks.top_token_ids, expected.top_token_ids)
        tokens, k = expected.token_ids.tolist(), rng.randrange(len(prompts) + 1)
        for r, token in zip(rows["after"], tokens):
            r.token_ids.append(token)
        for r, token in zip(rows["ahead"][k:], tokens[k:]):
            r.token_ids.append(token)
        in_flight = picks.token_ids[:k]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(4))
def test_tokens_in_flight_are_counted_as_if_appended(seed, device):
    picks_ahead_equal_picks_after(seed, torch.device(device))


@pytest.mark.gpu
def test_gpu_penalised_picks_do_not_wait_for_the_queued_forward():
    """A step ahead picks a penalised batch (kept counts, warpers, draws; half its rows with their token in flight)
    while the device still runs the forward: nothing it copies to the device waits for the queued kernels, and the
    picks are the CPU sampler's."""
    from engine.sampler import pick_on_device

    device, counts = torch.device("cuda"), PenaltyCounts(rows=4)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    kinds = [params(rng) for _ in prompts]
    rows = {where: [Row(i, p, list(prompt), len(prompt), seed=i) for i, (p, prompt) in enumerate(zip(kinds, prompts))]
            for where in ("cuda", "cpu")}
    in_flight = None
    for step in range(6):
        logits = torch.randn(len(prompts), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        on = logits.to(device)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)     # about a second: the forward still running
        queued = torch.cuda.Event()
        queued.record()
        picks = pick_on_device(on, rows["cuda"], logprobs=True, counts=counts, in_flight=in_flight)
        assert not queued.query(), "the penalised pick waited for the kernels queued before it"
        if in_flight is not None:
            for r, token in zip(rows["cuda"], in_flight.tolist()):
                r.token_ids.append(token)
        expected = sample(logits, rows["cpu"]).token_ids
        assert picks.token_ids.tolist() == expected
        for r, token in zip(rows["cpu"], expected):
            r.token_ids.append(token)
        for r, token in zip(rows["cuda"][6:], expected[6:]):
            r.token_ids.append(token)
        in_flight = picks.token_ids[:6]
