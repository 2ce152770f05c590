"""Tiny random pooling checkpoints (scripts/make_models.py) through the engine against transformers plus
sentence-transformers' own pooling: BERT, XLM-R, ModernBERT and NomicBERT encoders, a Qwen3 last-token embedder, a BERT
cross-encoder; the rerank order against sentence-transformers' CrossEncoder. In-process, no HTTP server."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

from engine.config import EngineConfig  # noqa: E402
from engine.pooling.engine import PoolingEngine  # noqa: E402
from engine.pooling.pooler import normalize  # noqa: E402
from engine.pooling.spec import detect  # noqa: E402

EMBEDDERS = ["tiny-bert-embed", "tiny-xlmr-embed", "tiny-modernbert-embed", "tiny-nomicbert-embed", "tiny-qwen3-embed"]


def mixed_texts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths, some past a 128-token max_seq_length (truncated like sentence-transformers does)."""
    from pydoc_data.topics import topics
    words = " ".join(topics[k] for k in sorted(topics)).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([1, 2, 5, 12, 30, 70, 150])
        start = rng.randrange(len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out


def engine_for(path, **overrides) -> PoolingEngine:
    return PoolingEngine(EngineConfig(model_id=str(path), device="cpu", **overrides))


@pytest.mark.parametrize("name", EMBEDDERS)
def test_embeddings_match_sentence_transformers(model_path, name):
    path = model_path(name)
    engine = engine_for(path)
    ref_model = st.SentenceTransformer(str(path), device="cpu")
    texts = mixed_texts(24)
    ids = engine.tokenizer(texts, truncation=True, max_length=engine.max_input_tokens)["input_ids"]
    assert max(map(len, ids)) == engine.max_input_tokens == ref_model.max_seq_length  # some were truncated
    got = torch.stack(engine.embed(ids))
    if engine.spec.normalize:
        got = normalize(got)
    want = ref_model.encode(texts, convert_to_tensor=True, batch_size=7).float()
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_each_recipe_is_detected_as_built(model_path):
    specs = {name: detect(model_path(name)) for name in [*EMBEDDERS, "tiny-bert-cross"]}
    assert {n: (s.task, s.pooling, s.normalize) for n, s in specs.items() if s.task == "embed"} == {
        "tiny-bert-embed": ("embed", "mean", True), "tiny-xlmr-embed": ("embed", "cls", False),
        "tiny-modernbert-embed": ("embed", "mean", True), "tiny-nomicbert-embed": ("embed", "mean", True),
        "tiny-qwen3-embed": ("embed", "lasttoken", True)}
    assert specs["tiny-bert-cross"].task == "classify" and specs["tiny-bert-cross"].num_labels == 1
    assert specs["tiny-qwen3-embed"].prompts == {"query": "Instruct: find it\nQuery: ", "document": ""}
    assert detect(model_path("tiny-llama")) is None  # a causal LM is not a pooling model


def test_cross_encoder_logits_match_transformers(model_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    path = model_path("tiny-bert-cross")
    engine = engine_for(path)
    texts = mixed_texts(12, seed=1)
    queries, docs = texts[:6], texts[6:]
    enc = engine.tokenizer(queries, docs, truncation=True, max_length=engine.max_input_tokens)
    got = torch.stack(engine.runner.run(enc["input_ids"], enc.get("token_type_ids")))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.inference_mode():
        want = model(**tok(queries, docs, padding=True, truncation=True, max_length=engine.max_input_tokens,
                           return_tensors="pt")).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("packed", [True, False])
def test_runner_batches_never_exceed_their_budget_and_keep_order(model_path, packed):
    engine = engine_for(model_path("tiny-bert-embed"))
    runner = engine.runner
    assert runner.packed  # BERT passes varlen's self-check
    runner.packed = packed
    name = "_forward_packed" if packed else "_forward"
    seen = []
    forward = getattr(runner, name)

    def spy(seqs, *rest):
        seen.append((len(seqs), max(map(len, seqs)), sum(map(len, seqs))))
        return forward(seqs, *rest)
    setattr(runner, name, spy)
    runner.max_batch_tokens = 64
    seqs = [[1] + [7] * n for n in (50, 3, 20, 3, 60, 9, 1)]
    alone = [runner._forward([s], None, None)[0] for s in seqs]
    seen.clear()
    batched = runner.run(seqs)
    # packed: real tokens within the budget; padded: rows x the longest
    assert all((total if packed else count * width) <= 64 or count == 1 for count, width, total in seen)
    assert sum(count for count, _, _ in seen) == len(seqs) and len(seen) > 1
    for a, b in zip(alone, batched):  # packing or padding changes nothing, order is the caller's
        assert torch.allclose(a, b, atol=1e-5)


def test_worker_threads_equal_one_forward_and_give_the_threads_back(model_path):
    threads = torch.get_num_threads()
    path = model_path("tiny-qwen3-embed")
    seqs = [[5 + (i * 7 + j) % 90 for j in range(1 + (i * 37) % 120)] for i in range(40)]
    one = engine_for(path)
    want = torch.stack(one.embed(seqs))
    many = PoolingEngine(EngineConfig(model_id=str(path), device="cpu", max_batch_prefill_tokens=512), workers=3)
    try:
        assert torch.get_num_threads() == 1 and many.runner.workers == 3 and many.runner.max_batch_tokens == 1024
        many.runner.max_batch_tokens = 256  # several batches, run at once
        got = torch.stack(many.embed(seqs))
    finally:
        many.close()
    assert torch.get_num_threads() == threads
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_cpu_forward_grows_with_threads_for_one_worker():
    from engine.pooling.engine import forward_tokens
    threads = torch.get_num_threads()
    try:
        sizes = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            sizes.append(forward_tokens(torch.device("cpu"), 1))
        assert sizes == [1024, 2048, 3072]
        assert forward_tokens(torch.device("cpu"), 2) == 1024  # each worker on one thread
        assert forward_tokens(torch.device("meta"), 1) == 1024  # not a CPU: the thread count plays no part
    finally:
        torch.set_num_threads(threads)


def test_a_model_failing_the_packed_check_runs_padded(model_path, monkeypatch):
    from engine.pooling import varlen
    real = varlen.packed_inputs

    def without_positions(*args, **kwargs):  # a model class that would ignore per-sequence positions
        inputs, lengths = real(*args, **kwargs)
        inputs.pop("position_ids")
        return inputs, lengths
    monkeypatch.setattr(varlen, "packed_inputs", without_positions)
    engine = engine_for(model_path("tiny-bert-embed"))
    assert not engine.runner.packed and engine.stats().attention_backend == "sdpa (transformers)"
    seqs = [[2] + [9 + i % 50] * n + [3] for i, n in enumerate((40, 3, 70, 1))]
    alone = [engine.runner._forward([s], None, None)[0] for s in seqs]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(alone, engine.embed(seqs)))


def test_sliding_window_is_kept_within_each_packed_sequence(model_path, tmp_path):
    import json
    import shutil

    from engine.pooling.runner import PoolingRunner
    path = tmp_path / "mistral-window-8"
    shutil.copytree(model_path("tiny-mistral-embed"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))  # causal, far below the inputs
    runner = PoolingRunner(str(path), detect(path))
    assert runner.packed
    seqs = [[5 + (i * 7 + j) % 90 for j in range(1 + (i * 37) % 120)] for i in range(12)]
    packed = torch.stack(runner.run(seqs))
    runner.packed = False  # length-sorted padded batches: SDPA with transformers' own sliding-window mask
    padded = torch.stack(runner.run(seqs))
    assert torch.allclose(packed, padded, atol=1e-5), (packed - padded).abs().max()
