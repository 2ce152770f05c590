"""engine.offline: OpenAI Batch lines through an in-process tiny-llama, against LLMEngine.generate."""
from __future__ import annotations

import json
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.offline.requests import OfflineState, prepare, seed_of
from engine.offline.runner import BatchRunner
from engine.sampling_params import SamplingParams
from tgi_hpc.batch.assembly import assemble
from tgi_hpc.batch.inputs import copy_input
from tgi_hpc.batch.ledger import Ledger

PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):", "x", "Once upon a time", "1 2 3 4"]


@pytest.fixture(scope="module")
def llm(model_path):
    engine = LLMEngine(EngineConfig(model_id=str(model_path("tiny-llama")), device="cpu", dtype="float32",
                                    cpu_kv_cache_bytes=32 * 1024**2, max_total_tokens=256))
    yield engine
    engine.close()


def batch(tmp_path, name, lines, shard_size, lease_s=60.0):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    root = tmp_path / name
    root.mkdir()
    scan = copy_input(src, root)
    Ledger.create(root, {"num_records": scan.num_records, "shard_size": shard_size,
                         "output": str(tmp_path / f"{name}.out.jsonl")})
    return Ledger(root, lease_s=lease_s)


def run(llm, ledger, window=4, holder="t"):
    summary = BatchRunner(llm, OfflineState.of(llm, llm.config), ledger, holder, window=window).run()
    out = ledger.root.parent / f"{ledger.root.name}.out.jsonl"
    assert assemble(ledger, out)
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


def test_greedy_answers_equal_generate_per_request(llm, tmp_path):
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": p, "max_tokens": 6 + i, "temperature": 0}}) for i, p in enumerate(PROMPTS)]
    messages = [{"role": "user", "content": "What is two plus two?"}]
    lines.append(json.dumps({"custom_id": "chat", "url": "/v1/chat/completions",
                             "body": {"messages": messages, "max_tokens": 9, "temperature": 0}}))
    lines.append(json.dumps({"prompt": "plain line", "max_tokens": 5, "temperature": 0}))
    summary, out = run(llm, batch(tmp_path, "greedy", lines, shard_size=3), window=3)
    assert summary.requests == len(lines) and summary.failed == 0
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(len(PROMPTS))] + ["chat", str(len(lines))]
    expected = llm.generate(PROMPTS, [SamplingParams(max_new_tokens=6 + i) for i in range(len(PROMPTS))])
    for o, e in zip(out, expected):
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == e.text
        assert body["usage"]["completion_tokens"] == e.num_generated_tokens
    tok = llm.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    chat = llm.generate([chat_ids], SamplingParams(max_new_tokens=9))[0]
    assert out[-2]["response"]["body"]["choices"][0]["message"]["content"] == chat.text
    assert out[-1]["response"]["body"]["choices"][0]["text"] == llm.generate(
        ["plain line"], SamplingParams(max_new_tokens=5))[0].text


def test_sampling_is_the_same_whatever_the_sharding(llm, tmp_path):
    lines = [json.dumps({"custom_id": f"s{i}", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0.9}})
             for i in range(10)]
    _, one = run(llm, batch(tmp_path, "one", lines, shard_size=10), window=10)
    _, many = run(llm, batch(tmp_path, "many", lines, shard_size=3), window=2)
    texts = [o["response"]["body"]["choices"][0]["text"] for o in one]
    assert texts == [o["response"]["body"]["choices"][0]["text"] for o in many]
    assert len(set(texts)) > 1 and seed_of("s1") != seed_of("s2")


