"""`python -m engine` with SPECULATE=3 on a tiny model, through the real clients: one SSE event per accepted
token, the same tokens streamed or not, the draft counters in /metrics and `speculate` in /info."""
from __future__ import annotations

import re

import httpx
import pytest

pytest.importorskip("torch")
text_generation = pytest.importorskip("text_generation")
openai = pytest.importorskip("openai")

from engine.launcher import parse_args, to_config  # noqa: E402
from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

PROMPT = "one two three one two three one two three"


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc, url, _ = start_server(model_path("tiny-llama"), tmp_path_factory.mktemp("spec"), env={"SPECULATE": "3"})
    yield url
    try:
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {name: float(value) for name, value in re.findall(r"^(tgi_speculative_\w+) (\S+)$", text, re.MULTILINE)}


def test_streamed_tokens_are_the_generated_ones_one_event_each(server):
    client = text_generation.Client(server, timeout=60)
    before = counters(server)
    resp = client.generate(PROMPT, max_new_tokens=40, top_n_tokens=2)
    events = list(client.generate_stream(PROMPT, max_new_tokens=40, top_n_tokens=2))
    after = counters(server)
    assert [e.token.id for e in events] == [t.id for t in resp.details.tokens]
    assert [e.token.logprob for e in events] == pytest.approx([t.logprob for t in resp.details.tokens], abs=1e-4)
    assert all(len(e.top_tokens) == 2 for e in events)
    assert "".join(e.token.text for e in events) == events[-1].generated_text == resp.generated_text
    assert [e.generated_text is None for e in events] == [True] * (len(events) - 1) + [False]
    accepted = after["tgi_speculative_accepted_tokens_total"] - before["tgi_speculative_accepted_tokens_total"]
    proposed = after["tgi_speculative_proposed_tokens_total"] - before["tgi_speculative_proposed_tokens_total"]
    assert 0 < accepted <= proposed


def test_openai_stream_adds_up_and_info_shows_speculate(server):
    assert httpx.get(f"{server}/info").json()["speculate"] == 3
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="-")
    whole = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=30, temperature=0)
    chunks = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=30, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_speculate_flag_and_env_twin():
    assert to_config(parse_args(["--model-id", "m"], environ={}), "m").speculate == 0
    assert to_config(parse_args(["--model-id", "m"], environ={"SPECULATE": "4"}), "m").speculate == 4
    assert to_config(parse_args(["--model-id", "m", "--speculate", "2"], environ={"SPECULATE": "4"}), "m").speculate == 2
    for bad in ("-1", "x", "17"):
        with pytest.raises(SystemExit):
            parse_args(["--model-id", "m", "--speculate", bad], environ={})
