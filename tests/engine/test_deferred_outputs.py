"""Outputs of noted decode rows (engine/deferred_outputs.py), built where they are delivered, equal the ones the step
thread builds, field for field, before and after their text is decoded; only plain rows of deferred sequences are
noted; AsyncEngine hands each event loop the rows of its own streams."""
import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")

import engine.llm_engine as llm_engine  # noqa: E402
from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.deferred_outputs import DeferredRows, expand  # noqa: E402
from engine.deferred_text import fill  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import FakeModelConfig, FakeRunner  # noqa: E402
from test_deferred_text import VOCAB, ScriptedRunner, scripts_for, tokenizer  # noqa: E402, F401

PARAMS = {
    "plain": SamplingParams(max_new_tokens=9, ignore_eos=True),
    "no-logprobs": SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=False),
    "alternatives": SamplingParams(max_new_tokens=6, ignore_eos=True, top_n_tokens=3),       # never noted
    "prompt-logprobs": SamplingParams(max_new_tokens=5, ignore_eos=True, prefill_logprobs=True),  # first not noted
    "stop-string": SamplingParams(max_new_tokens=8, ignore_eos=True, stop=["zzz"]),          # text on the step thread
    "seeded": SamplingParams(max_new_tokens=8, ignore_eos=True, do_sample=True, temperature=0.7, seed=5),
    "eos": SamplingParams(max_new_tokens=30),
    "one": SamplingParams(max_new_tokens=1),
    "aborted": SamplingParams(max_new_tokens=30, ignore_eos=True),
}