def test_logprobs_come_only_where_a_line_asks_and_the_answers_do_not_change(llm, tmp_path):
    """Lines without logprobs run without them in the engine (no log_softmax); asking lines still get them."""
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {"messages": messages, "max_tokens": 7, "temperature": 0}
    lines = [json.dumps({"custom_id": "plain", "url": "/v1/chat/completions", "body": chat}),
             json.dumps({"custom_id": "asks", "url": "/v1/chat/completions",
                         "body": {**chat, "logprobs": True, "top_logprobs": 2}}),
             json.dumps({"custom_id": "no", "url": "/v1/chat/completions", "body": {**chat, "logprobs": False}}),
             json.dumps({"custom_id": "cp", "url": "/v1/completions", "body": {"prompt": "x y", "max_tokens": 4, "temperature": 0}}),
             json.dumps({"custom_id": "cl", "url": "/v1/completions",
                         "body": {"prompt": "x y", "max_tokens": 4, "temperature": 0, "logprobs": 0}})]
    state = OfflineState.of(llm, llm.config)
    assert [prepare(state, "x", line).valid.params.logprobs for line in lines] == [False, True, False, False, True]
    summary, out = run(llm, batch(tmp_path, "lp", lines, shard_size=5), window=5)
    assert summary.failed == 0
    plain, asks, no, cp, cl = (o["response"]["body"]["choices"][0] for o in out)
    assert plain["message"]["content"] == asks["message"]["content"] == no["message"]["content"]
    assert plain["logprobs"] is None and no["logprobs"] is None
    content = asks["logprobs"]["content"]
    assert len(content) == out[1]["response"]["body"]["usage"]["completion_tokens"]
    assert all(t["logprob"] <= 0.0 and len(t["top_logprobs"]) == 2 for t in content)
    assert cp["text"] == cl["text"] and cp["logprobs"] is None
    assert all(lp <= 0.0 for lp in cl["logprobs"]["token_logprobs"])


def test_malformed_lines_become_error_lines_and_the_rest_completes(llm, tmp_path):
    ok = json.dumps({"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 3}})
    lines = [
        "{this is not json",
        json.dumps({"custom_id": "bad-url", "url": "/v1/moderations", "body": {"input": "x"}}),
        json.dumps({"custom_id": "no-body", "url": "/v1/chat/completions"}),
        json.dumps({"custom_id": "too-long", "url": "/v1/completions", "body": {"prompt": "word " * 600}}),
        json.dumps({"custom_id": "bad-type", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": "many"}}),
        json.dumps({"custom_id": "n2", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps([1, 2]),
        ok,
    ]
    summary, out = run(llm, batch(tmp_path, "bad", lines, shard_size=4))
    assert [o["custom_id"] for o in out] == ["1", "bad-url", "no-body", "too-long", "bad-type", "n2", "get", "8", "ok"]
    codes = [o["error"]["code"] if o["error"] else None for o in out]
    assert codes == ["invalid_json", "invalid_url", "missing_body", "invalid_request", "invalid_request",
                     "invalid_request", "invalid_request", "invalid_request", None]
    assert "tokens" in out[3]["error"]["message"] and "max_tokens" in out[4]["error"]["message"]
    assert out[0]["error"]["line"] == 1 and out[0]["response"] is None
    assert summary.failed == 8 and Ledger(tmp_path / "bad").progress().failed == 8


def test_stop_gives_open_shards_back_and_a_second_holder_finishes(llm, tmp_path):
    lines = [json.dumps({"custom_id": f"r{i}", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % 6], "max_tokens": 12, "temperature": 0}}) for i in range(12)]
    ledger = batch(tmp_path, "stop", lines, shard_size=2)
    first = BatchRunner(llm, OfflineState.of(llm, llm.config), ledger, "first", window=2)
    step = llm.step
    calls = [0]

    def counting_step():
        calls[0] += 1
        if calls[0] == 15:
            first.stop()
        return step()
    llm.step = counting_step
    try:
        summary = first.run()
    finally:
        del llm.step
    assert summary.stopped and 0 < ledger.progress().shards_done < 6
    for _ in range(3):                      # aborted requests end on the engine's next steps
        llm.step()
    _, out = run(llm, ledger, holder="second")
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(12)]
    expected = llm.generate([PROMPTS[i % 6] for i in range(12)], SamplingParams(max_new_tokens=12))
    assert [o["response"]["body"]["choices"][0]["text"] for o in out] == [e.text for e in expected]


def test_api_batch_on_this_machine_with_cluster_local(model_path, tmp_path):
    from tgi_hpc import api

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4}) + "\n" for p in PROMPTS))
    handle = api.batch(str(model_path("tiny-llama")), str(src), str(out), cluster="local",
                       overrides=[f"paths.jobs={tmp_path / 'jobs'}"], max_total_tokens=128)
    assert len(handle.job_ids) == 1 and not handle.progress()["complete"]
    assert handle.wait(timeout=240, poll_s=0.5)["done"] == len(PROMPTS)
    results = list(handle.results())
    assert [r["custom_id"] for r in results] == [str(i + 1) for i in range(len(PROMPTS))]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] <= 4 for r in results)
    again = api.batch(str(model_path("tiny-llama")), str(src), str(out), cluster="local",
                      overrides=[f"paths.jobs={tmp_path / 'jobs'}"], max_total_tokens=128)
    assert again.job_ids == [] and again.progress()["complete"]       # done: nothing submitted again


