"""LLMEngine: generation semantics over a fake runner, then token-for-token equality with
transformers' generate() over the real ModelRunner (fp32, CPU)."""
import threading

import pytest

torch = pytest.importorskip("torch")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import CPU_PREFILL_TOKENS, LLMEngine, resolve_limits  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import FakeModelConfig, FakeRunner, fake_logits, reference_greedy, test_model_path  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

VOCAB = 1024


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(test_model_path("tiny-llama"))


def make_engine(tokenizer, num_kv_blocks=256, block_size=4, **config):
    runner = FakeRunner(VOCAB, num_kv_blocks, block_size)
    engine = LLMEngine(EngineConfig(**config), runner=runner, model_config=FakeModelConfig(VOCAB, 512),
                       tokenizer=tokenizer)
    return engine, runner


def prompt(i, length):
    return [(7 * i + 3 * j) % 900 + 10 for j in range(length)]


def run_streams(engine, max_steps=10_000):
    """Step to completion; request_id -> list of RequestOutputs."""
    streams = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return streams
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def tokens_of(outputs):
    return [t.id for out in outputs for t in out.tokens]


# fake runner: scheduling and generation semantics
def test_concurrent_mixed_requests_with_preemption_match_the_reference(tokenizer):
    # 32 blocks of 4 tokens for 24 requests of up to ~100 tokens: preemption must happen
    engine, _ = make_engine(tokenizer, num_kv_blocks=32, max_batch_prefill_tokens=32, max_total_tokens=128)
    prompts = {f"r{i}": prompt(i, 3 + (i * 11) % 37) for i in range(24)}
    new_tokens = {f"r{i}": 1 + (i * 13) % 60 for i in range(24)}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_new_tokens=new_tokens[rid]))
    streams = run_streams(engine)
    stats = engine.stats()
    assert stats.num_preempted_total > 0
    for rid, ids in prompts.items():
        expected = reference_greedy(ids, new_tokens[rid], VOCAB, engine.eos_token_ids)
        assert tokens_of(streams[rid]) == expected, rid
        assert streams[rid][-1].finished and all(not o.finished for o in streams[rid][:-1])
    assert stats.num_free_blocks == stats.num_total_blocks == 32
    assert stats.num_running == stats.num_waiting == 0


def test_streamed_text_adds_up_to_generated_text_and_counts(tokenizer):
    engine, _ = make_engine(tokenizer)
    ids = tokenizer.encode("Tell me about café culture")
    engine.add_request("a", ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    outputs = run_streams(engine)["a"]
    final = outputs[-1]
    assert "".join(o.text for o in outputs) == final.generated_text
    assert final.finish_reason == "length" and final.num_generated_tokens == 12
    assert final.num_prompt_tokens == len(ids)
    assert final.seed is None                      # greedy
    generated = tokens_of(outputs)
    assert final.generated_text == tokenizer.decode(ids + generated, skip_special_tokens=True)[
        len(tokenizer.decode(ids, skip_special_tokens=True)):]
    assert [t.text for o in outputs for t in o.tokens] == [tokenizer.decode([t]) for t in generated]


def test_decode_loop_gives_the_outputs_of_the_general_append(tokenizer):
    """_append_one_each (every decode step's loop) against _append_run per row, output for output: EOS,
    length, stop strings (hit or not), top_n_tokens, logprobs off, prefill logprobs, seeded sampling."""
    def requests():
        yield "plain", SamplingParams(max_new_tokens=9)
        yield "eos", SamplingParams(max_new_tokens=30)
        yield "ignore", SamplingParams(max_new_tokens=7, ignore_eos=True)
        yield "stop", SamplingParams(max_new_tokens=30, stop=["e", "zzq"])
        yield "stop2", SamplingParams(max_new_tokens=30, stop=["th", "in"], top_n_tokens=2)
        yield "nolp", SamplingParams(max_new_tokens=5, logprobs=False)
        yield "prefill", SamplingParams(max_new_tokens=6, prefill_logprobs=True, top_n_tokens=3)
        yield "seeded", SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.7, seed=3, stop=["a"])
        yield "one", SamplingParams(max_new_tokens=1)

    runs = []
    for general in (False, True):
        engine, _ = make_engine(tokenizer, max_total_tokens=64)
        engine.eos_token_ids = {reference_greedy(prompt(1, 8), 10, VOCAB)[4]}
        if general:
            engine._append_one_each = lambda seqs, out: [engine._append_run(seq, out, (j,))
                                                         for j, seq in enumerate(seqs)]
        for i, (rid, params) in enumerate(requests()):
            engine.add_request(rid, prompt(1 if rid == "eos" else i, 8), params)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
        runs.append(steps)
    assert runs[0] == runs[1]
    finals = {out.request_id: out for step in runs[0] for out in step if out.finished}
    assert finals["eos"].finish_reason == "eos_token" and finals["one"].finish_reason == "length"
    assert "stop_sequence" in {finals[r].finish_reason for r in ("stop", "stop2", "seeded")}
    assert finals["nolp"].finish_reason == "length"


