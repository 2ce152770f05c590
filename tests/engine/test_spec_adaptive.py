"""--speculate auto: per-sequence drafting that stops while acceptance makes it a loss and retries later;
greedy output unchanged (n-gram and layer skip), the flag, and the per-method counters in /metrics."""
import pytest

torch = pytest.importorskip("torch")

from engine.launcher import AUTO_MAX_DRAFTS, parse_args, to_config  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from engine.server.metrics import ServerMetrics  # noqa: E402
from engine.spec_decode import adaptive  # noqa: E402
from engine.spec_decode.adaptive import AdaptiveDrafts, best_num_drafts  # noqa: E402
from test_spec_decode import compare_greedy  # noqa: E402


def make_seq():
    return Sequence(0, "r", [1, 2, 3], SamplingParams(), max_tokens=100)


def expected_tokens_per_cost(acceptance, k, draft_cost):
    return sum(acceptance ** i for i in range(k + 1)) / (1 + k * (draft_cost + adaptive.VERIFY_COST))


@pytest.mark.parametrize("acceptance", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("draft_cost", [0.0, 0.3, 0.6])
def test_the_chosen_draft_count_is_the_most_tokens_per_cost(acceptance, draft_cost):
    for room in range(0, 6):
        k = best_num_drafts(acceptance, room, draft_cost)
        gains = [expected_tokens_per_cost(acceptance, j, draft_cost) for j in range(room + 1)]
        assert 0 <= k <= room and gains[k] == pytest.approx(max(gains)), (room, k, gains)
    assert best_num_drafts(0.0, 4, draft_cost) == 0          # nothing is ever accepted: never draft
    assert best_num_drafts(1.0, 4, 0.0) == 4                 # everything is: draft all the room


def test_a_sequence_stops_drafting_when_rejected_and_retries_later():
    drafts = AdaptiveDrafts(draft_cost=0.5)
    seq = make_seq()
    assert drafts.num_tokens(seq, 4) > 0                     # the prior is optimistic
    num_drafted = 0
    while (k := drafts.num_tokens(seq, 4)) > 0:
        drafts.record(seq, k, 0)                             # every draft rejected
        num_drafted += 1
        assert num_drafted < 10, "never stopped drafting"
    paused = [drafts.num_tokens(seq, 4) for _ in range(adaptive.RETRY_AFTER - 1)]
    assert paused == [0] * (adaptive.RETRY_AFTER - 1) and drafts.num_paused_total == adaptive.RETRY_AFTER
    assert drafts.num_tokens(seq, 4) == 1                    # the retry: a one-token probe
    drafts.record(seq, 1, 1)
    for _ in range(8):                                       # acceptance recovers: it drafts again, more and more
        k = drafts.num_tokens(seq, 4)
        if k == 0:                                           # not yet: probe again later
            assert [drafts.num_tokens(seq, 4) for _ in range(adaptive.RETRY_AFTER)] == [0] * adaptive.RETRY_AFTER
            k = drafts.num_tokens(seq, 4)
            assert k == 1
        drafts.record(seq, k, k)
    assert drafts.num_tokens(seq, 4) == 4


def test_new_sequences_start_from_the_methods_acceptance_so_far():
    drafts = AdaptiveDrafts(draft_cost=0.5)
    assert drafts.num_tokens(make_seq(), 4) > 0              # nothing known yet: the optimistic prior
    for _ in range(20):                                      # other sequences' drafts were all rejected
        drafts.record(make_seq(), 2, 0)
    assert drafts.num_tokens(make_seq(), 4) == 0             # a newcomer does not pay for that lesson again
    for _ in range(400):
        drafts.record(make_seq(), 3, 3)
    assert drafts.num_tokens(make_seq(), 4) == 4
    assert drafts.num_tokens(make_seq(), 0) == 0 and drafts.num_tokens(make_seq(), -1) == 0


def test_histories_are_per_sequence():
    drafts = AdaptiveDrafts(draft_cost=0.5)
    bad, good = make_seq(), make_seq()
    for _ in range(6):
        drafts.record(bad, 3, 0)
        drafts.record(good, 3, 3)
    assert drafts.num_tokens(bad, 3) == 0 and drafts.num_tokens(good, 3) == 3


def test_speculate_auto_flag():
    config = to_config(parse_args(["--model-id", "m", "--speculate", "auto"], environ={}), "m")
    assert config.speculate_auto and config.speculate == AUTO_MAX_DRAFTS
    config = to_config(parse_args(["--model-id", "m"], environ={"SPECULATE": "AUTO"}), "m")
    assert config.speculate_auto
    assert not to_config(parse_args(["--model-id", "m", "--speculate", "3"], environ={}), "m").speculate_auto
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", "--speculate", "automatic"], environ={})


@pytest.mark.parametrize("layers", [0, 1], ids=["ngram", "layers"])
def test_greedy_with_speculate_auto_is_identical_and_drafts_only_while_it_pays(layers):
    _, stats = compare_greedy("tiny-llama", {"speculate_auto": True, "speculative_layers": layers},
                              require_accepted=False)
    assert stats.speculative_method == ("layers" if layers else "ngram")
    if layers:  # a random tiny model's first layer rarely agrees with both: drafting stops, and is retried
        assert stats.num_speculative_accepted_total < stats.num_speculative_proposed_total / 4, stats
        assert stats.num_speculative_paused_total > stats.num_speculative_proposed_total, stats
    else:       # the repetitive prompts copy well
        assert stats.num_speculative_accepted_total > stats.num_speculative_proposed_total / 4, stats


def test_metrics_count_drafts_per_method_and_paused_decodes():
    from engine.llm_engine import EngineStats
    stats = EngineStats(0, 0, 0, 10, 10, 4, 0, "fake", num_speculative_proposed_total=12,
                        num_speculative_accepted_total=5, speculative_method="layers", num_speculative_paused_total=7)
    from prometheus_client import generate_latest
    text = generate_latest(ServerMetrics(lambda: stats).registry).decode()
    assert 'tgi_speculative_method_proposed_tokens_total{method="layers"} 12.0' in text
    assert 'tgi_speculative_method_accepted_tokens_total{method="layers"} 5.0' in text
    assert 'tgi_speculative_method_paused_decodes_total{method="layers"} 7.0' in text
    stats.speculative_method = ""
    assert "tgi_speculative_method" not in generate_latest(ServerMetrics(lambda: stats).registry).decode()


def test_rejected_probes_of_a_costly_drafter_wait_longer_and_an_accepted_one_resets():
    drafts = AdaptiveDrafts(draft_cost=0.5)
    for _ in range(20):
        drafts.record(make_seq(), 2, 0)                      # the method does not pay
    seq, waits = make_seq(), []
    for _ in range(6):
        num_paused = 0
        while drafts.num_tokens(seq, 4) == 0:
            num_paused += 1
        waits.append(num_paused)
        drafts.record(seq, 1, 0)                             # the probe is rejected
    assert waits == [16, 32, 64, 128, 256, 512]
    while drafts.num_tokens(seq, 4) == 0:
        pass
    drafts.record(seq, 1, 1)                                 # accepted: probes come back at the first pace
    assert drafts.retry_after == adaptive.RETRY_AFTER
    free, seq = AdaptiveDrafts(draft_cost=0.0), make_seq()   # n-gram drafts cost no forward: no backoff
    for _ in range(3):
        while free.num_tokens(seq, 4) == 0:
            pass
        free.record(seq, 1, 0)
    assert free.retry_after == adaptive.RETRY_AFTER
