"""The fused CPU decode step (engine/cpu_decode_step.py): chosen for Llama-layout models, the same greedy tokens as
transformers and as the eager model on real and tiny models (decode batches under and over its row limit, mixed
with prefill chunks), its logits close to the eager forward's, and eager with the reason wherever it does not
apply or disagrees."""
import pytest

torch = pytest.importorskip("torch")

from engine import cpu_decode_step, huge_pages  # noqa: E402
from engine.batch import SeqSpan  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kernels.cpp_build import compiler  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) here")
GREEDY_12 = SamplingParams(max_new_tokens=12, ignore_eos=True)


def engine(name, **config):
    config.setdefault("cpu_kv_cache_bytes", 32 * 1024**2)
    config.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model_id=str(test_model_path(name)), device="cpu", **config))


def prompts_for(vocab, count):
    """`count` prompts of 1-40 tokens: more sequences than the step's row limit, of every length."""
    return [[(17 * i + 5 * j) % (vocab - 10) + 5 for j in range(1 + (7 * i) % 40)] for i in range(count)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama3-rope"])
def test_fused_step_gives_the_eager_and_transformers_tokens(name):
    from transformers import AutoModelForCausalLM

    with engine(name, enforce_eager=True) as eager:
        assert eager.runner.decode_step_report == "eager (--enforce-eager)"
        prompts = prompts_for(eager.model_config.vocab_size, 2 * cpu_decode_step.MAX_ROWS + 3)
        want = [[t.id for t in out.tokens] for out in eager.generate(prompts, GREEDY_12)]
    with engine(name) as fused:
        assert fused.runner.decode_step_report.startswith("fused"), fused.runner.decode_step_report
        got = [[t.id for t in out.tokens] for out in fused.generate(prompts, GREEDY_12)]
    assert got == want
    model = AutoModelForCausalLM.from_pretrained(test_model_path(name), dtype=torch.float32).eval()
    for ids, tokens in list(zip(prompts, got))[:3]:
        reference = hf_greedy(model, ids, 12)
        assert tokens[:len(reference)] == reference


def bfloat16_checkpoint(name, directory):
    """`name` saved in bfloat16 (as most Hub checkpoints are), tokenizer and all."""
    import shutil

    from transformers import AutoModelForCausalLM

    source = test_model_path(name)
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(torch.bfloat16).save_pretrained(directory)
    for path in source.iterdir():
        if "token" in path.name or path.name.endswith(".jinja"):
            shutil.copy(path, directory / path.name)
    return directory


def test_a_bfloat16_checkpoint_served_in_float32_streams_bfloat16_weights_with_the_same_tokens_and_logprobs(
        tmp_path, monkeypatch):
    """Its float32 weights are bfloat16 values: the fused step packs them in bfloat16 (half the bytes), and its
    tokens and logprobs are those of float32 packing bit for bit, and the eager model's tokens."""
    from engine.kernels import cpu_gemv

    path = bfloat16_checkpoint("tiny-llama", tmp_path / "bf16")
    prompts = prompts_for(1000, 2 * cpu_decode_step.MAX_ROWS + 3)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True)

    def run(**config):
        with LLMEngine(EngineConfig(model_id=str(path), device="cpu", dtype="float32",
                                    cpu_kv_cache_bytes=32 * 1024**2, **config)) as llm:
            report = llm.runner.decode_step_report
            outs = llm.generate(prompts, params)
            step = llm.runner._rank0.decode_step
            return report, step, [[(t.id, t.logprob) for t in out.tokens] for out in outs]

    report, step, narrow = run()
    assert report.startswith("fused") and "bfloat16" in report, report
    assert step.weight_dtype == torch.bfloat16 and step.head_dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in step._keep if t.dim() == 3)
    assert step.packed_bytes * 2 <= cpu_decode_step.CpuDecodeStep.copy_bytes(step.model) + 4096
    monkeypatch.setattr(cpu_gemv, "storage_dtype", lambda weight: torch.float32)
    report, step, wide = run()
    assert "float32" in report and step.weight_dtype == torch.float32
    assert narrow == wide
    monkeypatch.undo()
    _, _, eager = run(enforce_eager=True)
    assert [[i for i, _ in row] for row in narrow] == [[i for i, _ in row] for row in eager]


def test_a_bfloat16_model_decodes_fused_in_float32_over_its_bfloat16_weights_and_cache(tmp_path):
    """dtype bfloat16: the step keeps the model's bfloat16 weights (packed) and K/V cache, its activations in float32;
    its tokens follow the eager bfloat16 model's, its hidden states within bfloat16 rounding of the eager forward's,
    and a model whose element-wise kernels are turned off stays eager."""
    path = bfloat16_checkpoint("tiny-llama", tmp_path / "bf16")
    prompts = prompts_for(1000, 2 * cpu_decode_step.MAX_ROWS + 3)
    outputs = {}
    for eager in (True, False):
        with LLMEngine(EngineConfig(model_id=str(path), device="cpu", dtype="bfloat16", enforce_eager=eager,
                                    cpu_kv_cache_bytes=32 * 1024**2)) as llm:
            report = llm.runner.decode_step_report
            assert report.startswith("eager" if eager else "fused"), report
            if not eager:
                step = llm.runner._rank0.decode_step
                assert step.weight_dtype == torch.bfloat16 and step.kv_dtype == torch.bfloat16
                assert step.shape.kv_bf16 == 1 and "bfloat16 model's K/V" in report
            outputs[eager] = [[t.id for t in out.tokens] for out in llm.generate(prompts, GREEDY_12)]
    # bfloat16 rounding in the eager layers can tip a near-tie: most sequences, not all, must agree throughout
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    assert same >= 0.8 * len(prompts), same
    with LLMEngine(EngineConfig(model_id=str(path), device="cpu", dtype="bfloat16", cpu_elementwise="aten",
                                cpu_kv_cache_bytes=32 * 1024**2)) as llm:
        assert "fused element-wise kernels" in llm.runner.decode_step_report


