"""Text decoded where outputs are delivered (engine/deferred_text.py) equals the text the step thread would have
decoded, output by output: on hostile token runs (characters split over byte tokens, specials, ids past the
tokenizer's vocabulary, a cut mid-character), EOS, length limits, aborts, failed steps, preemption and outputs never
delivered; sequences with stop strings keep their text on the step thread."""
import asyncio

import pytest

torch = pytest.importorskip("torch")

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.deferred_outputs import expand  # noqa: E402
from engine.deferred_text import fill  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import FakeModelConfig, FakeRunner, test_model_path  # noqa: E402

PROMPT_LEN = 4
VOCAB = 49152 + 128      # SmolLM2's tokenizer and 128 padded rows past it (they decode to "")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(test_model_path("smollm2"))


class ScriptedRunner(FakeRunner):
    """Each sequence generates its script (chosen by its prompt's first token), read back from its KV slots."""

    def __init__(self, scripts, num_kv_blocks=12, block_size=4):
        super().__init__(VOCAB, num_kv_blocks, block_size)
        self.scripts = scripts

    def run(self, spans):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        for span in spans:
            for i, token in enumerate(span.token_ids):
                self.slots[self._slot(span, span.start_pos + i)] = token
        rows = []
        for span in spans:
            if span.logits == "none":
                continue
            end = span.start_pos + len(span.token_ids)
            context = [self.slots[self._slot(span, p)] for p in range(end)]
            script = self.scripts[context[0]]
            row = torch.zeros(VOCAB)
            row[script[(end - PROMPT_LEN) % len(script)]] = 5.0
            rows.append(row)
        return (torch.stack(rows) if rows else torch.empty(0, VOCAB)), {}


def scripts_for(tokenizer):
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    emoji = enc("😀🇫🇷 👨‍👩‍👧")
    specials = sorted(set(tokenizer.all_special_ids))
    return {
        10: enc("héllo wörld, naïve café — “quotes”"),
        11: enc(" ok") + emoji,            # "cut" stops after 1 + 2 tokens: mid-way through 😀's three
        12: [specials[0]] + enc("a") + [49152 + 7] + enc(" b") + [specials[-1]],
        13: enc("日本語のテキスト") + [tokenizer.eos_token_id] + enc("never"),
        14: enc("  spaces\n\ttabs ") * 3,
    }


def requests():
    yield "plain", [10, 1, 2, 3], SamplingParams(max_new_tokens=12)
    yield "cut", [11, 1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True)
    yield "specials", [12, 1, 2, 3], SamplingParams(max_new_tokens=11, ignore_eos=True)
    yield "specials-kept", [12, 4, 5, 6], SamplingParams(max_new_tokens=11, ignore_eos=True, skip_special_tokens=False)
    yield "eos", [13, 1, 2, 3], SamplingParams(max_new_tokens=30)
    yield "one", [14, 1, 2, 3], SamplingParams(max_new_tokens=1)
    yield "stopped", [14, 4, 5, 6], SamplingParams(max_new_tokens=30, stop=["tabs"])   # eager: text can end it
    yield "aborted", [10, 4, 5, 6], SamplingParams(max_new_tokens=40)
    yield "long", [11, 4, 5, 6], SamplingParams(max_new_tokens=40, ignore_eos=True)
    yield "dropped", [14, 7, 8, 9], SamplingParams(max_new_tokens=20, ignore_eos=True)


