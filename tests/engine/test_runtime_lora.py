"""Runtime LoRA (--enable-runtime-lora): adapters built with the real `peft`, loaded into and unloaded from the
engine's slots while it serves. Greedy tokens of a loaded adapter equal the merged PEFT model's, also after a
slot is reused (no prefix-cache blocks of the slot's earlier adapter); each refused load names its reason; and
through the launcher and the real `openai` client: /v1/models follows, a stream on an adapter being unloaded
finishes first, requests for it are refused after, 16 clients stream through loads, unloads and reloads, and a
server without the flag says how to turn it on."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora.adapter import LoraError  # noqa: E402
from engine.lora.runtime import RuntimeAdapters  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402
from lora_adapters import make_adapter  # noqa: E402
from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.slow
TEXT = "The quick brown fox jumps over the lazy dog and then runs far away"


@pytest.fixture(scope="module")
def tiny(model_path, tmp_path_factory):
    base = model_path("tiny-llama")
    root = tmp_path_factory.mktemp("runtime-adapters")
    merged = {name: make_adapter(base, root / name, seed=seed, r=4, alpha=8, targets=targets)
              for name, seed, targets in [("a1", 1, ["q_proj", "v_proj", "down_proj"]),
                                          ("a2", 2, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
                                          ("a3", 3, ["q_proj", "v_proj", "down_proj"])]}
    make_adapter(base, root / "wide", seed=4, r=16, alpha=8, targets=["q_proj"])
    make_adapter(model_path("smollm2"), root / "smol", targets=["q_proj"])
    return {"base": base, "root": root, "merged": merged}


def test_loaded_adapters_equal_the_merged_peft_models_and_slots_are_reused_cleanly(tiny):
    config = EngineConfig(model_id=str(tiny["base"]), device="cpu", dtype="float32", block_size=4,
                          cpu_kv_cache_bytes=16 * 1024**2, enable_runtime_lora=True, max_loras=2, max_lora_rank=8)
    root = tiny["root"]
    with LLMEngine(config) as engine:
        runtime = RuntimeAdapters(engine, "tiny-llama", config.max_lora_rank)
        ids = engine.tokenizer.encode(TEXT)

        def tokens(adapter):
            [out] = engine.generate([ids], SamplingParams(max_new_tokens=10, adapter_id=adapter))
            return [t.id for t in out.tokens]

        base = tokens(None)
        runtime.load("a1", str(root / "a1"))
        runtime.load("a2", str(root / "a2"))
        assert tokens("a1") == hf_greedy(tiny["merged"]["a1"], ids, 10) != base
        assert tokens("a2") == hf_greedy(tiny["merged"]["a2"], ids, 10)
        refusals = [
            (("extra", str(root / "a3")), "no free LoRA slot: 2 of --max-loras 2 are taken"),
            (("a1", str(root / "a3")), "'a1' is already loaded"),
            (("tgi", str(root / "a3")), "base model's name"),
            (("x y", str(root / "a3")), "is not valid"),
            (("x", str(root / "missing")), "no such directory"),
        ]
        runtime.begin_unload("a2")
        assert runtime.try_finish_unload("a2")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'a2'"):
            tokens("a2")
        refusals += [(("w", str(root / "wide")), "rank 16, more than this server's --max-lora-rank 8"),
                     (("s", str(root / "smol")), "does not fit this base model")]
        for args, message in refusals[1:]:
            with pytest.raises(ValueError, match=message) as info:
                runtime.load(*args)
            assert "\n" not in str(info.value)
        with pytest.raises(LoraError, match="'nope' is not loaded"):
            runtime.begin_unload("nope")
        # a1 out, a3 into its slot: the prompt a1 cached under that slot must not be reused for a3
        runtime.begin_unload("a1")
        assert runtime.try_finish_unload("a1")
        runtime.load("a3", str(root / "a3"))
        runtime.load("a2", str(root / "a2"))
        with pytest.raises(ValueError, match=refusals[0][1]):
            runtime.load(*refusals[0][0])
        assert tokens("a3") == hf_greedy(tiny["merged"]["a3"], ids, 10)
        assert tokens("a2") == hf_greedy(tiny["merged"]["a2"], ids, 10)
        assert tokens(None) == base


def test_unload_waits_for_the_requests_on_the_adapter(tiny):
    config = EngineConfig(model_id=str(tiny["base"]), device="cpu", dtype="float32", block_size=4,
                          cpu_kv_cache_bytes=16 * 1024**2, enable_runtime_lora=True, max_loras=1)
    async def run():
        engine = AsyncEngine(LLMEngine(config)).start()
        try:
            runtime = RuntimeAdapters(engine.engine, "tiny-llama", config.max_lora_rank)
            await engine.call(lambda: runtime.load("a1", str(tiny["root"] / "a1")))
            ids = engine.engine.tokenizer.encode(TEXT)
            params = SamplingParams(max_new_tokens=40, adapter_id="a1", ignore_eos=True)
            stream = engine.generate("r1", ids, params)
            first = await stream.__anext__()
            await engine.call(lambda: runtime.begin_unload("a1"))
            assert not await engine.call(lambda: runtime.try_finish_unload("a1"))    # r1 still runs on it
            outs = [first] + [out async for out in stream]
            assert outs[-1].finished and sum(len(o.tokens) for o in outs) == 40
            assert await engine.call(lambda: runtime.try_finish_unload("a1"))
            assert engine.engine.adapter_names == [None]
        finally:
            engine.close()
    asyncio.run(run())


def test_load_use_unload_through_the_server(tiny, tmp_path):
    root = tiny["root"]
    proc, url, log = start_server(tiny["base"], tmp_path, "--enable-runtime-lora", "--max-loras", "2",
                                  "--max-lora-rank", "8")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    try:
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(root / "a1")})
        assert reply.status_code == 200, reply.text
        assert [m.id for m in client.models.list().data][1:] == ["a1"]
        for body, status, message in [
            ({"lora_name": "a1", "lora_path": str(root / "a2")}, 422, "already loaded"),
            ({"lora_name": "w", "lora_path": str(root / "wide")}, 422, "--max-lora-rank 8"),
            ({"lora_name": "s", "lora_path": str(root / "smol")}, 422, "does not fit this base model"),
            ({"lora_name": "m", "lora_path": str(root / "nowhere")}, 422, "no such directory"),
            ({"lora_name": 3, "lora_path": "x"}, 422, "`lora_name`"),
        ]:
            reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
            assert reply.status_code == status and message in reply.json()["error"], reply.text
        messages = [{"role": "user", "content": TEXT}]
        whole = client.chat.completions.create(model="a1", messages=messages, max_tokens=8, temperature=0)
        assert whole.model == "a1"
        # a stream on a1 is running when a1 is unloaded: it ends normally, and the unload waits for it
        chunks, done = [], threading.Event()

        def consume():
            for chunk in client.chat.completions.create(model="a1", messages=messages, max_tokens=60, stream=True,
                                                        temperature=0, extra_body={"ignore_eos": True}):
                chunks.append(chunk)
            done.set()
        reader = threading.Thread(target=consume)
        reader.start()
        while not chunks:
            time.sleep(0.01)
        reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"}, timeout=120)
        assert reply.status_code == 200, reply.text
        reader.join()
        assert done.is_set() and chunks[-1].choices[0].finish_reason == "length"
        assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 50   # all of it came
        assert [m.id for m in client.models.list().data][1:] == []
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model="a1", messages=messages, max_tokens=4)
        assert "unknown adapter 'a1'" in info.value.response.text
        reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert reply.status_code == 422 and "is not loaded" in reply.json()["error"]
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(root / "a3")})
        assert reply.status_code == 200
        assert client.chat.completions.create(model="a1", messages=messages, max_tokens=8, temperature=0).model == "a1"
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
    assert "Traceback" not in log.read_text()


def test_off_by_default_with_the_way_to_turn_it_on(tiny, tmp_path):
    proc, url, _ = start_server(tiny["base"], tmp_path)
    try:
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(tiny["root"])})
        assert reply.status_code == 404 and "--enable-runtime-lora" in reply.json()["error"]
        assert reply.json()["error_type"] == "not_found"
    finally:
        stop_server(proc)


def test_sixteen_streams_while_adapters_are_loaded_unloaded_and_reloaded(tiny, tmp_path):
    """8 clients stream on the base model and a steady adapter the whole time; 8 more stream on `a2`, which is
    unloaded while they are mid-stream, reloaded with other weights (a3's) and unloaded again. No request fails,
    every greedy text equals the same request's text alone: an unload emptying the slot under a running stream
    would change its text, and a load disturbing another slot would change the steady ones."""
    root = tiny["root"]
    proc, url, log = start_server(tiny["base"], tmp_path, "--enable-runtime-lora", "--max-loras", "3",
                                  "--max-lora-rank", "8", "--dtype", "float32")
    try:
        asyncio.run(_churn(url, root))
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
    assert "Traceback" not in log.read_text()


async def _churn(url, root):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    http = httpx.AsyncClient(base_url=url, timeout=120)
    messages = [{"role": "user", "content": TEXT}]

    async def stream(model):
        """(text, number of chunks) of one greedy stream; `started` is set at its first piece of text."""
        pieces = []
        async for chunk in await client.chat.completions.create(
                model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                yield "".join(pieces)

    async def text_of(model):
        text = ""
        async for text in stream(model):
            pass
        return text

    async def adapter(action, **body):
        reply = await http.post(f"/v1/{action}_lora_adapter", json=body)
        assert reply.status_code == 200, reply.text

    for name in ("a1", "a2", "a3"):
        await adapter("load", lora_name=name, lora_path=str(root / name))
    base_model = (await client.models.list()).data[0].id
    expected = {m: await text_of(m) for m in (base_model, "a1", "a2", "a3")}
    assert len(set(expected.values())) == 4, expected
    await adapter("unload", lora_name="a3")

    stop, done = asyncio.Event(), []

    async def steady(i):
        while not stop.is_set():
            model = (base_model, "a1")[i % 2]
            assert await text_of(model) == expected[model]
            done.append(model)

    async def on_a2():
        started = asyncio.Event()

        async def one():
            text = ""
            async for text in stream("a2"):
                started.set()
            return text
        return started, asyncio.create_task(one())

    steady_tasks = [asyncio.create_task(steady(i)) for i in range(8)]
    try:
        for round_, weights in enumerate(("a2", "a3")):
            if round_:      # the first round's a2 is already loaded
                await adapter("load", lora_name="a2", lora_path=str(root / weights))
            runs = [await on_a2() for _ in range(8)]
            for started, _ in runs:
                await started.wait()
            assert not all(task.done() for _, task in runs)
            await adapter("unload", lora_name="a2")
            # all of every stream came, with a2's weights of this round to the end
            assert [await task for _, task in runs] == [expected[weights]] * 8
            reply = await http.post("/v1/chat/completions", json={"model": "a2", "messages": messages})
            assert reply.status_code == 422 and "unknown adapter 'a2'" in reply.json()["error"]
    finally:
        stop.set()
        await asyncio.gather(*steady_tasks)
    assert done.count(base_model) >= 4 and done.count("a1") >= 4
    await http.aclose()
