"""/v1/completions for evaluation harnesses, through the real launcher and the real openai client: on SmolLM2
(fp32, CPU) prompt-token logprobs against transformers and an lm-evaluation-harness style multiple-choice loop;
on tiny-llama n / best_of / seeds, cached tokens and the prefix-cache counters, and hostile inputs."""
from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
huggingface_hub = pytest.importorskip("huggingface_hub")
text_generation = pytest.importorskip("text_generation")
transformers = pytest.importorskip("transformers")

from test_clients import start_server, stop_server  # noqa: E402

CONTEXT = "Question: Which planet is known as the red planet?\nAnswer:"
CHOICES = [" Mars", " Venus", " Jupiter", " the Moon"]
LONG = "The history of the printing press begins in the fifteenth century, when movable type changed how " \
       "books were made, sold and read across Europe, and soon the rest of the world. " * 3


@pytest.fixture(scope="module")
def smollm2(model_path, tmp_path_factory):
    path = model_path("smollm2")
    # one thread each: the server and the reference share the machine's cores (and other tests' processes)
    proc, url, _ = start_server(path, tmp_path_factory.mktemp("smollm2"), "--dtype", "float32",
                                "--max-total-tokens", "512", "--cpu-threads", "1")
    yield url, path
    stop_server(proc)


@pytest.fixture(scope="module")
def tiny(model_path, tmp_path_factory):
    proc, url, _ = start_server(model_path("tiny-llama"), tmp_path_factory.mktemp("tiny"), "--max-total-tokens", "512",
                                "--max-concurrent-requests", "16", "--cpu-threads", "1")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def hf(smollm2):
    _, path = smollm2
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, transformers.AutoTokenizer.from_pretrained(path)
    torch.set_num_threads(threads)


def hf_token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, straight from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def test_echo_logprobs_equal_transformers(smollm2, hf):
    url, _ = smollm2
    model, tok = hf
    ids = tok.encode(CONTEXT + CHOICES[0])
    out = client(url).completions.create(model="m", prompt=ids, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out.choices
    lp = choice.logprobs
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(hf_token_logprobs(model, ids), abs=1e-4)
    assert "".join(lp.tokens) == choice.text                    # tokens carry their leading spaces
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    for actual, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) <= 2 and max(top.values()) >= actual - 1e-5
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0


def _harness_scores(url: str, contexts: list[list[int]], continuations: list[list[int]],
                    max_tokens: int = 0) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's local-completions loglikelihood: one batched request of token-id prompts (the
    harness itself sends max_tokens 1 and drops the generated token's entry)."""
    prompts = [c + k for c, k in zip(contexts, continuations)]
    out = client(url).completions.create(model="m", prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                         temperature=0, seed=1234)
    assert [c.index for c in out.choices] == list(range(len(prompts)))
    results = []
    for choice, ctx, prompt in zip(out.choices, contexts, prompts):
        assert len(choice.logprobs.tokens) == len(prompt) + max_tokens
        end = len(prompt)
        lps = choice.logprobs.token_logprobs[len(ctx):end]
        tops = choice.logprobs.top_logprobs[len(ctx):end]
        results.append((sum(lps), all(lp >= max(top.values()) - 1e-6 for lp, top in zip(lps, tops))))
    return results


def test_multiple_choice_loop_matches_transformers(smollm2, hf):
    url, _ = smollm2
    model, tok = hf
    ctx = tok.encode(CONTEXT)
    conts = [tok.encode(c, add_special_tokens=False) for c in CHOICES]
    served = _harness_scores(url, [ctx] * len(conts), conts)
    reference = []
    for cont in conts:  # the same loop on transformers: one forward per (context, continuation)
        ids = ctx + cont
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, len(ctx) - 1:-1].float(), dim=-1)
        lps = logprobs.gather(1, torch.tensor(cont)[:, None]).squeeze(1)
        reference.append((float(lps.sum()), logprobs.argmax(-1).tolist() == cont))
    assert [s for s, _ in served] == pytest.approx([s for s, _ in reference], abs=1e-4)
    assert [g for _, g in served] == [g for _, g in reference]
    best = max(range(len(conts)), key=lambda i: served[i][0])
    assert best == max(range(len(conts)), key=lambda i: reference[i][0])
    harness = _harness_scores(url, [ctx] * len(conts), conts, max_tokens=1)
    assert [s for s, _ in harness] == pytest.approx([s for s, _ in served], abs=1e-5)
    assert [g for _, g in harness] == [g for _, g in served]