def test_greedy_batch_gives_the_outputs_of_the_general_sampler(tokenizer, monkeypatch):
    """A greedy-only batch (argmax and chosen logprob per chunk of rows, then the decode loop) against the
    general sampler path and _append_run per row, output for output: EOS as the first token, max_new_tokens 1,
    a stop string split across two tokens, logprobs off, preemption, an abort mid-batch."""
    import engine.sampler as sampler
    split_prompt = prompt(5, 8)
    texts = [tokenizer.decode([t]) for t in reference_greedy(split_prompt, 12, VOCAB)]
    k = next(k for k in range(1, 11) if texts[k].strip() and texts[k + 1].strip())
    split = texts[k][-1] + texts[k + 1][0]      # ends one token's text, starts the next one's
    first_eos = reference_greedy(prompt(1, 8), 1, VOCAB)[0]     # "eos-first" is request 1

    def requests():
        yield "plain", SamplingParams(max_new_tokens=9)
        yield "eos-first", SamplingParams(max_new_tokens=9)
        yield "one", SamplingParams(max_new_tokens=1)
        yield "split", SamplingParams(max_new_tokens=12, stop=[split])
        yield "nolp", SamplingParams(max_new_tokens=6, logprobs=False)
        yield "aborted", SamplingParams(max_new_tokens=40)
        for i in range(6):
            yield f"long{i}", SamplingParams(max_new_tokens=30, ignore_eos=True)

    runs = []
    for general in (False, True):
        engine, _ = make_engine(tokenizer, num_kv_blocks=40, max_total_tokens=64)
        engine.eos_token_ids = {first_eos}
        monkeypatch.setattr(sampler, "GREEDY_CHUNK", 3 * VOCAB)     # chunks of 3 rows, the last one short
        if general:
            monkeypatch.setattr(sampler, "_changes_scores", lambda p: True)   # process + report, whole batch
            engine._append_one_each = lambda seqs, out: [engine._append_run(seq, out, (j,))
                                                         for j, seq in enumerate(seqs)]
        for i, (rid, params) in enumerate(requests()):
            engine.add_request(rid, split_prompt if rid == "split" else prompt(i, 8), params)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
            if len(steps) == 4:
                engine.abort("aborted")
        runs.append((steps, engine.stats().num_preempted_total))
        monkeypatch.undo()
    assert runs[0] == runs[1]
    assert runs[0][1] > 0
    finals = {out.request_id: out for step in runs[0][0] for out in step if out.finished}
    assert finals["eos-first"].finish_reason == "eos_token" and finals["eos-first"].num_generated_tokens == 1
    assert finals["one"].finish_reason == "length" and finals["one"].num_generated_tokens == 1
    assert finals["split"].finish_reason == "stop_sequence" and finals["split"].stop_text.startswith(split)
    assert finals["aborted"].finish_reason == "aborted"
    lps = [t.logprob for step in runs[0][0] for out in step if out.request_id == "plain" for t in out.tokens]
    assert lps and all(lp is not None and lp < 0 for lp in lps)
    assert all(t.logprob is None for step in runs[0][0] for out in step if out.request_id == "nolp"
               for t in out.tokens)


