"""On a GPU: greedy generations on the real SmolLM2 through the whole engine are the same with every
attention backend this machine can run (Triton with decode CUDA graphs, flash-attn if importable)
as with the portable torch path. fp32, where kernels agree to ~1e-6 and argmax ties are rare."""
import pytest

torch = pytest.importorskip("torch")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import apply_chat_template  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List the first five prime numbers.",
             "Explain what a GPU is in one sentence.", "Translate 'good morning' into French and Spanish."]


def greedy(path, backend, dtype, **config):
    settings = dict(model_id=str(path), device="cuda", dtype=dtype, attention_backend=backend,
                    gpu_memory_utilization=0.2)
    with LLMEngine(EngineConfig(**{**settings, **config})) as engine:
        prompts = [apply_chat_template(engine.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
        params = SamplingParams(max_new_tokens=48)  # greedy
        results = engine.generate(prompts, params)
        return [[t.id for t in r.tokens] for r in results], engine.runner.cuda_graph_sizes


@pytest.fixture(scope="module")
def smollm2(model_path):
    try:
        return model_path("smollm2")
    except FileNotFoundError as error:  # no GGUF on this machine (see TGI_HPC_SMOLLM2_GGUF)
        pytest.skip(str(error))


@pytest.mark.gpu
def test_gpu_greedy_equal_across_backends_on_smollm2(smollm2):
    from engine.attention.flash import FlashBackend

    reference, _ = greedy(smollm2, "portable", "float32")
    triton, graphs = greedy(smollm2, "triton", "float32")
    assert graphs, "decode CUDA graphs were not captured on the Triton backend"
    assert triton == reference
    eager, graphs = greedy(smollm2, "triton", "float32", cuda_graphs=[])
    assert not graphs and eager == reference
    if FlashBackend.unavailable_reason(torch.device("cuda"), torch.bfloat16) is None:
        flash, _ = greedy(smollm2, "flash-attn", "bfloat16")
        portable_bf16, _ = greedy(smollm2, "portable", "bfloat16")
        same = sum(a == b for a, b in zip(flash, portable_bf16))
        assert same >= len(QUESTIONS) - 1  # bf16 kernels may split one argmax tie differently
