"""Async scheduling (engine/async_scheduling.py): decode batch N+1 launched before N's tokens are read. On CPU the
runner is synchronous, so `async_scheduling="on"` runs the same state machine without overlap: the tokens, texts,
logprobs and endings must be those of the synchronous engine (and of transformers), whatever ends a request while
its next row is already in flight (its length, EOS, a stop string, an abort, a failed step), and no block leaks."""
import pytest

torch = pytest.importorskip("torch")

from engine import async_scheduling  # noqa: E402
from engine.launcher import parse_args, to_config  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from test_models_families import (TEXT, assert_generations_match, engine_for, hf_generate,  # noqa: E402,F401
                                  mixed_requests)


def final_fields(out):
    """Tokens, text, ending, count; then the logprobs and the alternatives (ids, logprobs), compared approximately."""
    return ([t.id for t in out.tokens], out.generated_text, out.finish_reason, out.num_generated_tokens,
            [None if t.logprob is None else round(t.logprob, 4) for t in out.tokens]
            + [value for t in out.tokens for a in t.top_tokens for value in (a.id, round(a.logprob, 4))])


def generate_both(name, prompts, params, **config):
    """The finals of the synchronous engine, then of the async one, and how many batches the latter ran ahead."""
    finals = []
    for mode in ("off", "on"):
        with engine_for(name, async_scheduling=mode, **config) as engine:
            outs = engine.generate(prompts, params)
            finals.append([final_fields(out) for out in outs])
            ahead = engine.stats().num_steps_ahead_total
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks   # nothing held
    return finals[0], finals[1], ahead


def test_modes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert async_scheduling.resolve_mode("auto", cuda, True) and not async_scheduling.resolve_mode("auto", cpu, True)
    assert async_scheduling.resolve_mode("on", cpu, True) and not async_scheduling.resolve_mode("on", cuda, False)
    assert not async_scheduling.resolve_mode("off", cuda, True)
    with pytest.raises(ValueError, match="auto, on, off"):
        async_scheduling.resolve_mode("yes", cpu, True)
    env = {"MODEL_ID": "m"}
    assert to_config(parse_args(["--async-scheduling", "off"], environ=env), "/m").async_scheduling == "off"
    assert to_config(parse_args([], environ={**env, "ASYNC_SCHEDULING": "on"}), "/m").async_scheduling == "on"
    assert to_config(parse_args([], environ=env), "/m").async_scheduling == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--async-scheduling", "sometimes"], environ=env)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe", "tiny-gemma2"])
def test_greedy_generations_match_transformers(name, hf_generate):
    with engine_for(name, async_scheduling="on") as engine:
        assert engine.schedules_ahead
        prompts, new_tokens = mixed_requests(engine.tokenizer)
        assert_generations_match(engine, name, hf_generate, prompts, new_tokens)
        assert engine.stats().num_steps_ahead_total > 3


def test_logprobs_lengths_and_stop_strings_equal_the_synchronous_engine():
    with engine_for("tiny-llama") as engine:
        ids = engine.tokenizer.encode(TEXT)
        probe = engine.generate([ids[:9]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop = probe.tokens[5].text.strip() or probe.tokens[5].text     # ends that request mid-way
    prompts = [ids[i:i + 4 + 2 * i] for i in range(10)] + [ids[:9]]
    params = [SamplingParams(max_new_tokens=2 + i, ignore_eos=True, logprobs=i % 2 == 0) for i in range(10)]
    params.append(SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop], logprobs=True))
    sync, ahead_run, ahead = generate_both("tiny-llama", prompts, params)
    assert ahead > 5
    assert sync[-1][2] == "stop_sequence" and sync[-1][3] < 12
    for expected, got in zip(sync, ahead_run):
        assert got[:4] == expected[:4]
        assert got[4] == pytest.approx(expected[4], abs=1e-3)