def test_eos_ends_generation_unless_ignored(tokenizer):
    engine, _ = make_engine(tokenizer)
    ids = prompt(1, 8)
    expected = reference_greedy(ids, 10, VOCAB)
    engine.eos_token_ids = {expected[3]} - set(expected[:3])
    engine.add_request("stop", ids, SamplingParams(max_new_tokens=10))
    engine.add_request("ignore", ids, SamplingParams(max_new_tokens=10, ignore_eos=True))
    streams = run_streams(engine)
    assert tokens_of(streams["stop"]) == expected[:4]
    assert streams["stop"][-1].finish_reason == "eos_token"
    assert tokens_of(streams["ignore"]) == expected
    assert streams["ignore"][-1].finish_reason == "length"


def test_stop_sequence_across_tokens_cuts_the_text(tokenizer):
    engine, _ = make_engine(tokenizer)
    ids = tokenizer.encode("Once upon a time")
    engine.add_request("full", ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
    full = run_streams(engine)["full"][-1].generated_text
    pieces = [tokenizer.decode([t]) for t in reference_greedy(ids, 16, VOCAB)]
    # a stop string that starts inside token 3 and ends inside token 5
    start = sum(len(p) for p in pieces[:3]) - 1
    stop = full[start:start + len(pieces[3]) + 2]
    assert full.find(stop) == start and "\ufffd" not in stop
    engine.add_request("cut", ids, SamplingParams(max_new_tokens=16, ignore_eos=True, stop=[stop]))
    outputs = run_streams(engine)["cut"]
    assert outputs[-1].finish_reason == "stop_sequence"
    assert outputs[-1].generated_text == full[:start]
    assert "".join(o.text for o in outputs) == full[:start]
    assert len(tokens_of(outputs)) < 16


def test_max_total_tokens_ends_with_length(tokenizer):
    engine, _ = make_engine(tokenizer, max_total_tokens=20)
    assert engine.max_input_tokens == 19 and engine.max_batch_prefill_tokens == 69
    engine.add_request("a", prompt(2, 15), SamplingParams(max_new_tokens=100, ignore_eos=True))
    final = run_streams(engine)["a"][-1]
    assert final.finish_reason == "length" and final.num_generated_tokens == 5
    with pytest.raises(ValueError, match="max_input_tokens"):
        engine.add_request("b", prompt(2, 20), SamplingParams())


def test_invalid_requests_are_refused_at_once(tokenizer):
    engine, _ = make_engine(tokenizer)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("a", [VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("a", [5], SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="top_n_tokens"):
        engine.add_request("a", [5], SamplingParams(top_n_tokens=6))
    with pytest.raises(ValueError, match="stop sequences"):
        engine.add_request("a", [5], SamplingParams(stop=["a", "b", "c", "d", "e"]))
    with pytest.raises(ValueError, match="max_input_tokens"):   # generate() adds all or nothing
        engine.generate([[5], [5] * 600])
    assert not engine.has_unfinished_requests()
    engine.add_request("a", [5], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [6], SamplingParams())


def test_abort_emits_a_final_output_and_frees_blocks(tokenizer):
    engine, _ = make_engine(tokenizer, num_kv_blocks=64)
    engine.add_request("keep", prompt(3, 9), SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.add_request("drop", prompt(4, 9), SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.add_request("queued", prompt(5, 9), SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort("drop")
    engine.abort("unknown")                         # ignored
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["drop"].finished and outputs["drop"].finish_reason == "aborted"
    assert outputs["drop"].generated_text is not None
    streams = run_streams(engine)
    assert "drop" not in streams
    assert streams["keep"][-1].num_generated_tokens == 30
    assert engine.stats().num_free_blocks == 64


def test_abort_and_add_from_another_thread_while_stepping(tokenizer):
    engine, _ = make_engine(tokenizer)
    for i in range(8):
        engine.add_request(f"r{i}", prompt(i, 10), SamplingParams(max_new_tokens=200, ignore_eos=True))
    finals, done = {}, threading.Event()

    def client():
        for i in range(8):
            engine.abort(f"r{i}")
            engine.add_request(f"n{i}", prompt(i, 5), SamplingParams(max_new_tokens=3, ignore_eos=True))
        done.set()

    thread = threading.Thread(target=client)
    thread.start()
    while not done.is_set() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    thread.join()
    assert {rid for rid, o in finals.items() if o.finish_reason == "aborted"} == {f"r{i}" for i in range(8)}
    assert all(finals[f"n{i}"].num_generated_tokens == 3 for i in range(8))
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_prefill_logprobs_across_chunks(tokenizer):
    engine, _ = make_engine(tokenizer, max_batch_prefill_tokens=5)
    ids = prompt(6, 13)
    engine.add_request("a", ids, SamplingParams(max_new_tokens=2, prefill_logprobs=True, top_n_tokens=3))
    outputs = run_streams(engine)["a"]
    prefill = outputs[0].prefill_tokens
    assert [t.id for t in prefill] == ids
    assert prefill[0].logprob is None
    for i in range(1, len(ids)):
        expected = torch.log_softmax(fake_logits(ids[:i], VOCAB), -1)[ids[i]]
        assert prefill[i].logprob == pytest.approx(float(expected), abs=1e-5)
    assert all(o.prefill_tokens is None for o in outputs[1:])
    for i in range(1, len(ids)):  # the prompt's alternatives too (OpenAI echo + logprobs: k)
        top = torch.log_softmax(fake_logits(ids[:i], VOCAB), -1).topk(3)
        assert [t.id for t in prefill[i].top_tokens] == top.indices.tolist()
        assert [t.logprob for t in prefill[i].top_tokens] == pytest.approx(top.values.tolist(), abs=1e-5)
    first = outputs[0].tokens[0]
    assert first.logprob == pytest.approx(float(torch.log_softmax(fake_logits(ids, VOCAB), -1).max()), abs=1e-5)
    assert [t.id for t in first.top_tokens][0] == first.id and len(first.top_tokens) == 3


def test_prefill_logprobs_survive_preemption_mid_prefill(tokenizer):
    engine, runner = make_engine(tokenizer, num_kv_blocks=10, max_batch_prefill_tokens=2, max_total_tokens=40)
    # "old" holds 3 of the 10 blocks; "new" needs 6 for its prompt, so it is admitted (with a block to spare
    # for old), but its prefill takes 12 steps while old grows past the spare block: new is preempted
    engine.add_request("old", prompt(1, 8), SamplingParams(max_new_tokens=30, ignore_eos=True))
    while not engine.step():
        pass
    ids = prompt(2, 24)
    engine.add_request("new", ids, SamplingParams(max_new_tokens=1, ignore_eos=True, prefill_logprobs=True))
    streams = run_streams(engine)
    new_id = max(span.seq_id for call in runner.calls for span in call)
    restarts = [span for call in runner.calls for span in call if span.seq_id == new_id and span.start_pos == 0]
    assert len(restarts) >= 2                # preempted during its chunked prefill, then started over
    prefill = streams["new"][0].prefill_tokens
    assert [t.id for t in prefill] == ids
    expected = [float(torch.log_softmax(fake_logits(ids[:i], VOCAB), -1)[ids[i]]) for i in range(1, len(ids))]
    assert [t.logprob for t in prefill[1:]] == pytest.approx(expected, abs=1e-5)
    assert tokens_of(streams["old"])[-29:] == reference_greedy(prompt(1, 8), 30, VOCAB)[-29:]


def test_seeded_sampling_is_reproducible_and_seeds_are_reported(tokenizer):
    engine, _ = make_engine(tokenizer)
    params = SamplingParams(do_sample=True, seed=1234, max_new_tokens=10, ignore_eos=True, top_p=0.9)
    engine.add_request("a", prompt(7, 6), params)
    engine.add_request("noise", prompt(8, 9), SamplingParams(do_sample=True, max_new_tokens=10))
    first = run_streams(engine)
    engine.add_request("b", prompt(7, 6), params)
    second = run_streams(engine)
    assert tokens_of(first["a"]) == tokens_of(second["b"])
    assert first["a"][-1].seed == 1234
    assert isinstance(first["noise"][-1].seed, int)


def test_prefix_cache_reuses_blocks_and_gives_the_same_tokens(tokenizer):
    engine, runner = make_engine(tokenizer)
    ids = prompt(9, 22)
    engine.add_request("a", ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
    a = tokens_of(run_streams(engine)["a"])
    runner.calls.clear()
    engine.add_request("b", ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
    b = tokens_of(run_streams(engine)["b"])
    assert a == b == reference_greedy(ids, 5, VOCAB)
    assert runner.calls[0][0].start_pos == 20      # 5 cached blocks of 4


def test_cached_tokens_and_counters(tokenizer):
    engine, _ = make_engine(tokenizer)
    ids = prompt(10, 22)
    engine.add_request("a", ids, SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.add_request("b", prompt(11, 9), SamplingParams(max_new_tokens=2, ignore_eos=True, prefill_logprobs=True))
    first = run_streams(engine)
    engine.add_request("c", ids, SamplingParams(max_new_tokens=3, ignore_eos=True))
    again = run_streams(engine)["c"]
    assert first["a"][0].num_cached_tokens == 0 and again[0].num_cached_tokens == 20
    stats = engine.stats()
    # prompt logprobs read no cache, so "b" is not a query
    assert (stats.num_prefix_cache_queried_tokens, stats.num_prefix_cache_hit_tokens) == (44, 20)
    assert stats.num_prompt_tokens_total == 22 + 9 + 2 and stats.num_generated_tokens_total == 3 + 2 + 3
    off, _ = make_engine(tokenizer, prefix_caching=False)
    for rid in ("x", "y"):
        off.add_request(rid, ids, SamplingParams(max_new_tokens=1))
        assert run_streams(off)[rid][0].num_cached_tokens == 0
    assert (off.stats().num_prefix_cache_queried_tokens, off.stats().num_prefix_cache_hit_tokens) == (0, 0)


def test_runner_failure_fails_the_batch_and_frees_blocks(tokenizer):
    engine, runner = make_engine(tokenizer)
    engine.add_request("a", prompt(1, 5), SamplingParams(max_new_tokens=5))
    runner.fail_next = True
    outputs = engine.step()
    assert len(outputs) == 1 and outputs[0].finished and "injected failure" in outputs[0].error
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    engine.add_request("b", prompt(1, 5), SamplingParams(max_new_tokens=2))
    assert run_streams(engine)["b"][-1].finish_reason in ("length", "eos_token")


def test_a_runner_that_cannot_run_again_stops_the_engine_and_its_requests(tokenizer):
    """Issue 27: a failed tensor-parallel step (ModelRunner.failure set) must not leave an engine that fails every
    later request: step() raises, AsyncEngine records the error (the launcher then exits) and ends the streams."""
    import asyncio

    from engine.async_engine import AsyncEngine, RequestFailedError

    engine, runner = make_engine(tokenizer)
    runner.fail_next = True
    runner.failure = "tensor-parallel step failed (rank 1 alive): injected"
    async_engine = AsyncEngine(engine).start()

    async def one_request():
        async for _ in async_engine.generate("a", prompt(1, 5), SamplingParams(max_new_tokens=5)):
            pass

    try:
        with pytest.raises(RequestFailedError, match="the model runner failed: tensor-parallel step failed"):
            asyncio.run(asyncio.wait_for(one_request(), 10))
        assert async_engine.error is not None and not async_engine.is_alive
    finally:
        async_engine.close()


def test_generate_returns_whole_outputs_in_order(tokenizer):
    engine, runner = make_engine(tokenizer)
    with engine:
        outs = engine.generate([prompt(1, 4), prompt(2, 30), "some text"],
                               [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 1, 6)])
    assert [o.num_generated_tokens for o in outs] == [3, 1, 6]
    assert [t.id for t in outs[0].tokens] == reference_greedy(prompt(1, 4), 3, VOCAB)
    assert outs[2].text == outs[2].generated_text
    assert runner.closed


def test_limits_follow_tgi_defaults_and_checks():
    limits = resolve_limits(EngineConfig(), max_position_embeddings=8192, num_kv_blocks=1000, block_size=16)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens,
            limits.max_batch_total_tokens) == (4096, 4095, 4145, 16000)
    # on CPU the prefill budget defaults to CPU_PREFILL_TOKENS at most; a flag still wins, a small prompt limit too
    assert resolve_limits(EngineConfig(), 8192, 1000, 16, cpu=True).max_batch_prefill_tokens == CPU_PREFILL_TOKENS
    assert resolve_limits(EngineConfig(max_batch_prefill_tokens=4096), 8192, 1000, 16,
                          cpu=True).max_batch_prefill_tokens == 4096
    assert resolve_limits(EngineConfig(max_input_tokens=100), 8192, 1000, 16, cpu=True).max_batch_prefill_tokens == 150
    limits = resolve_limits(EngineConfig(), max_position_embeddings=512, num_kv_blocks=1000, block_size=16)
    assert limits.max_total_tokens == 512 and limits.max_input_tokens == 511
    with pytest.raises(ValueError, match="KV cache holds"):
        resolve_limits(EngineConfig(max_batch_total_tokens=20000), 512, 1000, 16)
    limits = resolve_limits(EngineConfig(max_batch_total_tokens=250), 512, 1000, 16)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens) == (240, 239, 250)
    with pytest.raises(ValueError, match="one request alone must fit"):
        resolve_limits(EngineConfig(max_batch_total_tokens=256, max_total_tokens=512), 512, 1000, 16)
    with pytest.raises(ValueError, match="max_input_tokens"):
        resolve_limits(EngineConfig(max_input_tokens=512), 512, 1000, 16)


def test_stats_report_the_cache_and_batch(tokenizer):
    engine, _ = make_engine(tokenizer, num_kv_blocks=32, block_size=4)
    engine.add_request("a", prompt(1, 10), SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.batch_size) == (1, 0, 1)
    assert stats.num_free_blocks == 32 - 3 and stats.block_size == 4
    assert stats.attention_backend == "fake"


# real ModelRunner: greedy tokens identical to transformers' generate (fp32, CPU)
@pytest.fixture(scope="module")
def hf_models():
    from transformers import AutoModelForCausalLM
    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(test_model_path(name), dtype=torch.float32).eval()
        return cache[name]
    return load


def real_engine(name, **config):
    config.setdefault("cpu_kv_cache_bytes", 32 * 1024**2)     # allocating the default 512 MiB takes seconds
    return LLMEngine(EngineConfig(model_id=str(test_model_path(name)), device="cpu", dtype="float32", **config))


TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog and then runs far away into the woods",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))", "x"]


# every attention backend this machine can run: Triton's kernels run here in its CPU interpreter
@pytest.mark.parametrize("name,backend", [(name, "portable") for name in
                                          ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-llama3-rope")]
                         + [("tiny-llama", "cpu_paged"), ("tiny-mistral", "cpu_paged"), ("tiny-qwen3", "cpu_paged")]
                         + [("tiny-mistral", "triton"), ("tiny-qwen2", "triton")])
def test_greedy_matches_transformers(name, backend, hf_models):
    with real_engine(name, attention_backend=backend) as engine:
        assert engine.runner.attention_backend == backend
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    model = hf_models(name)
    for ids, out in zip(prompts, outs):
        assert [t.id for t in out.tokens] == hf_greedy(model, ids, 16)


def test_32_concurrent_requests_under_a_small_kv_budget_match_transformers(hf_models):
    with real_engine("tiny-llama", max_batch_total_tokens=320, max_total_tokens=128,
                     max_batch_prefill_tokens=64) as engine:
        base = engine.tokenizer.encode(" ".join(TEXTS) * 3)
        # three shared starts: long prompts share full blocks through the prefix cache
        prompts = [base[(i % 3) * 5:(i % 3) * 5 + 1 + (i * 7) % 60] for i in range(32)]
        new_tokens = [4 + (i * 13) % 60 for i in range(32)]
        spans, run = [], engine.runner.run
        engine.runner.run = lambda batch: spans.extend(batch) or run(batch)
        outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in new_tokens])
        stats = engine.stats()
    assert stats.num_preempted_total > 0
    first_spans = {}
    for span in spans:
        first_spans.setdefault(span.seq_id, span)
    assert any(span.start_pos > 0 for span in first_spans.values())     # prefix-cache hits
    assert stats.num_free_blocks == stats.num_total_blocks == 20
    model = hf_models("tiny-llama")
    for ids, n, out in zip(prompts, new_tokens, outs):
        assert [t.id for t in out.tokens] == hf_greedy(model, ids, n)


def test_smollm2_chat_prompts_match_transformers(hf_models):
    from engine.tokenizer import apply_chat_template
    with real_engine("smollm2") as engine:
        texts = [apply_chat_template(engine.tokenizer, [{"role": "user", "content": q}])
                 for q in ("What is the capital of France?", "Say hi.")]
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, top_n_tokens=2))
    model = hf_models("smollm2")
    for ids, out in zip(prompts, outs):
        assert [t.id for t in out.tokens] == hf_greedy(model, ids, 8)
        assert out.generated_text == engine.tokenizer.decode([t.id for t in out.tokens], skip_special_tokens=True)
    assert "Paris" in outs[0].generated_text


def test_two_shards_match_transformers(hf_models):
    with real_engine("tiny-llama", num_shard=2) as engine:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    model = hf_models("tiny-llama")
    for ids, out in zip(prompts, outs):
        assert [t.id for t in out.tokens] == hf_greedy(model, ids, 8)


def test_repetition_penalty_matches_transformers(hf_models):
    with real_engine("tiny-qwen2") as engine:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, repetition_penalty=1.5))
    model = hf_models("tiny-qwen2")
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                                 pad_token_id=model.generation_config.pad_token_id)[0, len(ids):].tolist()
        assert [t.id for t in out.tokens] == ref


