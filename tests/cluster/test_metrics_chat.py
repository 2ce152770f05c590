"""`tgi-hpc metrics` and `tgi-hpc chat` against the real engine (SmolLM2) in a local Slurm job: the counters after
a load, the live view, and a chat driven through a pseudo-terminal (streaming, /system, /reset, multi-line,
--json-schema, /exit)."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import pytest

from support.releases import venv_release
from support.terminal import Terminal
from support.tgi_cli import TgiCli


@pytest.fixture(scope="module")
def served(local_cluster, model_path, tmp_path_factory):
    jobs_dir = tmp_path_factory.mktemp("jobs")
    tgi = TgiCli.for_cluster(local_cluster, jobs_dir)

    result = json.loads(tgi("serve", "--model", str(model_path("smollm2")), "--release", str(venv_release()),
                            "--max-total-tokens", "2048", "--wait", "--timeout", "240", "--json").stdout)
    st = result["status"]
    key = Path(st["api_key_file"]).read_text().strip()
    yield tgi, result["job_id"], st["url"], key
    tgi("stop", result["job_id"], check=False)


def _generate(url: str, key: str, prompt: str, max_new_tokens: int) -> dict:
    answer = httpx.post(f"{url}/generate", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                        json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}})
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.slow
def test_metrics_json_reports_the_counters_after_a_load(served):
    tgi, job_id, url, key = served
    before = json.loads(tgi("metrics", job_id, "--json", "--interval", "0.2").stdout)
    done = [_generate(url, key, f"Question {i}: what is {i} + {i}?", 8) for i in range(4)]
    generated = sum(d["details"]["generated_tokens"] for d in done)
    stop, extra = threading.Event(), []

    def load():   # requests finishing while the sample's two scrapes are taken
        while not stop.is_set():
            extra.append(_generate(url, key, "Count: one, two,", 3))

    worker = threading.Thread(target=load)
    worker.start()
    try:
        sample = json.loads(tgi("metrics", job_id, "--json", "--interval", "3").stdout)
    finally:
        stop.set()
        worker.join(120)
    counters, old = sample["counters"], before["counters"]
    assert sample["target"] == job_id and sample["url"] == url and sample["replicas"] == [job_id]
    assert counters["requests"] >= old["requests"] + 4
    assert counters["generated_tokens"] >= old["generated_tokens"] + generated
    assert counters["prompt_tokens"] > old["prompt_tokens"]
    assert sample["token_source"] == "counters"     # the engine's per-step counters, not the histogram sums
    assert counters["prefix_cache_queried_tokens"] >= old["prefix_cache_queried_tokens"] + 4
    assert sample["generated_tokens_per_s"] > 0 and sample["requests_per_s"] > 0
    assert sample["latency_p50_s"] > 0 and sample["latency_p90_s"] >= sample["latency_p50_s"]
    assert 0 <= sample["kv_cache_usage"] <= 1 and sample["waiting"] >= 0 and sample["running"] >= 0
    assert sample["window_s"] >= 3


def test_the_live_view_refreshes_until_ctrl_c(served):
    """Redrawn in place on a real terminal; printed table after table on a dumb one. Both views run at once."""
    tgi, job_id, url, key = served
    terminals = [Terminal(tgi.argv("metrics", job_id, "--interval", "0.5", "--window", "2"), tgi.env, term=term)
                 for term in ("xterm-256color", "dumb")]
    try:
        for terminal in terminals:
            terminal.expect(rf"job {job_id}.*server.*{re.escape(url)}.*generated.*tok/s.*latency p90.*Ctrl-C to leave",
                            timeout=120)
        for terminal in terminals:
            terminal.expect(r"Ctrl-C to leave", start=len(terminal.seen), timeout=60)     # drawn again
            terminal.send("\x03")
        for terminal in terminals:
            assert terminal.proc.wait(30) == 0
    finally:
        for terminal in terminals:
            terminal.close()


def test_metrics_and_chat_refuse_a_hostile_or_unknown_target(served):
    tgi = served[0]
    out = tgi("metrics", "4148; touch /tmp/x", "--json", check=False)
    assert out.returncode == 2 and "service name '4148; touch /tmp/x': use letters" in out.stderr
    out = tgi("chat", "no-such-service", check=False)
    assert out.returncode == 2 and "no service 'no-such-service'" in out.stderr
    out = tgi("metrics", "999999", "--json", "--timeout", "5", check=False)
    assert out.returncode == 5 and "no such job: 999999" in out.stderr


def _reference(url: str, key: str, messages: list[dict], **extra) -> str:
    """The same conversation asked directly (not streamed), greedy: what the chat must have shown."""
    answer = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                        json={"model": "tgi", "messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def _answer(term: Terminal, start: int) -> str:
    """The answer printed after `start`, up to the next prompt (the echoed input removed)."""
    found = term.expect(r"\r?\n(.*?)\r?\n> $", start=start)
    return found.group(1).replace("\r", "")


@pytest.mark.slow
def test_chat_through_a_pseudo_terminal(served):
    tgi, job_id, url, key = served
    term = Terminal(tgi.argv("chat", job_id, "--max-tokens", "8", "--temperature", "0"), tgi.env)
    try:
        term.expect(r"chat with job \d+.*\n> $")
        # /system, then a question: the answer is the greedy answer to [system, user], streamed
        # ... and its next prompt: under load it comes late, and the answer is read from after it
        term.expect(r"\(system prompt set\)\r?\n> $", start=term.send("/system You answer like a pirate.\n"))
        question = "What is the capital of France?"
        start = term.send(question + "\n")
        first = _answer(term, start)
        system = {"role": "system", "content": "You answer like a pirate."}
        assert first == _reference(url, key, [system, {"role": "user", "content": question}])
        answer_reads = [data for _, data in term.reads if data.strip() and data.strip() not in question]
        assert len(answer_reads) >= 2, f"the answer came in one piece: {term.reads[-5:]}"
        # the next turn carries the history
        start = term.send("And of Italy?\n")
        second = _answer(term, start)
        history = [system, {"role": "user", "content": question}, {"role": "assistant", "content": first},
                   {"role": "user", "content": "And of Italy?"}]
        assert second == _reference(url, key, history)
        # /reset forgets it (the system prompt stays): the first question gets the first answer again
        term.expect(r"\(conversation cleared\)", start=term.send("/reset\n"))
        term.expect(r"> $")
        assert _answer(term, term.send(question + "\n")) == first
        # a line ending in \ goes on: one message of two lines
        term.send("/reset\n")
        term.expect(r"cleared\)\r?\n> $")
        start = term.send("Say hello \\\n")
        term.expect(r"\.\.\. $", start=start)
        multi = _answer(term, term.send("in French.\n"))
        assert multi == _reference(url, key, [system, {"role": "user", "content": "Say hello \nin French."}])
        # an unknown command is refused, the chat goes on; /exit leaves cleanly
        term.expect(r"unknown command /nope", start=term.send("/nope\n"))
        term.send("/exit\n")
        assert term.proc.wait(30) == 0
    finally:
        term.close()


def test_chat_with_a_json_schema_answers_json_and_ctrl_d_leaves(served, tmp_path):
    tgi, job_id, url, key = served
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Rome", "Berlin"]}},
              "required": ["capital"], "additionalProperties": False}
    (tmp_path / "capital.json").write_text(json.dumps(schema))
    term = Terminal(tgi.argv("chat", job_id, "--json-schema", str(tmp_path / "capital.json"), "--max-tokens", "40",
                             "--temperature", "0"), tgi.env)
    try:
        term.expect(r"\n> $")
        answer = _answer(term, term.send("What is the capital of France? Answer in JSON.\n"))
        assert json.loads(answer)["capital"] in ("Paris", "Rome", "Berlin")
        term.send("\x04")   # Ctrl-D at the prompt
        assert term.proc.wait(30) == 0
    finally:
        term.close()