def test_a_request_its_length_ends_gets_no_row_past_its_last_token():
    """Known in advance: the step that reads the last token launches nothing for it (no position past
    max_total_tokens, no block past its table)."""
    forwards = []
    for mode in ("off", "on"):
        with engine_for("tiny-llama", async_scheduling=mode, max_total_tokens=16) as engine:
            ids = engine.tokenizer.encode(TEXT)
            outs = engine.generate([ids[:6], ids[:10]], [SamplingParams(max_new_tokens=5, ignore_eos=True),
                                                        SamplingParams(max_new_tokens=50, ignore_eos=True)])
            assert [len(out.tokens) for out in outs] == [5, 6]     # the second one ends at max_total_tokens
            forwards.append(sum(engine.stats().forward_steps.values()))
    assert forwards[1] == forwards[0]


def test_end_of_sequence_while_the_next_row_is_in_flight():
    """The EOS token ends the request at the step it is read; the row already launched for it is dropped."""
    with engine_for("tiny-llama") as engine:
        ids = engine.tokenizer.encode(TEXT)
        tokens = [t.id for t in engine.generate([ids[:7]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
                  .tokens]
    eos = tokens[4]     # this token, taken as the model's EOS, ends the request after 5 tokens

    def patched(name, prompts, params):
        finals = []
        for mode in ("off", "on"):
            with engine_for(name, async_scheduling=mode) as engine:
                engine.eos_token_ids = {eos}
                outs = engine.generate(prompts, params)
                finals.append([final_fields(out) for out in outs])
                assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
                if mode == "on":
                    assert engine.stats().num_steps_ahead_total > 0
        return finals

    sync, ahead_run = patched("tiny-llama", [ids[:7], ids[3:12]], [SamplingParams(max_new_tokens=10)] * 2)
    assert sync[0][2] == "eos_token" and sync[0][3] == 5
    assert ahead_run == sync


def test_aborts_requests_arriving_and_a_full_cache():
    """Requests added and aborted between steps, on a cache small enough that decodes wait for blocks (the
    general path, preempting): every request ends once, the survivors as the synchronous engine's."""
    config = dict(cpu_kv_cache_bytes=64 * 1024, block_size=4)
    results = {}
    for mode in ("off", "on"):
        with engine_for("tiny-llama", async_scheduling=mode, **config) as engine:
            ids = engine.tokenizer.encode(TEXT)
            finals, steps = {}, 0
            for i in range(4):
                engine.add_request(f"r{i}", ids[i:i + 10], SamplingParams(max_new_tokens=40, ignore_eos=True))
            while engine.has_unfinished_requests():
                steps += 1
                if steps == 6:
                    engine.abort("r1")
                if steps == 9:
                    engine.add_request("late", ids[20:30], SamplingParams(max_new_tokens=12, ignore_eos=True))
                for out in async_scheduling_outputs(engine.step()):
                    assert out.request_id not in finals, "a request ended twice"
                    if out.finished:
                        finals[out.request_id] = out
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            results[mode] = ({rid: (o.generated_text, o.finish_reason) for rid, o in finals.items()},
                             engine.stats())
    (sync, _), (ahead_run, stats) = results["off"], results["on"]
    assert sorted(ahead_run) == sorted(sync) == ["late", "r0", "r1", "r2", "r3"]
    assert ahead_run["r1"][1] == sync["r1"][1] == "aborted"
    assert sync["r1"][0].startswith(ahead_run["r1"][0]) or ahead_run["r1"][0].startswith(sync["r1"][0])
    for rid in ("late", "r0", "r2", "r3"):
        assert ahead_run[rid] == sync[rid], rid
    assert stats.num_steps_ahead_total > 0 and stats.num_preempted_total > 0


def arriving_traffic(engine, count=24):
    """A request arrives at two steps of three, its prompt chunked over steps where long (with the tests' 40-token
    budget), one in three sharing a 48-token prefix, every fourth sampling, every other reporting logprobs, each
    ending by length; run to the end. The final fields by request, and the number of steps."""
    ids = engine.tokenizer.encode(TEXT * 3)
    finals, steps, added = {}, 0, 0
    while added < count or engine.has_unfinished_requests():
        if added < count and steps % 3 != 2:
            prompt = ids[:48] + ids[60 + added:70 + 2 * added] if added % 3 == 0 else \
                ids[added:added + 5 + (7 * added) % 60]
            params = SamplingParams(max_new_tokens=3 + (5 * added) % 17, ignore_eos=True, seed=added,
                                    logprobs=added % 2 == 0, do_sample=added % 4 == 1)
            engine.add_request(f"r{added}", prompt, params)
            added += 1
        steps += 1
        for out in async_scheduling_outputs(engine.step()):
            assert out.request_id not in finals, "a request ended twice"
            if out.finished:
                finals[out.request_id] = final_fields(out)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks    # cached ones count
    assert engine.block_manager.num_hit_tokens > 0
    return finals, steps


def assert_same_finals(sync, ahead_run, count=24):
    assert sorted(ahead_run) == sorted(sync) and len(sync) == count
    for rid, expected in sync.items():
        assert ahead_run[rid][:4] == expected[:4], rid
        assert ahead_run[rid][4] == pytest.approx(expected[4], abs=1e-3), rid


def test_requests_arriving_every_step_join_the_steps_ahead():
    """Continuous traffic: the prompts ride in the steps launched ahead (no step falls back to the synchronous
    path for them), and every request gets the synchronous engine's tokens and logprobs."""
    results = {}
    for mode in ("off", "on"):
        with engine_for("tiny-llama", async_scheduling=mode, block_size=8) as engine:
            finals, steps = arriving_traffic(engine)
            results[mode] = finals, engine.stats(), steps
    (sync, _, _), (ahead_run, stats, steps) = results["off"], results["on"]
    assert_same_finals(sync, ahead_run)
    assert stats.num_steps_ahead_total >= steps - 4, (stats.num_steps_ahead_total, steps)


def prompt_logprob_traffic(engine, count=12):
    """A request arrives every other step, its prompt of 10 to 89 tokens (chunked over steps with the tests' 40-token
    budget), every other one reporting prompt logprobs, every fourth with 2 alternatives, every third sampling. By
    request: its token ids, and its prompt tokens' (id, logprob, alternatives) from the first output; the number
    of steps."""
    ids = engine.tokenizer.encode(TEXT * 3)
    got, steps, added = {}, 0, 0
    while added < count or engine.has_unfinished_requests():
        if added < count and steps % 2 == 0:
            params = SamplingParams(max_new_tokens=2 + added % 5, ignore_eos=True, seed=added, do_sample=added % 3 == 1,
                                    prefill_logprobs=added % 2 == 0, top_n_tokens=2 if added % 4 == 0 else 0)
            engine.add_request(f"r{added}", ids[added:added + 10 + (17 * added) % 80], params)
            added += 1
        steps += 1
        for out in async_scheduling_outputs(engine.step()):
            tokens, prompt = got.get(out.request_id, ([], []))
            got[out.request_id] = (tokens + [t.id for t in out.tokens], prompt + [
                (t.id, t.logprob, [(a.id, a.logprob) for a in t.top_tokens]) for t in out.prefill_tokens or []])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got, steps


def test_prompt_logprobs_ride_in_the_steps_ahead():
    """A prompt-logprob chunk goes ahead like any other (engine/prompt_logprobs.py: computed on the device at the
    launch, appended when the step is resolved): every step but the first goes ahead, and each request gets the
    synchronous engine's tokens and prompt tokens, logprobs and alternatives."""
    runs = {}
    for mode in ("off", "on"):
        with engine_for("tiny-llama", async_scheduling=mode) as engine:
            runs[mode] = prompt_logprob_traffic(engine), engine.stats().num_steps_ahead_total
    ((sync, _), _), ((ahead_run, steps), ahead) = runs["off"], runs["on"]
    assert ahead == steps - 2, (ahead, steps)   # the first step, and the last (it resolves, nothing to launch)
    assert_same_prompt_logprobs(sync, ahead_run)


def assert_same_prompt_logprobs(sync, ahead_run):
    assert sorted(ahead_run) == sorted(sync) and len(sync) == 12
    for rid, (tokens, prompt) in sync.items():
        assert ahead_run[rid][0] == tokens, rid
        got = ahead_run[rid][1]
        assert [(i, [a for a, _ in top]) for i, _, top in got] == [(i, [a for a, _ in top]) for i, _, top in prompt]
        assert [lp for _, lp, _ in got[1:]] == pytest.approx([lp for _, lp, _ in prompt[1:]], abs=1e-4), rid
        assert [lp for *_, top in got for _, lp in top] == pytest.approx([lp for *_, top in prompt for _, lp in top],
                                                                         abs=1e-4), rid
        number = int(rid[1:])
        assert len(prompt) == (10 + (17 * number) % 80 if number % 2 == 0 else 0), rid
        assert all(len(top) == (2 if number % 4 == 0 else 0) for *_, top in prompt[1:]), rid


def test_two_tensor_ranks_go_ahead_and_give_the_synchronous_tokens():
    """Under tensor parallelism rank 0 broadcasts the decodes' input ids in flight to the other rank (gloo here,
    NCCL on GPUs): arriving traffic goes ahead as on one rank, with the synchronous engine's tokens and logprobs."""
    results = {}
    for mode in ("off", "on"):
        with engine_for("tiny-llama", async_scheduling=mode, block_size=8, num_shard=2) as engine:
            assert len(engine.runner.worker_pids) == 1 and engine.schedules_ahead == (mode == "on")
            finals, steps = arriving_traffic(engine)
            results[mode] = finals, engine.stats(), steps
    (sync, _, _), (ahead_run, stats, steps) = results["off"], results["on"]
    assert_same_finals(sync, ahead_run)
    assert stats.num_steps_ahead_total >= steps - 4, (stats.num_steps_ahead_total, steps)


def async_scheduling_outputs(outputs):
    from engine.deferred_outputs import expand
    return expand(outputs)


SAMPLED = [dict(do_sample=True), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.9), dict(top_k=40, top_p=0.8),
           dict(temperature=1.3, top_p=0.95), dict(typical_p=0.9), dict(temperature=0.5, top_k=3, logprobs=True),
           dict(top_p=0.9, top_n_tokens=3), dict(top_n_tokens=2, logprobs=True)]


def test_seeded_sampling_gives_the_synchronous_engine_tokens():
    """Sampling rows are drawn on the device with the uniform the synchronous sampler would draw at that step,
    so a seeded request's tokens (and logprobs) do not depend on the mode, beside greedy rows and rows ending."""
    with engine_for("tiny-llama") as engine:
        ids = engine.tokenizer.encode(TEXT)
    prompts = [ids[i:i + 5 + i] for i in range(len(SAMPLED) + 2)]
    params = [SamplingParams(max_new_tokens=30 - 2 * i, ignore_eos=True, seed=100 + i, **kwargs)
              for i, kwargs in enumerate(SAMPLED)]
    params += [SamplingParams(max_new_tokens=12, ignore_eos=True), SamplingParams(max_new_tokens=25, logprobs=True,
                                                                                  ignore_eos=True)]
    sync, ahead_run, ahead = generate_both("tiny-llama", prompts, params)
    assert ahead > 10
    for expected, got in zip(sync, ahead_run):
        assert got[:4] == expected[:4]
        assert got[4] == pytest.approx(expected[4], abs=1e-3)
    assert len({tuple(fields[0]) for fields in sync[:len(SAMPLED)]}) == len(SAMPLED)     # they did sample


@pytest.mark.gpu
def test_gpu_steps_ahead_give_the_synchronous_tokens(model_path):
    """On CUDA, where N+1 really runs while N's picks travel (pinned copies, an event) and decodes replay graphs:
    greedy, seeded sampling and penalised rows (kept counts on the device), with logprobs, some ended by length
    while the next row is in flight, give the synchronous engine's tokens; so do arriving requests, and prompt
    logprobs too."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def cuda_engine(mode, **config):
        return LLMEngine(EngineConfig(model_id=str(model_path("tiny-llama")), device="cuda", dtype="float32",
                                      gpu_memory_utilization=0.05, async_scheduling=mode, **config))

    finals, stats = [], []
    for mode in ("off", "on"):
        with cuda_engine(mode) as engine:
            ids = engine.tokenizer.encode(TEXT)
            prompts = [ids[i:i + 5 + i] for i in range(len(SAMPLED) + 2 + len(PENALISED))]
            params = [SamplingParams(max_new_tokens=40 - 3 * i, ignore_eos=True, seed=7 + i,
                                     **{"logprobs": i % 2 == 0, **kwargs}) for i, kwargs in enumerate(SAMPLED)]
            params += [SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=True),
                       SamplingParams(max_new_tokens=33, ignore_eos=True)]
            params += [SamplingParams(max_new_tokens=26, ignore_eos=True, seed=3, **kwargs) for kwargs in PENALISED]
            finals.append([final_fields(out) for out in engine.generate(prompts, params)])
            stats.append(engine.stats())
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert stats[0].num_steps_ahead_total == 0 and stats[1].num_steps_ahead_total > 20
    assert stats[1].forward_steps.get("decode_graph", 0) > 20
    for expected, got in zip(*finals):
        assert got[:4] == expected[:4]
        assert got[4] == pytest.approx(expected[4], abs=1e-3)
    traffic = {}
    for mode in ("off", "on"):     # arrivals: mixed steps ahead replay the piecewise graphs
        with cuda_engine(mode, max_batch_prefill_tokens=40) as engine:
            traffic[mode] = (*arriving_traffic(engine), engine.stats())
    assert_same_finals(traffic["off"][0], traffic["on"][0])
    _, steps, stats = traffic["on"]
    assert stats.num_steps_ahead_total >= steps - 4 and stats.forward_steps.get("piecewise_graphs", 0) > 0
    scored = {}
    for mode in ("off", "on"):     # prompt logprobs copied to pinned memory with the picks
        with cuda_engine(mode, max_batch_prefill_tokens=40) as engine:
            scored[mode] = prompt_logprob_traffic(engine)
    assert_same_prompt_logprobs(scored["off"][0], scored["on"][0])


PENALISED = [dict(repetition_penalty=3.0), dict(frequency_penalty=2.0), dict(do_sample=True, repetition_penalty=1.5),
             dict(repetition_penalty=0.6, frequency_penalty=-1.0, top_n_tokens=2),
             dict(frequency_penalty=1.0, top_k=8, temperature=0.8, logprobs=True)]


def test_penalised_requests_go_ahead_and_give_the_synchronous_tokens():
    """Penalties read the history up to the token in flight: a step ahead's penalty counts add each decode's token
    in flight on the device, so penalised requests (greedy or sampling, beside plain ones) get the synchronous
    engine's tokens and the steps still go ahead."""
    with engine_for("tiny-llama") as engine:
        ids = engine.tokenizer.encode(TEXT)
    prompts = [ids[i:i + 6 + 2 * i] for i in range(len(PENALISED) + 2)]
    params = [SamplingParams(max_new_tokens=24 - i, ignore_eos=True, seed=40 + i, **kwargs)
              for i, kwargs in enumerate(PENALISED)]
    params += [SamplingParams(max_new_tokens=16, ignore_eos=True), SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                                                  do_sample=True, seed=3)]
    sync, ahead_run, ahead = generate_both("tiny-llama", prompts, params)
    assert ahead > 15
    for expected, got in zip(sync, ahead_run):
        assert got[:4] == expected[:4]
        assert got[4] == pytest.approx(expected[4], abs=1e-3)
    unpenalised, _, _ = generate_both("tiny-llama", prompts[:2], [SamplingParams(max_new_tokens=24, ignore_eos=True),
                                                                 SamplingParams(max_new_tokens=23, ignore_eos=True)])
    assert [f[0] for f in sync[:2]] != [f[0] for f in unpenalised]      # the penalties did change the tokens


