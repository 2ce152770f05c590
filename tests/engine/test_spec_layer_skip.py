"""Layer-skip self-speculation (--speculative-layers K): drafts from the target's first K layers in its own KV
cache; greedy output equal to no speculation (batch 1 and 16 mixed requests, tiny models and SmolLM2), the
sampled distribution kept (chi-square), the batched drafter's spans, and the flags' refusals."""
import pytest

torch = pytest.importorskip("torch")

from engine.batch import SeqSpan  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.launcher import parse_args, to_config  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledBatch  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from engine.spec_decode.batch_drafter import BatchDrafter  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import chi_square_p, compare_greedy, real_engine  # noqa: E402

VOCAB = 50


def test_drafter_feeds_each_row_its_own_previous_draft_at_the_next_position():
    seen = []

    def forward(spans):     # the next token is (last token + position) % VOCAB: depends on both
        seen.append([(s.seq_id, list(s.token_ids), s.start_pos, s.logits) for s in spans])
        logits = torch.zeros(len(spans), VOCAB)
        for i, span in enumerate(spans):
            logits[i, (span.token_ids[0] + span.start_pos) % VOCAB] = 1.0
        return logits

    drafter = BatchDrafter(forward)
    batch = ScheduledBatch()
    for seq_id, (tokens, room) in enumerate([([5, 6, 7], 3), ([9, 1], 1), ([4, 4, 4, 4], 0)]):
        seq = Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(), max_tokens=20)
        seq.num_computed_tokens = len(tokens) - 1
        seq.draft_token_ids = drafter.propose(seq, room)
        batch.seqs.append(seq)
        batch.spans.append(SeqSpan(seq_id, [tokens[-1]] + seq.draft_token_ids, len(tokens) - 1, [0, 1], "all"))
    drafter.fill(batch)
    # row 0: 7@2 -> 9, 9@3 -> 12, 12@4 -> 16; row 1: 1@1 -> 2; row 2 has no slots and is never run
    assert [s.draft_token_ids for s in batch.seqs] == [[9, 12, 16], [2], []]
    assert [s.token_ids for s in batch.spans] == [[7, 9, 12, 16], [1, 2], [4]]
    assert seen == [[(0, [7], 2, "last"), (1, [1], 1, "last")], [(0, [9], 3, "last")], [(0, [12], 4, "last")]]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma2"])
def test_greedy_on_tiny_models_is_identical_with_layer_skip(name):
    compare_greedy(name, {"speculative_layers": 1})


def test_greedy_on_smollm2_with_its_first_layers_is_identical():
    compare_greedy("smollm2", {"speculative_layers": 12}, max_new=8)


def test_greedy_with_two_shards_is_identical_with_layer_skip():
    compare_greedy("tiny-llama", {"speculative_layers": 1, "num_shard": 2}, {"num_shard": 1}, count=6)


def test_sampled_token_distribution_is_kept_with_layer_skip():
    num_draws = 200
    params = [SamplingParams(do_sample=True, seed=seed, temperature=1.0, top_k=4, max_new_tokens=4,
                             ignore_eos=True) for seed in range(num_draws)]
    counts = {}
    for layers in (0, 1):
        with real_engine("tiny-llama", speculate=3 if layers else 0, speculative_layers=layers) as engine:
            outs = engine.generate([engine.tokenizer.encode("one two three")] * num_draws, params)
            stats = engine.stats()
        counts[layers] = [{} for _ in range(4)]
        for out in outs:
            for position, token in enumerate(out.tokens):
                counts[layers][position][token.id] = counts[layers][position].get(token.id, 0) + 1
    # both branches of the rule shaped the sample
    assert 0.05 < stats.num_speculative_accepted_total / stats.num_speculative_proposed_total < 0.95, stats
    p_values = [chi_square_p(counts[0][k], counts[1][k]) for k in range(4)]
    assert min(p_values) > 1e-3 / 4, p_values


def test_layer_skip_flag_and_env_twin():
    def config(argv, environ=None):
        return to_config(parse_args(["--model-id", "m", *argv], environ=environ or {}), "m")
    assert config([]).speculative_layers == 0
    assert config(["--speculate", "3", "--speculative-layers", "4"]).speculative_layers == 4
    assert config([], {"SPECULATIVE_LAYERS": "2"}).speculative_layers == 2
    for bad in ("-1", "x", "0.5"):
        with pytest.raises(SystemExit):
            parse_args(["--model-id", "m", "--speculative-layers", bad], environ={})


@pytest.mark.parametrize("overrides, message", [
    ({"speculate": 0, "speculative_layers": 1}, "set --speculate"),
    ({"speculate": 3, "speculative_layers": 2}, "use 1 to 1 (the model has 2 layers)"),
    ({"speculate": 3, "speculative_layers": 99}, "use 1 to 1 (the model has 2 layers)"),
    ({"speculate": 3, "speculative_layers": 1, "pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
])
def test_impossible_layer_skip_settings_are_refused_before_loading(overrides, message):
    with pytest.raises(ValueError, match=f"^--speculative-layers .*{message.replace('(', '.').replace(')', '.')}"):
        LLMEngine(EngineConfig(model_id=str(test_model_path("tiny-llama")), device="cpu", **overrides))
