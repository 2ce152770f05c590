"""A speculative draft (`serve --speculative-model`) seen from its files, without torch: which kind it is (a draft
model, Medusa heads or an EAGLE-3 layer, as engine/spec_decode/heads.py tells them apart), the GPU memory it adds
to the job (its weights from the safetensors headers, its own KV cache from config.json), and whether the target
can verify its drafts (the same vocabulary: the tokenizer of a draft model, the heads' output rows otherwise)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tgi_hpc.errors import UsageError

MAX_HEADER_BYTES = 100_000_000   # safetensors' own limit on the JSON header
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}   # served at the job's dtype
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def draft_kind(config: dict) -> str:
    """"medusa" | "eagle3" | "draft", read from the draft's config.json as the engine reads it."""
    if "medusa_num_heads" in config:
        return "medusa"
    architectures = " ".join(a for a in config.get("architectures") or [] if isinstance(a, str)).lower()
    return "eagle3" if "eagle3" in architectures or "eagle3" in str(config.get("model_type", "")).lower() else "draft"


def parse_header(raw: str, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors JSON header: tensor name -> (dtype, shape); UsageError if it is not one."""
    try:
        header = json.loads(raw)
        tensors = {key: (str(value["dtype"]), tuple(int(n) for n in value["shape"]))
                   for key, value in header.items() if key != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise UsageError(f"{name} is not a safetensors file (its header does not parse)") from None
    if any(dtype not in DTYPE_BYTES or any(n < 0 for n in shape) for dtype, shape in tensors.values()):
        raise UsageError(f"{name} is not a safetensors file (unknown dtype or negative shape in its header)")
    return tensors


@dataclass(frozen=True)
class DraftFootprint:
    kind: str
    params_b: float                # parameters loaded beside the target, billions
    weight_gb: float               # their bytes at the served precision / 1e9
    kv_bytes_per_token: int        # its own KV cache (a draft model, an EAGLE-3 layer; Medusa heads keep none)

    def describe(self, source: str) -> str:
        kv = f", KV cache {self.kv_bytes_per_token / 1024:.0f} KiB per token" if self.kv_bytes_per_token else ""
        return f"draft {source} ({self.kind}): {self.params_b:.2f}B parameters, {self.weight_gb:.1f} GB{kv}"


def draft_footprint(config: dict, headers: dict[str, tuple[str, tuple[int, ...]]],
                    dtype_bytes: int = 2) -> DraftFootprint:
    """Weights from the headers (floats at the job's dtype, the rest as stored); the KV cache from config.json
    (layers x KV heads x head_dim x 2 x dtype bytes per token; an EAGLE-3 draft has its one layer)."""
    kind = draft_kind(config)
    params, weight_bytes = 0, 0
    for dtype, shape in headers.values():
        count = math.prod(shape)
        params += count
        weight_bytes += count * (dtype_bytes if dtype in FLOAT_DTYPES else DTYPE_BYTES[dtype])
    kv = 0
    if kind != "medusa":
        text = config.get("text_config", config)
        try:
            heads = int(text.get("num_attention_heads", 1))
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
            layers = int(text.get("num_hidden_layers", 1))
            kv = layers * int(text.get("num_key_value_heads", heads)) * head_dim * 2 * dtype_bytes
        except (KeyError, ValueError, TypeError, ZeroDivisionError):
            raise UsageError("the draft's config.json has no usable layer shapes (hidden_size, num_attention_heads, "
                             "num_hidden_layers)") from None
    return DraftFootprint(kind, params / 1e9, weight_bytes / 1e9, kv)


def check_heads_fit(config: dict, headers: dict[str, tuple[str, tuple[int, ...]]], target: dict, source: str) -> None:
    """Medusa heads and an EAGLE-3 layer draft into the target's vocabulary from its hidden states: their shapes
    must be the target's (else they were trained for another model)."""
    text = target.get("text_config", target)
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        return
    kind = draft_kind(config)
    if kind == "medusa":
        layers = config.get("medusa_num_layers", 1)
        for name, (_, shape) in headers.items():
            parts = name.removeprefix("medusa_head.").split(".")
            if len(parts) == 3 and parts[1] == str(layers) and parts[2] == "weight" and shape != (vocab, hidden):
                raise UsageError(f"--speculative-model {source}: Medusa head {parts[0]} projects to {list(shape)}, the "
                                 f"model needs [{vocab}, {hidden}] (vocabulary x hidden size): these heads were "
                                 "trained for another model")
        return
    if kind != "eagle3":
        return
    fc, head = headers.get("fc.weight"), headers.get("lm_head.weight")
    if fc is not None and fc[1][1:] != (3 * hidden,):
        raise UsageError(f"--speculative-model {source}: its fc.weight reads {fc[1][1:]} hidden values, the model "
                         f"gives 3 x {hidden}: this EAGLE-3 draft was trained for another model")
    if head is not None and "d2t" not in headers and head[1][0] != vocab:
        raise UsageError(f"--speculative-model {source}: its LM head has {head[1][0]} tokens and no d2t map, the "
                         f"model has {vocab}: this EAGLE-3 draft was trained for another model")


def tokenizer_vocab(raw: str) -> tuple | None:
    """What a tokenizer.json maps (its model's vocabulary and its added tokens), comparable; None if unreadable."""
    try:
        data = json.loads(raw)
        model = data["model"]
        vocab = model.get("vocab")
        vocab = sorted(vocab.items()) if isinstance(vocab, dict) else [tuple(v) for v in vocab or []]
        added = sorted((int(t["id"]), str(t["content"]), bool(t.get("special")))
                       for t in data.get("added_tokens") or [])
        return model.get("type"), tuple(vocab), tuple(added)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