def test_penalised_steps_ahead_are_picked_before_the_step_in_flight_is_resolved(monkeypatch):
    """Nothing of a penalised step ahead waits for N's tokens: each is picked right after its launch, before N's
    read-back and host work."""
    from engine.llm_engine import LLMEngine

    calls: list[list[str]] = []
    step_ahead, resolve, pick = LLMEngine._step_ahead, LLMEngine._resolve, async_scheduling.pick

    def recorded(name, fn):
        def call(*args, **kwargs):
            if calls:
                calls[-1].append(name)
            return fn(*args, **kwargs)
        return call

    def step_ahead_recorded(self):
        calls.append([])
        return step_ahead(self)

    monkeypatch.setattr(LLMEngine, "_step_ahead", step_ahead_recorded)
    monkeypatch.setattr(LLMEngine, "_resolve", recorded("resolve", resolve))
    monkeypatch.setattr(async_scheduling, "pick", recorded("pick", pick))
    with engine_for("tiny-llama", async_scheduling="on") as engine:
        ids = engine.tokenizer.encode(TEXT)
        engine.generate([ids[:5 + i] for i in range(len(PENALISED))],
                        [SamplingParams(max_new_tokens=12, ignore_eos=True, seed=i, **kw)
                         for i, kw in enumerate(PENALISED)])
    launched = [c for c in calls if "pick" in c]
    assert len(launched) >= 10 and all(c == ["pick", "resolve"] for c in launched), calls