def test_seeded_sampling_on_the_real_model_is_reproducible():
    params = SamplingParams(do_sample=True, seed=99, temperature=0.9, top_k=40, max_new_tokens=10, ignore_eos=True)
    with real_engine("tiny-llama") as engine:
        ids = engine.tokenizer.encode(TEXTS[1])
        alone = engine.generate([ids], params)[0]
        crowded = engine.generate([TEXTS[0], ids, TEXTS[2]],
                                  [SamplingParams(do_sample=True, max_new_tokens=5), params, SamplingParams()])[1]
    assert [t.id for t in alone.tokens] == [t.id for t in crowded.tokens]
    assert alone.seed == 99 and alone.generated_text == crowded.generated_text


def test_cpu_runner_gets_the_cpu_prefill_budget(tokenizer):
    def budget(device):
        runner = FakeRunner(VOCAB, 2048, 4)  # 8192 tokens of cache, a 4096-token context
        runner.device = torch.device(device)
        engine = LLMEngine(EngineConfig(), runner=runner, model_config=FakeModelConfig(VOCAB, 4096),
                           tokenizer=tokenizer)
        return engine.max_batch_prefill_tokens

    assert budget("cpu") == CPU_PREFILL_TOKENS
    assert budget("meta") == 4096 - 1 + 50  # elsewhere TGI's max_input_tokens + 50


