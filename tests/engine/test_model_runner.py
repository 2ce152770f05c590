"""ModelRunner on one CPU rank against transformers: paged cache, prefill, chunked prefill, decode,
mixed batches, sliding window, rope scaling; greedy decoding on SmolLM2; dummy weights; misuse."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.batch import SeqSpan  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner, split_logits  # noqa: E402

TINY = ["tiny-llama", "tiny-llama-sharded", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-llama3-rope"]
BLOCK = 4


def make_runner(path, **overrides):
    settings = dict(model_id=str(path), device="cpu", block_size=BLOCK, cpu_kv_cache_bytes=2**21)
    config = EngineConfig(**{**settings, **overrides})
    return ModelRunner(config, ModelConfig.from_pretrained(path))


def hf_logits(path, sequences, device="cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        return [model(torch.tensor([seq], device=device)).logits[0] for seq in sequences]


def assert_seen_match(seen, reference, atol, name=""):
    """Every {position: logits} run_schedule saw equals the reference's row at that position."""
    for seq_id, positions in enumerate(seen):
        for pos, logits in positions.items():
            torch.testing.assert_close(logits, reference[seq_id][pos], atol=atol, rtol=0,
                                       msg=f"{name} seq {seq_id} position {pos}")


def random_sequences(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_schedule(runner, sequences):
    """Feed known tokens through prefill, chunked prefill, mixed and decode steps, with scattered
    block tables. Returns, per sequence, {position: logits} for every position the runner reported."""
    a, b, c = sequences
    blocks = list(range(1, runner.num_kv_blocks))
    random.Random(1).shuffle(blocks)  # blocks of different sequences interleave in the cache
    tables = [blocks[i::3][: -(-len(seq) // runner.block_size)] for i, seq in enumerate(sequences)]
    seen = [{} for _ in sequences]

    def step(spans):
        last, all_logits = runner.run(spans)
        reporting = [s for s in spans if s.logits != "none"]
        assert last.shape == (len(reporting), runner.model_config.vocab_size) and last.dtype == torch.float32
        for span, row in zip(reporting, last):
            seen[span.seq_id][span.start_pos + len(span.token_ids) - 1] = row
        for seq_id, rows in all_logits.items():
            span = next(s for s in spans if s.seq_id == seq_id)
            assert rows.shape[0] == len(span.token_ids)
            for i, row in enumerate(rows):
                seen[seq_id][span.start_pos + i] = row

    step([SeqSpan(0, a[:17], 0, tables[0], "all"), SeqSpan(1, b[:7], 0, tables[1], "none")])  # prefill + chunk
    step([SeqSpan(0, a[17:18], 17, tables[0]), SeqSpan(1, b[7:15], 7, tables[1], "all")])   # decode + chunk
    step([SeqSpan(0, a[18:19], 18, tables[0]), SeqSpan(1, b[15:20], 15, tables[1]),
          SeqSpan(2, c[:5], 0, tables[2], "all")])                                           # mixed
    next_pos = [19, 20, 5]
    while any(p < len(seq) for p, seq in zip(next_pos, sequences)):                         # decode
        step([SeqSpan(i, seq[p:p + 1], p, tables[i]) for i, (p, seq) in enumerate(zip(next_pos, sequences))
              if p < len(seq)])
        next_pos = [p + 1 for p in next_pos]
    return seen


def onednn_usable():
    from engine.layers import cpu_gemm

    return cpu_gemm.choose("auto", torch.device("cpu"), torch.float32) == "onednn"


def assert_logits_match(path, reference_path=None, **overrides):
    """Every position run_schedule reports equals transformers' logits (of `reference_path`, default the same
    checkpoint); returns the closed runner, whose backends the callers check."""
    sequences = random_sequences(ModelConfig.from_pretrained(path).vocab_size, [26, 23, 22])
    with make_runner(path, **overrides) as runner:
        seen = run_schedule(runner, sequences)
    assert all(len(positions) >= 10 for positions in seen)
    assert_seen_match(seen, hf_logits(reference_path or path, sequences), 1e-4, path.name)
    return runner


@pytest.mark.parametrize("gemm", ["onednn", "aten"])
@pytest.mark.parametrize("name", TINY)
def test_logits_match_transformers(model_path, name, gemm):
    if gemm == "onednn" and not onednn_usable():
        pytest.skip("this torch build has no usable oneDNN linear")
    runner = assert_logits_match(model_path(name), cpu_gemm=gemm)
    assert runner.attention_backend == "cpu_paged" and runner.device.type == "cpu"  # g++ builds it here
    assert runner.linear_backend == gemm and runner.cuda_graph_sizes == []  # graphs are for CUDA only


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-qwen3"])
def test_triton_backend_logits_match_transformers(model_path, name):
    """The Triton kernels (interpreted on this CPU) through the runner: prefill, chunks, mixed, decode."""
    runner = assert_logits_match(model_path(name), attention_backend="triton", block_size=16)
    assert runner.attention_backend == "triton"


def test_mistral_window_is_exercised(model_path):
    """The tiny Mistral's window changes its logits, so matching transformers means we apply it."""
    from transformers import AutoModelForCausalLM

    path = model_path("tiny-mistral")
    windowed = AutoModelForCausalLM.from_pretrained(path).eval()
    full = AutoModelForCausalLM.from_pretrained(path, sliding_window=None).eval()
    ids = torch.tensor(random_sequences(1024, [26]))
    with torch.no_grad():
        assert (windowed(ids).logits[0, -1] - full(ids).logits[0, -1]).abs().max() > 1e-3


def greedy(runner, prompts, max_new_tokens, eos):
    """Greedy decoding of all prompts as one batch, the way the scheduler drives the runner."""
    tables = [list(range(1 + i * 16, 1 + (i + 1) * 16)) for i in range(len(prompts))]
    outputs = [[] for _ in prompts]
    spans = [SeqSpan(i, p, 0, tables[i]) for i, p in enumerate(prompts)]
    while spans:
        last, _ = runner.run(spans)
        next_spans = []
        for span, logits in zip(spans, last):
            token = int(logits.argmax())
            outputs[span.seq_id].append(token)
            length = span.start_pos + len(span.token_ids)
            if token not in eos and len(outputs[span.seq_id]) < max_new_tokens:
                next_spans.append(SeqSpan(span.seq_id, [token], length, span.block_table))
        spans = next_spans
    return outputs


QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


@pytest.fixture(scope="module")
def smollm2_greedy(model_path):
    """SmolLM2, its tokenizer, the chat prompts of QUESTIONS and transformers' greedy answers to them (10 new
    tokens at most), computed once for every backend."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                               eos_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist() for prompt in prompts]
    return path, tokenizer, prompts, expected


@pytest.mark.parametrize("backend", ["portable", pytest.param("triton", marks=pytest.mark.slow)])
def test_greedy_decoding_reproduces_transformers_generate_on_smollm2(smollm2_greedy, backend):
    path, tokenizer, prompts, expected = smollm2_greedy
    max_new_tokens = 10
    if backend == "triton":
        # The interpreter runs every program in Python (~3 s a step here): one prompt, and its first 6 tokens,
        # which end in "Paris" (a prefill and 5 decode steps through both kernels; greedy prefixes compare).
        prompts, expected, max_new_tokens = prompts[:1], [expected[0][:6]], 6
    with make_runner(path, cpu_kv_cache_bytes=64 * 2**20, attention_backend=backend, block_size=16) as runner:
        assert runner.attention_backend == backend
        ours = greedy(runner, prompts, max_new_tokens, {tokenizer.eos_token_id})
    assert ours == expected
    assert "Paris" in tokenizer.decode(ours[0])


def test_dummy_weights_need_no_checkpoint(model_path, tmp_path):
    (tmp_path / "config.json").write_bytes((model_path("tiny-qwen3") / "config.json").read_bytes())
    with make_runner(tmp_path, load_format="dummy") as runner:
        last, all_logits = runner.run([SeqSpan(7, [1, 2, 3], 0, [0], "all")])
    assert last.shape == (1, 1024) and all_logits[7].shape == (3, 1024)
    assert torch.isfinite(all_logits[7]).all() and all_logits[7].std() > 0


def test_kv_cache_is_sized_from_the_cpu_budget(model_path):
    path = model_path("tiny-llama")  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32: 512 B per token
    with make_runner(path, cpu_kv_cache_bytes=2**20) as small, make_runner(path, cpu_kv_cache_bytes=2**21) as big:
        assert small.block_size == BLOCK and small.num_kv_blocks == 2**20 // (512 * BLOCK)
        assert big.num_kv_blocks == 2 * small.num_kv_blocks


def test_span_kinds_and_edge_cases(model_path):
    with make_runner(model_path("tiny-llama")) as runner:
        last, all_logits = runner.run([])
        assert last.shape == (0, 1024) and all_logits == {}
        last, all_logits = runner.run([SeqSpan(0, [5, 6, 7], 0, [3], "none")])
        assert last.shape == (0, 1024) and all_logits == {}
        with pytest.raises(ValueError, match="block table"):
            runner.run([SeqSpan(0, [1] * 5, 0, [3], "last")])
        with pytest.raises(ValueError, match="out of range"):
            runner.run([SeqSpan(0, [1], 0, [runner.num_kv_blocks], "last")])
        with pytest.raises(ValueError, match="max_position_embeddings"):
            runner.run([SeqSpan(0, [1], 512, list(range(129)), "last")])
    with pytest.raises(RuntimeError, match="closed"):
        runner.run([SeqSpan(0, [1], 0, [0])])
    runner.close()  # idempotent


def test_bad_dtype_and_load_format_are_reported(model_path):
    path = model_path("tiny-llama")
    with pytest.raises(ValueError, match="dtype"):
        make_runner(path, dtype="int3")
    with pytest.raises(ValueError, match="load format"):
        make_runner(path, load_format="pickle")


def flash_importable():
    from engine.attention.flash import flash_function

    return flash_function("flash_attn_varlen_func") is not None


GPU_BACKENDS = ["triton", "portable", pytest.param("flash-attn", marks=pytest.mark.skipif(
    not flash_importable(), reason="neither flash_attn nor vllm_flash_attn is importable"))]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "portable"])
def test_gpu_runner_matches_transformers(model_path, backend):
    path = model_path("tiny-qwen3")
    sequences = random_sequences(1024, [26, 23, 22])
    with make_runner(path, device="cuda", dtype="float32", gpu_memory_utilization=0.05, block_size=None,
                     attention_backend=backend) as runner:
        assert runner.device.type == "cuda" and runner.attention_backend == backend
        seen = run_schedule(runner, sequences)
    assert_seen_match(seen, hf_logits(path, sequences, "cuda"), 2e-3)


def gpu_schedule(path, **overrides):
    """run_schedule on a bf16 runner on the GPU; returns what it saw and the CUDA graphs captured."""
    sequences = random_sequences(1024, [26, 23, 22])
    settings = dict(device="cuda", dtype="bfloat16", block_size=None, gpu_memory_utilization=0.05)
    with make_runner(path, **{**settings, **overrides}) as runner:
        return run_schedule(runner, sequences), runner.cuda_graph_sizes


def assert_schedules_agree(seen, reference):
    for ours, theirs in zip(seen, reference):
        for pos in theirs:
            torch.testing.assert_close(ours[pos], theirs[pos], atol=5e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", GPU_BACKENDS[2]])
def test_gpu_backend_matches_portable(model_path, backend):
    """Eager (no graphs) so the mixed-batch kernels run for decode steps too; tiny-mistral has a window."""
    path = model_path("tiny-mistral")
    fast, _ = gpu_schedule(path, attention_backend=backend, cuda_graphs=[])
    portable, _ = gpu_schedule(path, attention_backend="portable")
    assert_schedules_agree(fast, portable)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", GPU_BACKENDS[2]])
def test_gpu_decode_graphs_match_eager(model_path, backend):
    path = model_path("tiny-mistral")
    graphed, sizes = gpu_schedule(path, attention_backend=backend, cuda_graphs=[1, 2, 4])
    assert sizes == [1, 2, 4]  # captured and past the self-check
    eager, sizes = gpu_schedule(path, attention_backend=backend, cuda_graphs=[])
    assert sizes == []
    assert_schedules_agree(graphed, eager)


@pytest.mark.gpu
def test_gpu_graphs_are_on_by_default_without_flash_attn(model_path):
    if flash_importable():
        pytest.skip("flash-attn is importable here: auto picks it")
    with make_runner(model_path("tiny-llama"), device="cuda", dtype="bfloat16", block_size=None,
                     gpu_memory_utilization=0.05, max_batch_size=8) as runner:
        assert runner.attention_backend == "triton" and runner.cuda_graph_sizes == [1, 2, 4, 8]


def test_split_logits_rows_of_each_span():
    logits = torch.arange(12.0).reshape(6, 2)
    decode = [SeqSpan(i, [1], 3, [0]) for i in range(3)]
    rows, all_rows = split_logits(decode, logits[:3])
    assert rows.data_ptr() == logits.data_ptr() and rows.shape == (3, 2) and all_rows == {}  # a decode: no copy
    mixed = [SeqSpan(0, [1, 2, 3], 0, [0], "all"), SeqSpan(1, [4, 5], 0, [1], "none"), SeqSpan(2, [6], 4, [2])]
    rows, all_rows = split_logits(mixed, logits[:4])
    assert rows.tolist() == [[4.0, 5.0], [6.0, 7.0]] and all_rows[0].tolist() == logits[:3].tolist()
    rows, _ = split_logits(decode[:2], logits[::2][:2])  # strided rows are copied
    assert rows.is_contiguous() and rows.tolist() == [[0.0, 1.0], [4.0, 5.0]]