def test_a_line_that_breaks_preparation_unexpectedly_is_an_error_line_not_a_crash(llm, tmp_path, monkeypatch):
    import engine.offline.runner as runner_module

    real = runner_module.prepare

    def fragile(state, custom_id, text):
        if custom_id == "boom":
            raise RuntimeError("template exploded")
        return real(state, custom_id, text)
    monkeypatch.setattr(runner_module, "prepare", fragile)
    lines = [json.dumps({"custom_id": c, "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}})
             for c in ("a", "boom", "c")]
    summary, out = run(llm, batch(tmp_path, "boom", lines, shard_size=3))
    assert [o["error"] and o["error"]["code"] for o in out] == [None, "internal_error", None]
    assert out[1]["error"]["message"] == "RuntimeError: template exploded" and summary.failed == 1


def test_the_batch_stays_full_across_shards_and_never_exceeds_the_window(llm, tmp_path):
    lines = [json.dumps({"custom_id": f"w{i}", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % 6], "max_tokens": 3 + 2 * (i % 3), "temperature": 0}})
             for i in range(10)]
    ledger = batch(tmp_path, "full", lines, shard_size=2)
    seen: list[int] = []
    step = llm.step

    def watching_step():
        outputs = step()
        seen.append(llm.stats().batch_size)      # sequences the step ran
        return outputs
    llm.step = watching_step
    try:
        summary = BatchRunner(llm, OfflineState.of(llm, llm.config), ledger, "w", window=3).run()
    finally:
        del llm.step
    assert summary.requests == 10 and ledger.progress().complete
    assert max(seen) <= 3                     # never more than the window in the engine
    full = [n for n in seen[:-6] if n == 3]   # requests from the next shard fill the slots of finished ones
    assert len(full) >= len(seen[:-6]) * 0.6, seen


@pytest.fixture(scope="module")
def embedder(model_path):
    from engine.pooling.engine import PoolingEngine
    engine = PoolingEngine(EngineConfig(model_id=str(model_path("tiny-bert-embed")), device="cpu"))
    yield engine
    engine.close()


