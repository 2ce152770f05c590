"""PoolingSpec: is a snapshot a pooling model, and how does it pool? Read from plain JSON files, no torch.

Decided in this order:
1. modules.json with a `sentence_transformers.models.Pooling` module: an embedder; the pooling mode from its
   config (mean / CLS / last token / max / mean-sqrt-len, and `include_prompt`), a `Normalize` module,
   `max_seq_length` from sentence_bert_config.json, prompts from config_sentence_transformers.json over
   sentence-transformers 6's empty `query` and `document` prompts (so those names always resolve).
2. config.json's architecture `*ForSequenceClassification`: a cross-encoder / classifier (scores per label).
3. An encoder architecture (BertModel, XLMRobertaModel, ModernBertModel, ...): an embedder with CLS pooling,
   which is what those checkpoints were trained for when they ship without sentence-transformers files.
Anything else (a causal LM) is not a pooling model: `detect` returns None.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POOLING_MODES = ("mean", "cls", "lasttoken", "max", "mean_sqrt_len_tokens")
# 1_Pooling/config.json keys, in sentence-transformers' order of precedence for a single mode
_MODE_KEYS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "lasttoken"),
              ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_max_tokens", "max"),
              ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"))
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel", "ModernBertModel", "NomicBertModel",
                         "DistilBertModel", "MPNetModel", "ElectraModel", "DebertaV2Model", "NewModel")
_PIPELINE_TAGS = {"embed": "feature-extraction", "classify": "text-classification"}
ST_DEFAULT_PROMPTS = {"query": "", "document": ""}   # SentenceTransformer._default_prompts (v5+), filled by the saved
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")  # encode_document's candidates, in its order


class PoolingConfigError(ValueError):
    """A sentence-transformers file that exists but cannot be served (unknown mode, malformed JSON)."""


@dataclass(slots=True)
class PoolingSpec:
    task: str                                   # "embed" | "classify"
    architecture: str
    pooling: str = "cls"                        # one of POOLING_MODES (embed)
    normalize: bool = False                     # a Normalize module follows the pooling
    max_seq_length: int | None = None           # sentence_bert_config.json; None = the model's positions
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=lambda: dict(ST_DEFAULT_PROMPTS))  # name -> text put first
    default_prompt_name: str | None = None
    include_prompt: bool = True                 # False: the prompt's tokens are left out of the pooling (INSTRUCTOR)
    num_labels: int = 1                         # classify
    id2label: dict[int, str] = field(default_factory=dict)
    source: str = "architecture"                # "sentence-transformers" | "architecture"

    @property
    def pipeline_tag(self) -> str:
        return _PIPELINE_TAGS[self.task]

    def routes(self) -> list[str]:
        """The routes this model serves (named in the 422 a wrong route answers)."""
        if self.task == "embed":
            return ["/v1/embeddings", "/embed", "/v1/score", "/v1/rerank"]
        return ["/rerank", "/v1/rerank", "/v1/score", "/predict"]


def detect(model_dir: str | Path) -> PoolingSpec | None:
    """The snapshot's PoolingSpec, or None for a generative model."""
    root = Path(model_dir)
    config = _json(root / "config.json") or {}
    archs = config.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else ""
    modules = _json(root / "modules.json")
    if isinstance(modules, list):
        pooling = _module(modules, "Pooling")
        if pooling is not None:
            return _sentence_transformers(root, arch, modules, pooling)
    if arch.endswith("ForSequenceClassification"):
        labels = config.get("id2label") or {}
        num = int(config.get("num_labels") or len(labels) or 1)
        return PoolingSpec("classify", arch, num_labels=num, id2label=_labels(labels, num))
    if arch in ENCODER_ARCHITECTURES:
        return PoolingSpec("embed", arch, pooling="cls")
    return None