def run(tokenizer, defer, drop=frozenset(), fail_at=None):
    """Every request's outputs, filled as delivered (the outputs of "dropped" at the indices in `drop` never are)."""
    runner = ScriptedRunner(scripts_for(tokenizer))
    engine = LLMEngine(EngineConfig(max_batch_prefill_tokens=16), runner=runner,
                       model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    engine.defer_text = defer
    for rid, ids, params in requests():
        engine.add_request(rid, ids, params)
    streams, step, num_dropped = {}, 0, 0
    while engine.has_unfinished_requests():
        step += 1
        if len(streams.get("aborted", ())) == 3:
            engine.abort("aborted")
        if step == fail_at:
            runner.fail_next = True
        for out in expand(engine.step()):
            if out.request_id == "dropped":
                num_dropped += 1
                if num_dropped - 1 in drop:
                    continue                                    # never delivered: its client was not reading
            fill(out)
            streams.setdefault(out.request_id, []).append(out)
    return streams, engine.stats().num_preempted_total


def test_deferred_text_equals_the_step_threads_output_by_output(tokenizer):
    eager, preempted = run(tokenizer, defer=False)
    deferred, _ = run(tokenizer, defer=True)
    assert preempted > 0                                         # the small cache preempts and recomputes
    assert deferred == eager
    assert all(out.pending is None for outs in deferred.values() for out in outs)
    cut = eager["cut"][-1]
    assert cut.finish_reason == "length" and cut.generated_text.endswith("\ufffd")   # flushed mid-character
    assert eager["eos"][-1].finish_reason == "eos_token" and eager["aborted"][-1].finish_reason == "aborted"
    assert eager["stopped"][-1].finish_reason == "stop_sequence"
    assert len(eager["aborted"]) == 4 and not eager["aborted"][-1].tokens
    plain = eager["plain"][-1].generated_text
    assert "".join(o.text for o in eager["plain"]) == plain and "héllo wörld, naïve café".startswith(plain[:10])


def test_which_sequences_defer(tokenizer):
    runner = ScriptedRunner(scripts_for(tokenizer))
    engine = LLMEngine(EngineConfig(), runner=runner, model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    engine.defer_text = True
    for rid, ids, params in requests():
        engine.add_request(rid, ids, params)
    seqs = {seq.request_id: seq for _, seq in engine._pending}
    assert seqs["stopped"].deferred is None                       # a stop string reads the text in step()
    assert all(seq.deferred is not None for rid, seq in seqs.items() if rid != "stopped")
    outs = expand(engine.step())
    assert outs and all(out.text == "" and out.pending is not None for out in outs if out.request_id != "stopped")


def test_outputs_never_delivered_are_decoded_by_the_next_one(tokenizer):
    eager, _ = run(tokenizer, defer=False)
    deferred, _ = run(tokenizer, defer=True, drop={1, 2, 3})
    assert deferred["dropped"] == eager["dropped"][:1] + eager["dropped"][4:]
    assert deferred["dropped"][-1].generated_text == eager["dropped"][-1].generated_text
    assert {k: v for k, v in deferred.items() if k != "dropped"} == {k: v for k, v in eager.items() if k != "dropped"}


def test_a_failed_step_ends_deferred_sequences_as_it_ends_eager_ones(tokenizer):
    eager, _ = run(tokenizer, defer=False, fail_at=6)
    deferred, _ = run(tokenizer, defer=True, fail_at=6)
    assert deferred == eager
    assert any(out.error for outs in deferred.values() for out in outs)


def second_output(tokenizer):
    """The second output of a deferred request, not filled yet."""
    runner = ScriptedRunner(scripts_for(tokenizer))
    engine = LLMEngine(EngineConfig(), runner=runner, model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    engine.defer_text = True
    engine.add_request("plain", [10, 1, 2, 3], SamplingParams(max_new_tokens=12))
    engine.step()
    return expand(engine.step())[0]


def test_a_decoding_failure_ends_that_request_with_the_error(tokenizer, monkeypatch):
    out = second_output(tokenizer)
    monkeypatch.setattr(out.pending[0].detokenizer, "decode_next", lambda *a: 1 / 0)
    fill(out)
    assert out.finished and out.finish_reason is None and out.pending is None
    assert out.error == "detokenizing failed: ZeroDivisionError: division by zero"


def test_async_engine_defers_and_its_streams_get_the_eager_text(tokenizer):
    eager, _ = run(tokenizer, defer=False)
    runner = ScriptedRunner(scripts_for(tokenizer), num_kv_blocks=256)
    engine = LLMEngine(EngineConfig(), runner=runner, model_config=FakeModelConfig(VOCAB, 512), tokenizer=tokenizer)
    async_engine = AsyncEngine(engine)
    assert engine.defer_text
    async_engine.start()

    async def collect(rid, ids, params):
        return [out async for out in async_engine.generate(rid, ids, params)]

    async def main():
        wanted = [r for r in requests() if r[0] not in ("aborted", "dropped")]
        results = await asyncio.gather(*(collect(*r) for r in wanted))
        return dict(zip((r[0] for r in wanted), results))

    try:
        streams = asyncio.run(main())
    finally:
        async_engine.close()
    for rid, outs in streams.items():
        assert "".join(o.text for o in outs) == "".join(o.text for o in eager[rid]), rid
        assert outs[-1].generated_text == eager[rid][-1].generated_text, rid
        assert [t.id for o in outs for t in o.tokens] == [t.id for o in eager[rid] for t in o.tokens], rid


def test_delivery_fills_request_outputs_and_passes_anything_else_through(tokenizer):
    from engine.async_engine import _deliver
    out = second_output(tokenizer)
    assert out.pending is not None

    class Queue(list):
        put_nowait = list.append

    queue, pooled = Queue(), object()     # a pooling engine's result has no text (engine/pooling)
    _deliver([(queue, out), (queue, pooled)])
    assert queue == [out, pooled] and out.pending is None and out.text