def test_embeddings_lines_equal_sentence_transformers_and_bad_ones_are_error_lines(embedder, model_path, tmp_path):
    import base64

    import numpy as np
    import sentence_transformers as st
    import torch

    texts = ["a short one", "a somewhat longer sentence about the sea and its waves", "x"]
    x_ids = embedder.tokenizer("x")["input_ids"]
    bodies = {"one": {"input": texts[0], "model": "my-embedder"}, "many": {"input": texts},
              "b64": {"input": texts[1], "encoding_format": "base64"}, "ids": {"input": [x_ids]},
              "dims": {"input": "x", "dimensions": 8}, "huge-dims": {"input": "x", "dimensions": 100000},
              "empty": {"input": ""}, "none": {"input": []}, "bad-id": {"input": [[10**9]]},
              "too-long": {"input": "word " * 600}, "no-input": {"model": "m"}}
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": body})
             for cid, body in bodies.items()]
    lines.append(json.dumps({"custom_id": "chat", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": "hi"}]}}))
    lines.append(json.dumps({"prompt": "a plain completion line"}))
    summary, out = run(embedder, batch(tmp_path, "embed", lines, shard_size=4), window=2)
    by_id = {o["custom_id"]: o for o in out}
    assert [o["custom_id"] for o in out] == [*bodies, "chat", str(len(lines))]
    want = st.SentenceTransformer(str(model_path("tiny-bert-embed")), device="cpu").encode(
        texts, convert_to_tensor=True).float()

    def vectors(cid):
        return torch.tensor([d["embedding"] for d in by_id[cid]["response"]["body"]["data"]])
    one = by_id["one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == "my-embedder" and by_id["one"]["error"] is None
    assert one["usage"]["prompt_tokens"] == len(embedder.tokenizer(texts[0])["input_ids"])
    assert torch.allclose(vectors("one")[0], want[0], atol=1e-4)
    assert [d["index"] for d in by_id["many"]["response"]["body"]["data"]] == [0, 1, 2]
    assert torch.allclose(vectors("many"), want, atol=1e-4)
    raw = base64.b64decode(by_id["b64"]["response"]["body"]["data"][0]["embedding"])
    assert torch.allclose(torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()), want[1], atol=1e-4)
    assert torch.allclose(vectors("ids")[0], want[2], atol=1e-4)
    dims = vectors("dims")[0]
    assert dims.shape == (8,) and abs(float(dims.norm()) - 1) < 1e-5
    errors = {cid: o["error"] for cid, o in by_id.items() if o["error"]}
    assert {cid: e["code"] for cid, e in errors.items()} == {
        "huge-dims": "invalid_request", "empty": "invalid_request", "none": "invalid_request",
        "bad-id": "invalid_request", "too-long": "invalid_request", "no-input": "invalid_request",
        "chat": "invalid_url", str(len(lines)): "invalid_url"}
    assert "dimensions" in errors["huge-dims"]["message"] and "vocabulary" in errors["bad-id"]["message"]
    assert "tokens" in errors["too-long"]["message"]
    assert "needs a text-generation model" in errors["chat"]["message"] and "/v1/embeddings" in errors["chat"]["message"]
    assert summary.failed == len(errors) and summary.generated_tokens > 0   # embedded tokens count as the batch's


def test_an_embeddings_line_to_a_chat_model_is_an_error_line_naming_the_model_kind(llm, tmp_path):
    lines = [json.dumps({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x"}}),
             json.dumps({"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}})]
    summary, out = run(llm, batch(tmp_path, "wrong-kind", lines, shard_size=2))
    assert out[0]["error"]["code"] == "invalid_url" and "needs an embedding model" in out[0]["error"]["message"]
    assert "/v1/chat/completions or /v1/completions" in out[0]["error"]["message"] and out[1]["error"] is None


def test_a_failed_embedding_forward_is_an_error_line_for_each_line_in_it(embedder, tmp_path, monkeypatch):
    real = embedder.runner.run
    calls = [0]

    def failing_once(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)
    monkeypatch.setattr(embedder.runner, "run", failing_once)
    lines = [json.dumps({"custom_id": f"e{i}", "url": "/v1/embeddings", "body": {"input": ["a", "b c"][: i + 1]}})
             for i in range(2)]
    summary, out = run(embedder, batch(tmp_path, "fail", lines, shard_size=1), window=1)   # a step each
    assert [o["error"] and o["error"]["code"] for o in out] == ["embedding_failed", None]
    assert "out of memory" in out[0]["error"]["message"] and len(out[1]["response"]["body"]["data"]) == 2
    assert summary.failed == 1


SLOW_CHILD = """
import sys, time
from engine.llm_engine import LLMEngine
from engine.offline.__main__ import main
step = LLMEngine.step
LLMEngine.step = lambda self: (time.sleep(0.04), step(self))[1]   # at least 2.8 s of work: the kill lands mid-shard
sys.exit(main(sys.argv[1:]))
"""


def test_a_runner_killed_mid_shard_keeps_its_finished_lines_and_the_rerun_does_only_the_rest(llm, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    lines = [json.dumps({"custom_id": f"k{i}", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % 6], "max_tokens": 8, "temperature": 0}}) for i in range(16)]
    ledger = batch(tmp_path, "kill", lines, shard_size=16)            # one shard: the whole batch
    journal = ledger.root / "journal" / "0.0.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD, "--batch-dir", str(ledger.root), "--holder", "killed", "--window", "2",
         "--model-id", str(llm.config.model_id), "--device", "cpu", "--dtype", "float32", "--kv-cache-bytes", "32MiB",
         "--max-total-tokens", "256"], cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (journal.exists() and journal.read_bytes().count(b"\n") >= 2):
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child wrote no journal"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert ledger.progress().shards_done == 0                        # killed mid-shard: nothing committed
    kept = [json.loads(raw) for raw in journal.read_bytes().splitlines()]
    done = {e["pos"]: e["line"] for e in kept}
    assert 2 <= len(done) < 16
    torn = json.dumps({"pos": 15, "failed": False, "tokens": 1, "line": "x"})[:30].encode()
    with open(journal, "ab") as fh:                                   # as if the kill had landed mid-write
        fh.write(torn)

    later = Ledger(ledger.root, lease_s=60, clock=lambda: time.time() + 3600)   # the dead holder's lease expired
    added: list[int] = []
    add = llm.add_request

    def counting_add(rid, *args, **kwargs):
        added.append(int(rid.rsplit(".", 1)[1]))
        return add(rid, *args, **kwargs)
    llm.add_request = counting_add
    try:
        summary, out = run(llm, later, holder="rerun")
    finally:
        del llm.add_request
    assert sorted(added) == sorted(set(range(16)) - set(done))        # only the lines the journal lacked, once
    assert summary.resumed == len(done) and summary.requests == 16 - len(done)
    assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(16)]
    out_lines = (tmp_path / "kill.out.jsonl").read_text().splitlines()
    assert all(out_lines[pos] == line for pos, line in done.items())  # the killed run's lines, as they were
    expected = llm.generate([PROMPTS[i % 6] for i in range(16)], SamplingParams(max_new_tokens=8))
    assert [o["response"]["body"]["choices"][0]["text"] for o in out] == [e.text for e in expected]
    assert later.commit_record(0)["lines"] == 16 and not list((ledger.root / "journal").iterdir())


def test_a_shard_longer_than_every_run_still_ends_over_several_runs(llm, tmp_path):
    """The colleague's case: each run (a job's time limit, then SIGTERM) is shorter than the one shard."""
    lines = [json.dumps({"custom_id": f"t{i}", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % 6], "max_tokens": 8, "temperature": 0}}) for i in range(8)]
    ledger = batch(tmp_path, "limit", lines, shard_size=8)
    step, resumed = llm.step, []
    for attempt in range(10):
        runner = BatchRunner(llm, OfflineState.of(llm, llm.config), ledger, f"run{attempt}", window=2)
        calls = [0]

        def limited_step():
            calls[0] += 1
            if calls[0] == 10:                # the time limit: far less than the shard takes
                runner.stop()
            return step()
        llm.step = limited_step
        try:
            summary = runner.run()
        finally:
            del llm.step
        for _ in range(3):                    # aborted requests end on the engine's next steps
            llm.step()
        resumed.append(summary.resumed)
        if ledger.progress().complete:
            break
    assert len(resumed) > 2 and resumed == sorted(resumed) and resumed[-1] < 8    # never back, several runs
    out = tmp_path / "limit.out.jsonl"
    assert assemble(ledger, out)
    texts = [json.loads(x)["response"]["body"]["choices"][0]["text"] for x in out.read_text().splitlines()]
    assert texts == [e.text for e in llm.generate([PROMPTS[i % 6] for i in range(8)], SamplingParams(max_new_tokens=8))]


def test_workers_split_threads_and_window_and_pass_the_rest_on():
    from engine.offline.workers import shares, worker_argv

    assert shares(5, 2) == [3, 2] and shares(1, 3) == [1, 1, 1] and shares(128, 4) == [32] * 4
    argv = worker_argv("/b", "n:1", 1, 64, 1, None, ["--model-id", "m", "--cpu-threads", "8"])
    assert argv[1:] == ["-m", "engine.offline", "--batch-dir", "/b", "--holder", "n:1/w1", "--window", "64",
                        "--workers", "1", "--model-id", "m", "--cpu-threads", "8", "--cpu-threads", "1"]
    two = worker_argv("/b", "n:1", 0, 32, 1, None, ["--model-id", "m"], workers=2)   # half the KV share each
    assert two[two.index("--cuda-memory-fraction") + 1] == "0.5"
    given = worker_argv("/b", "n:1", 0, 32, 1, None, ["--cuda-memory-fraction=0.2"], workers=2)
    assert given.count("--cuda-memory-fraction") == 0 and "--cuda-memory-fraction=0.2" in given
    from engine.offline.workers import on_cpu
    assert on_cpu("cpu") and not on_cpu("cuda") and not on_cpu("cuda:1")


@pytest.mark.parametrize("flags", [["--workers", "0"], ["--workers", "2", "--device", "cuda"],
                                   ["--workers", "2", "--device", "cpu", "--num-shard", "2"]])
def test_workers_below_one_or_off_the_cpu_are_refused_before_anything_starts(tmp_path, flags, capsys, model_path):
    from engine.offline.__main__ import main

    ledger = batch(tmp_path, "refused", [json.dumps({"prompt": "x"})], shard_size=1)
    with pytest.raises(SystemExit) as exc:
        main(["--batch-dir", str(ledger.root), "--model-id", str(model_path("tiny-llama")), *flags])
    assert exc.value.code == 2 and "--workers" in capsys.readouterr().err
    assert not list((ledger.root / "leases").iterdir())


def test_workers_start_claiming_together_once_all_are_ready(tmp_path, monkeypatch):
    import threading

    from engine.offline.workers import BARRIER_ENV, wait_for_siblings

    stop = threading.Event()
    wait_for_siblings("alone", stop)                        # no barrier: returns at once
    monkeypatch.setenv(BARRIER_ENV, f"{tmp_path}:2")
    first = threading.Thread(target=wait_for_siblings, args=("h/w0", stop))
    first.start()
    first.join(0.3)
    assert first.is_alive()                                # waits for its sibling
    wait_for_siblings("h/w1", stop)
    first.join(5)
    assert not first.is_alive() and sorted(p.name for p in tmp_path.iterdir()) == ["h_w0", "h_w1"]
    monkeypatch.setenv(BARRIER_ENV, f"{tmp_path / 'gone'}:3")     # a barrier that cannot be joined: no wait
    wait_for_siblings("h/w2", stop)
    monkeypatch.setenv(BARRIER_ENV, f"{tmp_path}:9")
    stop.set()
    wait_for_siblings("h/w3", stop)                        # stopped (SIGTERM) while waiting: returns


def test_a_worker_that_dies_at_load_does_not_hold_the_others_at_the_barrier():
    import signal
    import sys
    from pathlib import Path

    from engine.offline.workers import run_workers

    waits = ("import os, sys, threading; from engine.offline.workers import BARRIER_ENV, wait_for_siblings; "
             "wait_for_siblings('w1', threading.Event(), 20); "
             "sys.exit(0 if len(os.listdir(os.environ[BARRIER_ENV].rpartition(':')[0])) >= 2 else 5)")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        root = str(Path(__file__).parents[2])
        code = run_workers([[sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); " + waits],
                            [sys.executable, "-c", "import sys; sys.exit(3)"]])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 3              # the crash is reported, and the first worker went on (else its 5 came first)


def test_two_workers_give_the_answers_of_one_engine(llm, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    lines = [json.dumps({"custom_id": f"w{i}", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % 6], "max_tokens": 5, "temperature": 0}}) for i in range(12)]
    ledger = batch(tmp_path, "workers", lines, shard_size=2)
    done = subprocess.run(
        [sys.executable, "-m", "engine.offline", "--batch-dir", str(ledger.root), "--holder", "h", "--workers", "2",
         "--window", "4", "--model-id", str(llm.config.model_id), "--device", "cpu", "--dtype", "float32",
         "--kv-cache-bytes", "32MiB", "--max-total-tokens", "256"], cwd=Path(__file__).parents[2],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 workers started" in done.stderr
    holders = {ledger.commit_record(i)["holder"] for i in range(6)}
    assert holders <= {"h/w0", "h/w1"} and holders
    out = [json.loads(line) for line in (tmp_path / "workers.out.jsonl").read_text().splitlines()]
    expected = llm.generate([PROMPTS[i % 6] for i in range(12)], SamplingParams(max_new_tokens=5))
    assert [o["custom_id"] for o in out] == [f"w{i}" for i in range(12)]
    assert [o["response"]["body"]["choices"][0]["text"] for o in out] == [e.text for e in expected]


def test_image_lines_on_a_vision_language_model_give_transformers_greedy_tokens(model_path, tmp_path):
    """Chat lines with data-URL images (one, two, none) through a tiny LLaVA: the server's validator loads them and
    the model's processor expands them, and each answer is transformers' greedy continuation of that processor
    output; a broken image is an error line with the reason, and the other lines complete."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("PIL")
    from transformers import AutoModelForImageTextToText

    from images import data_url, png

    path = model_path("tiny-llava")
    vlm = LLMEngine(EngineConfig(model_id=str(path), device="cpu", dtype="float32", cpu_kv_cache_bytes=8 * 2**20,
                                 max_batch_prefill_tokens=7))   # chunks end inside the images

    def line(cid, *urls, text="Describe"):
        content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        return json.dumps({"custom_id": cid, "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": content}], "max_tokens": 5, "temperature": 0}})
    lines = [line("one", data_url(png(1))), line("two", data_url(png(2, 50, 35)), data_url(png(3))),
             line("text", text="no picture here"), line("broken", "data:image/png;base64,bm90IGFuIGltYWdl")]
    try:
        state = OfflineState.of(vlm, vlm.config)
        prepared = [prepare(state, cid, text) for cid, text in zip(("one", "two", "text"), lines)]
        assert [p.valid.images is not None for p in prepared] == [True, True, False]
        summary, out = run(vlm, batch(tmp_path, "vlm", lines, shard_size=2), window=3)
    finally:
        vlm.close()
    assert summary.requests == 4 and summary.failed == 1
    assert [o["custom_id"] for o in out] == ["one", "two", "text", "broken"]
    assert out[3]["response"] is None and out[3]["error"]["code"] == "invalid_request"
    assert "image" in out[3]["error"]["message"]
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for prep, o in zip(prepared, out):
        ids, images = prep.valid.prompt_token_ids, prep.valid.images
        inputs = dict(images.encoder_inputs) if images is not None else {}
        with torch.no_grad():
            want = reference.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      **inputs, max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
        body = o["response"]["body"]
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 5
        assert body["choices"][0]["message"]["content"] == vlm.tokenizer.decode(want, skip_special_tokens=True)


def test_an_encoder_decoder_batch_runs_through_python_m_engine_offline(model_path, tmp_path):
    """`python -m engine.offline` starts the engine the snapshot needs (here flan-t5's Seq2SeqEngine): completion lines
    get its greedy answers, a chat line an error line (the model has no chat template)."""
    from engine.offline.__main__ import main
    from engine.seq2seq.engine import Seq2SeqEngine

    path = str(model_path("tiny-flan-t5"))
    prompts = ["translate English to German: hello", "summarize: a b c d"]
    lines = [json.dumps({"custom_id": f"p{i}", "url": "/v1/completions",
                         "body": {"prompt": p, "max_tokens": 6, "temperature": 0}}) for i, p in enumerate(prompts)]
    lines.append(json.dumps({"custom_id": "chat", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}))
    ledger = batch(tmp_path, "t5", lines, shard_size=2)
    assert main(["--batch-dir", str(ledger.root), "--holder", "t", "--model-id", path, "--device", "cpu",
                 "--dtype", "float32"]) == 0
    out = [json.loads(x) for x in (tmp_path / "t5.out.jsonl").read_text().splitlines()]
    with Seq2SeqEngine(EngineConfig(model_id=path, device="cpu", dtype="float32")) as t5:
        expected = t5.generate([t5.tokenizer.encode(p) for p in prompts], [SamplingParams(max_new_tokens=6)] * 2)
    assert [o["response"]["body"]["choices"][0]["text"] for o in out[:2]] == [e.text for e in expected]
    assert out[2]["response"] is None and "chat template" in out[2]["error"]["message"]
