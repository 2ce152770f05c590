"""--speculative-model: a smaller draft with the target's tokenizer, its KV in the same blocks; greedy output
equal to no speculation (batch 1 and 16 mixed requests), the sampled distribution kept, the block budget
shared, and clear refusals (another tokenizer, no snapshot, conflicting flags)."""
import json
import shutil

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.launcher import parse_args, to_config  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import chi_square_p, compare_greedy, real_engine  # noqa: E402


def make_draft(target, path, num_layers=1, scale=1.0):
    """The target's tokenizer and first `num_layers` layers (perturbed by `scale`), saved as its own snapshot."""
    path.mkdir()
    for name in target.iterdir():
        if name.name != "model.safetensors":
            shutil.copy(name, path / name.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config))
    tensors = {name: tensor * scale if "layers." in name else tensor
               for name, tensor in load_file(target / "model.safetensors").items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_draft(test_model_path("tiny-llama"), tmp_path_factory.mktemp("draft") / "tiny-llama-1")


def test_greedy_with_a_draft_model_is_identical_and_its_kv_shares_the_budget(draft):
    base, stats = compare_greedy("tiny-llama", {"speculative_model": str(draft)})
    assert stats.speculative_method == "draft"
    # a 1-layer draft beside 2 layers: 2/3 the blocks
    assert stats.num_total_blocks * 3 == pytest.approx(base.num_total_blocks * 2, rel=0.01)


def test_sampled_token_distribution_is_kept_with_a_draft_model(draft):
    num_draws = 200
    params = [SamplingParams(do_sample=True, seed=seed, temperature=1.0, top_k=4, max_new_tokens=4,
                             ignore_eos=True) for seed in range(num_draws)]
    counts = {}
    for use_draft in (False, True):
        config = {"speculate": 3, "speculative_model": str(draft)} if use_draft else {}
        with real_engine("tiny-llama", **config) as engine:
            outs = engine.generate([engine.tokenizer.encode("one two three")] * num_draws, params)
            stats = engine.stats()
        counts[use_draft] = [{} for _ in range(4)]
        for out in outs:
            for position, token in enumerate(out.tokens):
                counts[use_draft][position][token.id] = counts[use_draft][position].get(token.id, 0) + 1
    assert 0.05 < stats.num_speculative_accepted_total / stats.num_speculative_proposed_total < 0.95, stats
    p_values = [chi_square_p(counts[False][k], counts[True][k]) for k in range(4)]
    assert min(p_values) > 1e-3 / 4, p_values


def test_speculative_model_flag():
    config = to_config(parse_args(["--model-id", "m", "--speculate", "2", "--speculative-model", "/d"], environ={}),
                       "m")
    assert config.speculative_model == "/d"
    assert to_config(parse_args(["--model-id", "m"], environ={}), "m").speculative_model is None
    from_env = to_config(parse_args(["--model-id", "m"], environ={"SPECULATIVE_MODEL": "/e"}), "m")
    assert from_env.speculative_model == "/e"


def refusal(tmp_path, draft, case):
    if case == "tokenizer":
        return {"speculate": 3, "speculative_model": str(test_model_path("smollm2"))}, "has another tokenizer"
    if case == "missing":
        return {"speculate": 3, "speculative_model": str(tmp_path / "no such; dir")}, "no config.json there"
    if case == "no speculate":
        return {"speculative_model": str(draft)}, "set --speculate"
    if case == "both":
        return {"speculate": 3, "speculative_model": str(draft), "speculative_layers": 1}, "pick one"
    short = make_draft(test_model_path("tiny-llama"), tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 8
    (short / "config.json").write_text(json.dumps(config))
    return {"speculate": 3, "speculative_model": str(short)}, "lower --max-total-tokens"


@pytest.mark.parametrize("case", ["tokenizer", "missing", "no speculate", "both", "short context"])
def test_a_draft_the_target_cannot_verify_is_refused_at_start_up(tmp_path, draft, case):
    overrides, message = refusal(tmp_path, draft, case)
    with pytest.raises(ValueError, match=f"^--speculative-(model|layers).*{message}"):
        LLMEngine(EngineConfig(model_id=str(test_model_path("tiny-llama")), device="cpu", **overrides))


def test_a_draft_equal_to_the_target_is_always_accepted(tmp_path):
    # every layer: the draft is the target, so a greedy draft is its argmax, provided the draft's own KV holds
    # every computed token (prefill chunks, accepted drafts, bonus tokens) at the right slots
    copy = make_draft(test_model_path("tiny-llama"), tmp_path / "copy", num_layers=2)
    with real_engine("tiny-llama", speculate=3, speculative_model=str(copy), max_batch_prefill_tokens=16) as engine:
        prompts = [engine.tokenizer.encode(text * n) for text, n in (("one two three", 3), ("Hello world", 1))]
        engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
        stats = engine.stats()
    assert stats.num_speculative_proposed_total > 20
    assert stats.num_speculative_accepted_total >= 0.95 * stats.num_speculative_proposed_total, stats


def test_greedy_with_two_shards_and_a_draft_model_is_identical(draft):
    # the draft is sharded over the target's ranks like the target
    compare_greedy("tiny-llama", {"speculative_model": str(draft), "num_shard": 2}, {"num_shard": 1}, count=6)
