"""Model drafters on CUDA (`gpu` marker, run by scripts/gpu_check.sh): greedy output with --speculative-layers
and --speculative-model (a draft model, Medusa heads, an EAGLE-3 draft) equal to no speculation, with decode
CUDA graphs on in the baseline."""
import pytest

torch = pytest.importorskip("torch")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from fakes import test_model_path  # noqa: E402
from test_spec_decode import assert_same, mixed_requests, summary  # noqa: E402
from test_spec_draft_model import make_draft  # noqa: E402
from test_spec_eagle3 import make_eagle3  # noqa: E402
from test_spec_medusa import make_medusa  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["layers", "draft", "medusa", "eagle3"])
def test_greedy_on_cuda_is_identical_with_model_drafts(method, tmp_path):
    target = test_model_path("tiny-llama")
    make = {"draft": make_draft, "medusa": make_medusa, "eagle3": make_eagle3}.get(method)
    spec = {"speculative_layers": 1} if make is None else \
        {"speculative_model": str(make(target, tmp_path / method))}
    results, stats = {}, None
    for drafted, config in ((False, {}), (True, {"speculate": 3, **spec})):
        with LLMEngine(EngineConfig(model_id=str(target), device="cuda", dtype="float32", **config)) as engine:
            prompts, params = mixed_requests(engine.tokenizer)
            results[drafted] = [summary([o]) for o in engine.generate(prompts, params)]
            stats = engine.stats()
    for i, p in enumerate(params):
        if not p.do_sample:
            assert_same(results[True][i], results[False][i], i)
    assert stats.num_speculative_proposed_total > 0