def _sentence_transformers(root: Path, arch: str, modules: list[Any], pooling: dict[str, Any]) -> PoolingSpec:
    pool_cfg = _json(root / str(pooling.get("path") or "1_Pooling") / "config.json")
    if not isinstance(pool_cfg, dict):
        raise PoolingConfigError(f"{root}: modules.json names a Pooling module without a readable config.json")
    bert_cfg = _json(root / "sentence_bert_config.json") or {}
    st_cfg = _json(root / "config_sentence_transformers.json") or {}
    saved = st_cfg.get("prompts") or {}
    if not isinstance(saved, dict) or not all(v is None or isinstance(v, str) for v in saved.values()):
        raise PoolingConfigError(f"{root}: `prompts` in config_sentence_transformers.json is not a name -> text map")
    prompts = {**ST_DEFAULT_PROMPTS, **{k: v or "" for k, v in saved.items()}}
    default = st_cfg.get("default_prompt_name") or None
    if default is not None and default not in prompts:  # sentence-transformers refuses to load it too
        raise PoolingConfigError(f"{root}: default_prompt_name {default!r} is not one of the prompts "
                                 f"({', '.join(sorted(prompts))})")
    max_len = bert_cfg.get("max_seq_length")
    return PoolingSpec(
        "embed", arch or "unknown", pooling=_mode(pool_cfg, root), normalize=_module(modules, "Normalize") is not None,
        max_seq_length=int(max_len) if isinstance(max_len, int) and max_len > 0 else None,
        do_lower_case=bool(bert_cfg.get("do_lower_case", False)), prompts=prompts, default_prompt_name=default,
        include_prompt=pool_cfg.get("include_prompt", True) is not False, source="sentence-transformers")


def resolve_prompt(spec: PoolingSpec, prompt_name: str | None, input_type: str | None = None) -> str | None:
    """The text put before each input, as sentence-transformers 6 picks it: `encode(prompt_name=...)` (an unknown
    name is a ValueError), else for input_type "query" / "document" `encode_query` / `encode_document` (the
    "query" prompt; the first of "document", "passage", "corpus"), else the default prompt; None when none applies."""
    if prompt_name is None and input_type == "query" and "query" in spec.prompts:
        prompt_name = "query"
    elif prompt_name is None and input_type == "document":
        prompt_name = next((n for n in DOCUMENT_PROMPT_NAMES if n in spec.prompts), None)
    if prompt_name is not None:
        if prompt_name not in spec.prompts:
            raise ValueError(f"`prompt_name` {prompt_name!r} is not one of this model's prompts "
                             f"({', '.join(sorted(spec.prompts)) or 'none'})")
        return spec.prompts[prompt_name]
    if spec.default_prompt_name is not None:
        return spec.prompts.get(spec.default_prompt_name)
    return None


def _mode(cfg: dict[str, Any], root: Path) -> str:
    if "pooling_mode" in cfg:  # newer sentence-transformers write the mode by name
        name = str(cfg["pooling_mode"]).replace("_token", "").replace("last_token", "lasttoken")
        aliases = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max", "lasttoken": "lasttoken"}
        name = aliases.get(name, name)
        if name in POOLING_MODES:
            return name
        raise PoolingConfigError(f"{root}: pooling mode {cfg['pooling_mode']!r} is not one of {POOLING_MODES}")
    chosen = [mode for key, mode in _MODE_KEYS if cfg.get(key)]
    if len(chosen) != 1:
        raise PoolingConfigError(f"{root}: 1_Pooling/config.json must enable exactly one pooling mode, "
                                 f"found {chosen or 'none'} (concatenated modes are not served)")
    return chosen[0]


def _module(modules: list[Any], kind: str) -> dict[str, Any] | None:
    for entry in modules:
        if isinstance(entry, dict) and str(entry.get("type", "")).rsplit(".", 1)[-1] == kind:
            return entry
    return None


def _labels(raw: Any, num: int) -> dict[int, str]:
    labels = {}
    if isinstance(raw, dict):
        for key, value in raw.items():
            try:
                labels[int(key)] = str(value)
            except (TypeError, ValueError):
                continue
    return {i: labels.get(i, f"LABEL_{i}") for i in range(num)}


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PoolingConfigError(f"{path} is not valid JSON: {exc}") from None