def test_the_sampler_skips_its_row_scan_only_while_every_live_request_is_plain_greedy(tokenizer, monkeypatch):
    """The engine's `all_greedy` hint follows the live requests: a sampling one waiting, running, aborted, a failed
    step, the last logprob request gone; tokens as without the hint."""
    import engine.llm_engine as llm_engine
    hints = []

    def spy(*args, **kwargs):
        hints.append((kwargs["all_greedy"], kwargs["any_logprobs"]))
        return sample(*args, **kwargs)

    sample = llm_engine.sample
    monkeypatch.setattr(llm_engine, "sample", spy)
    engine, runner = make_engine(tokenizer, num_kv_blocks=64)
    engine.add_request("greedy", prompt(1, 5), SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.step()
    assert hints[-1] == (True, True)
    engine.add_request("sampled", prompt(2, 5), SamplingParams(max_new_tokens=40, do_sample=True, seed=1,
                                                               ignore_eos=True))
    engine.step()
    assert hints[-1] == (False, True)
    engine.abort("sampled")
    engine.step()
    assert hints[-1] == (True, True)
    engine.add_request("quiet", prompt(3, 5), SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=False))
    engine.add_request("alternatives", prompt(4, 5), SamplingParams(max_new_tokens=2, ignore_eos=True,
                                                                    top_n_tokens=2))
    engine.step()
    assert hints[-1] == (False, True)
    runner.fail_next = True
    engine.step()                                   # fails every request of the batch
    assert not engine.has_unfinished_requests()
    engine.add_request("quiet2", prompt(5, 5), SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=False))
    streams = run_streams(engine)
    assert hints[-1] == (True, False)
    assert [t.id for o in streams["quiet2"] for t in o.tokens] == reference_greedy(prompt(5, 5), 4, VOCAB, set())
    assert all(t.logprob is None for o in streams["quiet2"] for t in o.tokens)