def test_a_failed_step_ahead_fails_its_requests_and_the_engine_serves_on(monkeypatch):
    with engine_for("tiny-llama", async_scheduling="on") as engine:
        ids = engine.tokenizer.encode(TEXT)
        run, calls = engine.runner.run, []

        def failing_once(spans, *args, input_ids=None, **kwargs):
            if input_ids is not None and not calls:
                calls.append(len(spans))
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            return run(spans, *args, input_ids=input_ids, **kwargs)

        monkeypatch.setattr(engine.runner, "run", failing_once)
        outs = engine.generate([ids[:6], ids[2:9]], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert calls == [2]
        for out in outs:    # the prompt step's token is delivered, then the error of the first step ahead
            assert out.error and "illegal memory access" in out.error and len(out.tokens) == 1, out
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        again = engine.generate([ids[:6]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        assert again.error is None and len(again.tokens) == 6


def test_the_server_streams_what_the_synchronous_engine_generates(model_path, tmp_path):
    """Behind the HTTP server (its outputs built and their text decoded on the event loop: deferred_outputs.py,
    deferred_text.py), streamed token by token to concurrent clients."""
    import concurrent.futures
    import json

    import httpx
    from test_clients import start_server, stop_server

    path = model_path("tiny-llama")
    prompts = ["The quick brown fox", "def add(a, b):", "Hello world, said", "Count: 1, 2, 3,"]
    with engine_for("tiny-llama") as engine:
        expected = [out.generated_text for out in engine.generate(
            prompts, [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True) for i in range(4)])]
    proc, url, log = start_server(path, tmp_path, "--async-scheduling", "on", "--dtype", "float32")
    try:
        assert httpx.get(f"{url}/info").json()["async_scheduling"] is True

        def stream(i):
            body = {"inputs": prompts[i], "parameters": {"max_new_tokens": 8 + 3 * i, "details": True}}
            with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
                events = [json.loads(line.removeprefix("data:")) for line in response.iter_lines()
                          if line.startswith("data:")]
            assert len(events) == 8 + 3 * i
            return "".join(event["token"]["text"] for event in events), events[-1]["generated_text"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(stream, range(4)))
        assert [text for text, _ in got] == expected
        assert [final for _, final in got] == expected
        metrics = httpx.get(f"{url}/metrics").text
        assert "tgi_steps_ahead_total" in metrics
        ahead = [line for line in metrics.splitlines() if line.startswith("tgi_steps_ahead_total")]
        assert float(ahead[0].split()[-1]) > 0, ahead
    finally:
        stop_server(proc)