def engine_for(tokenizer, note, monkeypatch):
    if not note:    # every row built on the step thread, as before the rows were noted
        monkeypatch.setattr(llm_engine, "DeferredRows", lambda *args: None)
    engine = LLMEngine(EngineConfig(max_batch_prefill_tokens=24), runner=FakeRunner(VOCAB, 20, 4),
                       model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    engine.defer_text = True
    for i, (rid, params) in enumerate(PARAMS.items()):
        engine.add_request(rid, [100 + i, 7, 8, 9, 10, 11], params)
    return engine


def snapshot(out):
    """Every field of `out`; its pending text as (first, upto, final) (the DeferredText objects are the engine's)."""
    fields = {name: getattr(out, name) for name in out.__slots__ if name != "pending"}
    fields["tokens"] = [(t.id, t.text, t.logprob, t.special, [(a.id, a.logprob) for a in t.top_tokens])
                        for t in out.tokens]
    fields["pending"] = None if out.pending is None else out.pending[1:]
    return fields


def run(tokenizer, note, monkeypatch):
    """Per step: the snapshots of its outputs before and after their text is decoded, and how many rows it noted."""
    engine = engine_for(tokenizer, note, monkeypatch)
    steps = []
    while engine.has_unfinished_requests():
        if len(steps) == 4:
            engine.abort("aborted")
        raw = engine.step()
        noted = sum(len(out) for out in raw if isinstance(out, DeferredRows))
        outs = expand(raw)
        before = sorted((snapshot(out) for out in outs), key=lambda f: f["request_id"])
        for out in outs:
            fill(out)
        after = sorted((snapshot(out) for out in outs), key=lambda f: f["request_id"])
        steps.append((before, after, noted))
    monkeypatch.undo()
    return steps, engine.stats().num_preempted_total


def test_noted_rows_build_what_the_step_thread_builds(tokenizer, monkeypatch):
    built, _ = run(tokenizer, note=False, monkeypatch=monkeypatch)
    noted, preempted = run(tokenizer, note=True, monkeypatch=monkeypatch)
    assert preempted > 0        # 20 blocks of 4 for nine requests: preemption and recompute in the middle
    assert [(b, a) for b, a, _ in noted] == [(b, a) for b, a, _ in built]
    assert sum(n for _, _, n in noted) > len(PARAMS) * 3 and not any(n for _, _, n in built)
    outputs = [out for _, after, _ in noted for out in after]
    assert any(out["tokens"][0][2] is None for out in outputs if out["request_id"] == "no-logprobs" and out["tokens"])
    assert {out["finish_reason"] for out in outputs if out["finished"]} >= {"length", "aborted"}


def test_only_plain_rows_of_deferred_sequences_are_noted(tokenizer, monkeypatch):
    engine = engine_for(tokenizer, note=True, monkeypatch=monkeypatch)
    seen: dict[str, list[bool]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, DeferredRows):
                assert len(out) == len(out.rows) == len(out.num_tokens)
                for seq in out.seqs:
                    seen.setdefault(seq.request_id, []).append(True)
            else:
                seen.setdefault(out.request_id, []).append(False)
    assert not any(seen["alternatives"]) and not any(seen["stop-string"])
    assert seen["prompt-logprobs"][0] is False and any(seen["prompt-logprobs"][1:])
    assert seen["plain"][-1] is False and all(seen["plain"][1:-1])       # its last output ends it: built in step()
    assert seen["one"] == [False]


def test_async_engine_gives_each_loop_its_own_streams_rows(tokenizer):
    """Streams on two event loops (two threads): each gets its own outputs, equal to the eager ones."""
    def eager_outputs():
        engine = LLMEngine(EngineConfig(), runner=ScriptedRunner(scripts_for(tokenizer), num_kv_blocks=256),
                           model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
        return {out.request_id: out for out in engine.generate(
            [[first, 1, 2, 3] for first in (10, 11, 12, 14)],
            [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4)}

    engine = LLMEngine(EngineConfig(), runner=ScriptedRunner(scripts_for(tokenizer), num_kv_blocks=256),
                       model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    async_engine = AsyncEngine(engine).start()
    results: dict[str, list] = {}

    async def collect(rid, first):
        results[rid] = [out async for out in async_engine.generate(
            rid, [first, 1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))]

    def loop(pairs):
        async def main():
            await asyncio.gather(*(collect(rid, first) for rid, first in pairs))
        asyncio.run(main())

    threads = [threading.Thread(target=loop, args=([("a", 10), ("b", 11)],)),
               threading.Thread(target=loop, args=([("c", 12), ("d", 14)],))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        async_engine.close()
    eager = list(eager_outputs().values())
    for rid, want in zip("abcd", eager):
        outs = results[rid]
        assert [t.id for o in outs for t in o.tokens] == [t.id for t in want.tokens], rid
        assert "".join(o.text for o in outs) == want.generated_text == outs[-1].generated_text, rid
        assert len(outs) == 12 and outs[-1].finished and all(o.pending is None for o in outs), rid


def test_an_output_that_cannot_be_built_ends_that_request_alone(tokenizer, monkeypatch):
    from engine.async_engine import RequestFailedError
    engine = LLMEngine(EngineConfig(), runner=ScriptedRunner(scripts_for(tokenizer), num_kv_blocks=256),
                       model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    build = DeferredRows.output

    def hostile(self, i):
        if self.seqs[i].request_id == "bad" and self.num_tokens[i] >= 7:
            raise ValueError("hostile")
        return build(self, i)

    monkeypatch.setattr(DeferredRows, "output", hostile)
    async_engine = AsyncEngine(engine).start()

    async def collect(rid, first):
        outs = []
        try:
            async for out in async_engine.generate(rid, [first, 1, 2, 3], SamplingParams(max_new_tokens=12,
                                                                                        ignore_eos=True)):
                outs.append(out)
        except RequestFailedError as error:
            return outs, str(error)
        return outs, None

    async def main():       # bounded: a row dropped without an answer would leave its stream waiting forever
        return await asyncio.wait_for(asyncio.gather(collect("bad", 10), collect("good", 11)), 60)

    try:
        (bad, bad_error), (good, good_error) = asyncio.run(main())
        for _ in range(200):            # the aborted request leaves the engine too
            if not engine.has_unfinished_requests():
                break
            threading.Event().wait(0.01)
        assert not engine.has_unfinished_requests()
    finally:
        async_engine.close()
    assert bad_error == "building the output failed: ValueError: hostile" and len(bad) == 2
    assert good_error is None and len(good) == 12 and good[-1].finished