def test_float32_weights_that_are_not_bfloat16_values_stay_float32():
    with engine("tiny-llama") as fused:
        report = fused.runner.decode_step_report
        assert report.startswith("fused") and "float32" in report, report
        assert fused.runner._rank0.decode_step.weight_dtype == torch.float32


def test_smollm2_decode_logits_match_the_eager_forward():
    """Real weights: a prompt's prefill, then decode steps of 1 and of 16 sequences over scattered blocks, logits
    of both paths within float32 reordering."""
    path = test_model_path("smollm2")
    results = []
    for eager in (True, False):
        config = EngineConfig(model_id=str(path), device="cpu", block_size=16, cpu_kv_cache_bytes=128 * 2**20,
                              enforce_eager=eager)
        with ModelRunner(config, ModelConfig.from_pretrained(path)) as runner:
            assert runner.decode_step_report.startswith("eager" if eager else "fused")
            head = runner._rank0.model.lm_head
            assert (head.few_rows_weight is None) == eager
            if not eager:  # the packed weights (tens of MiB each) sit on 2 MiB pages (engine/huge_pages.py)
                packed = [t for t in runner._rank0.decode_step._keep if t.numel() * 4 >= huge_pages.HUGE_PAGE]
                packed.append(head.few_rows_weight)
                assert len(packed) > 1 and all(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for t in packed)
                # the LM head: the GEMV up to FEW_ROWS rows, oneDNN above, the same logits either way
                weight = head.weight.detach()
                for rows in (1, head.FEW_ROWS, head.FEW_ROWS + 1):
                    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
                    torch.testing.assert_close(head(x), x @ weight.T, atol=1e-4, rtol=1e-4)
            seqs = [[(31 * i + 7 * j) % 40000 + 100 for j in range(20 + 9 * i)] for i in range(16)]
            # each sequence's blocks in reverse order: never one run of blocks lying one after another
            tables = [list(range(2 + 10 * i, 2 + 10 * i + -(-(len(seq) + 1) // 16)))[::-1]
                      for i, seq in enumerate(seqs)]
            runner.run([SeqSpan(i, seq, 0, tables[i]) for i, seq in enumerate(seqs)])
            step1, _ = runner.run([SeqSpan(3, [901], len(seqs[3]), tables[3])])
            step16, _ = runner.run([SeqSpan(i, [900 + i], len(seq), tables[i]) for i, seq in enumerate(seqs)])
            results.append((step1, step16))
    for eager_logits, fused_logits in zip(*results):
        torch.testing.assert_close(fused_logits, eager_logits, atol=2e-3, rtol=0)
        assert torch.equal(fused_logits.argmax(-1), eager_logits.argmax(-1))


@pytest.mark.parametrize("name,config,reason", [
    ("tiny-qwen3", {}, "not the Llama layout"),                  # q/k norm
    ("tiny-mistral", {}, "sliding windows"),
    ("tiny-gemma2", {}, "not the Llama layout"),                 # Gemma's (1 + w) norms, sandwich layout
    ("tiny-gemma", {}, "not a native decoder"),                  # on the transformers backend
    ("tiny-mixtral", {}, "a layer outside the Llama layout"),    # MoE
    ("tiny-llama", {"dtype": "float16"}, "dtype torch.float16"),
    ("tiny-llama", {"attention_backend": "portable"}, "cpu_paged"),
    ("tiny-llama", {"enforce_eager": True}, "--enforce-eager"),
])
def test_where_it_does_not_apply_the_engine_stays_eager_and_says_why(name, config, reason):
    with engine(name, **config) as eager:
        report = eager.runner.decode_step_report
        assert report.startswith("eager (") and reason in report, report
        ids = prompts_for(eager.model_config.vocab_size, 2)
        assert all(len(out.tokens) == 3 for out in eager.generate(ids, SamplingParams(max_new_tokens=3,
                                                                                         ignore_eos=True)))


def test_a_step_that_disagrees_with_the_eager_forward_is_not_used(monkeypatch):
    run = cpu_decode_step.CpuDecodeStep.run
    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "run", lambda self, inputs: run(self, inputs) + 0.5)
    with engine("tiny-llama") as eager:
        assert "disagrees with the eager forward" in eager.runner.decode_step_report
        assert eager.runner._rank0.decode_step is None


def test_a_weight_copy_over_its_share_of_memory_is_not_made(monkeypatch):
    monkeypatch.setattr(cpu_decode_step, "COPY_SHARE", 1e-9)
    with engine("tiny-llama") as eager:
        assert "of the memory budget" in eager.runner.decode_step_report


def test_enforce_eager_is_a_launcher_flag_with_its_environment_twin_and_passes_through_serve():
    from engine.launcher import parse_args, to_config
    from tgi_hpc.workflows.engine_flags import engine_args

    assert to_config(parse_args(["--model-id", "m", "--enforce-eager"]), "m").enforce_eager is True
    assert to_config(parse_args(["--model-id", "m"], {"ENFORCE_EAGER": "true"}), "m").enforce_eager is True
    assert to_config(parse_args(["--model-id", "m"], {}), "m").enforce_eager is False
    assert engine_args(["--enforce-eager"]) == ["--enforce-eager"]
