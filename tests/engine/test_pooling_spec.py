"""PoolingSpec from snapshot files (no torch): sentence-transformers modules and pooling configs, cross-encoders,
encoders, causal LMs, and broken or hostile files refused in one line."""
from __future__ import annotations

import json

import pytest

from engine.pooling.spec import PoolingConfigError, detect

MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def snapshot(root, arch="BertModel", modules=None, pooling=None, **files):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": [arch], **files.pop("config", {})}))
    if modules is not None:
        (root / "modules.json").write_text(modules if isinstance(modules, str) else json.dumps(modules))
    if pooling is not None:
        (root / "1_Pooling").mkdir(exist_ok=True)
        (root / "1_Pooling" / "config.json").write_text(pooling if isinstance(pooling, str) else json.dumps(pooling))
    for name, content in files.items():
        (root / f"{name}.json").write_text(json.dumps(content))
    return root


@pytest.mark.parametrize("key,mode", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                                      ("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_max_tokens", "max"),
                                      ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens")])
def test_sentence_transformers_pooling_modes(tmp_path, key, mode):
    spec = detect(snapshot(tmp_path, "Qwen3Model", MODULES + [NORMALIZE], {key: True, "word_embedding_dimension": 8},
                           sentence_bert_config={"max_seq_length": 77, "do_lower_case": True},
                           config_sentence_transformers={"prompts": {"query": "q: "}, "default_prompt_name": "query"}))
    assert (spec.task, spec.pooling, spec.normalize, spec.max_seq_length) == ("embed", mode, True, 77)
    assert spec.do_lower_case and spec.prompts == {"query": "q: ", "document": ""}  # ST 6's defaults under
    assert spec.default_prompt_name == "query" and spec.include_prompt
    assert spec.source == "sentence-transformers" and "/v1/embeddings" in spec.routes()


def test_pooling_mode_by_name_and_no_normalize(tmp_path):
    spec = detect(snapshot(tmp_path, modules=MODULES, pooling={"pooling_mode": "lasttoken"}))
    assert (spec.pooling, spec.normalize, spec.max_seq_length) == ("lasttoken", False, None)


def test_architectures_without_sentence_transformers_files(tmp_path):
    cross = detect(snapshot(tmp_path / "a", "XLMRobertaForSequenceClassification",
                            config={"id2label": {"0": "neg", "1": "pos", "x": "junk"}, "num_labels": 2}))
    assert (cross.task, cross.num_labels, cross.id2label) == ("classify", 2, {0: "neg", 1: "pos"})
    assert "/rerank" in cross.routes() and cross.pipeline_tag == "text-classification"
    assert detect(snapshot(tmp_path / "b", "ModernBertModel")).pooling == "cls"
    assert detect(snapshot(tmp_path / "c", "LlamaForCausalLM")) is None
    assert detect(tmp_path / "missing") is None
    # modules.json without a Pooling module (e.g. a CrossEncoder saved by sentence-transformers 6) is not an embedder
    assert detect(snapshot(tmp_path / "d", "LlamaForCausalLM", modules=MODULES[:1])) is None


@pytest.mark.parametrize("modules,pooling,message", [
    ("{not json", None, "not valid JSON"),
    (MODULES, None, "without a readable config.json"),
    (MODULES, "[1, 2", "not valid JSON"),
    (MODULES, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "exactly one"),
    (MODULES, {}, "exactly one"),
    (MODULES, {"pooling_mode": "weighted"}, "not one of"),
])
def test_broken_files_are_refused_in_one_line(tmp_path, modules, pooling, message):
    with pytest.raises(PoolingConfigError, match=message):
        detect(snapshot(tmp_path, modules=modules, pooling=pooling))


def test_bad_prompts_and_lengths(tmp_path):
    with pytest.raises(PoolingConfigError, match="prompts"):
        detect(snapshot(tmp_path / "a", modules=MODULES, pooling={"pooling_mode_cls_token": True},
                        config_sentence_transformers={"prompts": {"query": 5}}))
    spec = detect(snapshot(tmp_path / "b", modules=MODULES, pooling={"pooling_mode_cls_token": True},
                           sentence_bert_config={"max_seq_length": -3}))
    assert spec.max_seq_length is None
    with pytest.raises(PoolingConfigError, match="default_prompt_name 'search'"):  # sentence-transformers refuses it
        detect(snapshot(tmp_path / "c", modules=MODULES, pooling={"pooling_mode_cls_token": True},
                        config_sentence_transformers={"prompts": {"query": "q: "}, "default_prompt_name": "search"}))
    spec = detect(snapshot(tmp_path / "d", modules=MODULES, pooling={"pooling_mode_mean_tokens": True,
                                                                    "include_prompt": False},
                           config_sentence_transformers={"prompts": {"query": None, "doc": "d: "},
                                                         "default_prompt_name": "query"}))
    assert spec.prompts == {"query": "", "document": "", "doc": "d: "} and not spec.include_prompt


def test_resolve_prompt_is_sentence_transformers_order():
    from engine.pooling.spec import PoolingSpec, resolve_prompt
    spec = PoolingSpec("embed", "BertModel", prompts={"query": "q: ", "document": "", "passage": "p: "},
                       default_prompt_name="passage")
    assert resolve_prompt(spec, None) == "p: "                       # encode(): the default
    assert resolve_prompt(spec, None, "query") == "q: "              # encode_query
    assert resolve_prompt(spec, None, "document") == ""              # encode_document: "document" before "passage"
    assert resolve_prompt(spec, "passage", "query") == "p: "         # a name wins
    assert resolve_prompt(PoolingSpec("embed", "BertModel"), None) is None
    with pytest.raises(ValueError, match="'x' is not one of"):
        resolve_prompt(spec, "x")


def test_hostile_directory_names_are_only_paths(tmp_path, hostile):
    for value, marker in hostile:
        root = tmp_path / value.replace("/", "_")
        spec = detect(snapshot(root, modules=MODULES + [NORMALIZE], pooling={"pooling_mode_mean_tokens": True}))
        assert spec.pooling == "mean" and not marker.exists()


def test_launcher_refuses_sharding_a_pooling_model(tmp_path):
    from engine.config import EngineConfig
    from engine.launcher import _pooling_engine
    root = snapshot(tmp_path, modules=MODULES, pooling={"pooling_mode_mean_tokens": True})
    with pytest.raises(ValueError, match="one device"):
        _pooling_engine(EngineConfig(model_id=str(root), num_shard=2), None)
    assert _pooling_engine(EngineConfig(model_id=str(snapshot(tmp_path / "llm", "LlamaForCausalLM"))), None) is None