def test_n_choices_are_reproducible_with_a_seed(tiny):
    url = tiny
    oai = client(url)
    kwargs = dict(model="m", prompt="Once upon a time", n=3, max_tokens=8, temperature=1.0, seed=1234)
    first, again = oai.completions.create(**kwargs), oai.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(texts) == 3
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1                                  # each choice has its own seed
    assert 3 <= first.usage.completion_tokens <= 3 * 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    chat = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6,
                                       seed=7, logprobs=True, top_logprobs=2)
    chat2 = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6,
                                        seed=7, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in chat2.choices]
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content[0].top_logprobs) == 2 for c in chat.choices)
    stream = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], n=3,
                                              max_tokens=6, seed=7, stream=True))
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in chat.choices]


def test_best_of_returns_the_highest_cumulative_logprob(tiny):
    url = tiny
    oai = client(url)
    kwargs = dict(model="m", prompt="My favourite food is", max_tokens=6, temperature=1.0, seed=99)
    every = oai.completions.create(n=3, logprobs=0, **kwargs)
    best = oai.completions.create(n=1, best_of=3, **kwargs)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len(best.choices) == 1
    assert best.choices[0].text == every.choices[scores.index(max(scores))].text


def test_cached_tokens_and_prefix_cache_counters(tiny):
    url = tiny
    oai = client(url)

    def counters() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("tgi_prefix_cache", "tgi_prompt_tokens", "tgi_generated_tokens"))}

    before = counters()
    prompt = "Fresh: " + LONG
    first = oai.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    again = oai.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    # n choices share the prompt: the first computes it, the others read its blocks
    shared = oai.completions.create(model="m", prompt="Shared: " + LONG, n=3, max_tokens=2, seed=1)
    assert shared.usage.prompt_tokens_details.cached_tokens > 0
    chat = [{"role": "user", "content": LONG}]
    oai.chat.completions.create(model="m", messages=chat, max_tokens=1)
    stream = list(oai.chat.completions.create(model="m", messages=chat, max_tokens=1, stream=True,
                                              stream_options={"include_usage": True}))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens > 0
    after = counters()
    hits = after["tgi_prefix_cache_hit_tokens_total"] - before["tgi_prefix_cache_hit_tokens_total"]
    queried = after["tgi_prefix_cache_queried_tokens_total"] - before["tgi_prefix_cache_queried_tokens_total"]
    assert 0 < hits < queried
    assert after["tgi_prompt_tokens_total"] > before["tgi_prompt_tokens_total"]
    assert after["tgi_generated_tokens_total"] - before["tgi_generated_tokens_total"] >= 2 + 2 + 6 + 2


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(prompt="x", n=0), "`n`"),
    (dict(prompt="x", n=17), "must be <= 16 sequences"),
    (dict(prompt="x", n=3, best_of=2), "`best_of` must be >= `n`"),
    (dict(prompt="x", logprobs=6), "`logprobs` must be <= 5"),
    (dict(prompt=[1, 1024]), "< 1024 (the vocabulary)"),
    (dict(prompt=[]), "`prompt` must be"),
    (dict(prompt=[[1, 2], []]), "`prompt` must be"),
    (dict(prompt=[[1, 2], "text"]), "`prompt` must be"),
    (dict(prompt=[1, [2]]), "`prompt` must be"),
    (dict(prompt="x", max_tokens=10_000), "must be <= 512"),
])
def test_hostile_inputs_are_422(tiny, kwargs, fragment):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client(tiny).completions.create(model="m", **kwargs)
    body = info.value.response.json()
    assert body["error_type"] == "validation" and fragment in body["error"], body


def test_prefix_caching_off_reports_no_cached_tokens(model_path, tmp_path):
    proc, url, _ = start_server(model_path("tiny-llama"), tmp_path, "--prefix-caching", "false", "--cpu-threads", "1",
                                "--max-new-tokens-default", "3")
    try:
        oai = client(url)
        for _ in range(2):
            out = oai.completions.create(model="m", prompt=LONG, max_tokens=2, n=2, seed=3)
            assert out.usage.prompt_tokens_details.cached_tokens == 0
        text = httpx.get(f"{url}/metrics").text
        assert "tgi_prefix_cache_hit_tokens_total 0.0" in text
        assert httpx.get(f"{url}/info").json()["prefix_caching"] is False
        # no limit in the request: the server's default (3), not all the room the context leaves
        gen = huggingface_hub.InferenceClient(model=url, timeout=60).text_generation("Hello", details=True)
        assert gen.details.generated_tokens <= 3
        tgi = text_generation.Client(url, timeout=60)           # sends its own max_new_tokens (20)
        assert tgi.generate("Hello", decoder_input_details=True).details.generated_tokens <= 20
        with pytest.raises(text_generation.errors.ValidationError, match="`max_new_tokens` must be <="):
            tgi.generate("Hello", max_new_tokens=100_000)       # a limit that does not fit: refused, not cut
        chat = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        assert chat.usage.completion_tokens <= 3
    finally:
        stop_server(proc)
