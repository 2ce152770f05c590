"""Read a PEFT LoRA adapter directory and check it against the base model, before any weight is loaded.

An adapter is `adapter_config.json` plus `adapter_model.safetensors` holding, per targeted module,
`<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r]. Each problem is one line
(LoraError) naming the adapter, its directory and what to do.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.lora.names import check_names
from engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+\.(?P<target>[A-Za-z0-9_]+))\.lora_(?P<ab>[AB])"
                  r"(?:\.[A-Za-z0-9_]+)?\.weight$")
# config keys whose non-empty values change what the adapter computes beyond x A^T B^T
_REFUSED = {
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained layers)",
    "lora_bias": "lora_bias", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "target_parameters": "target_parameters", "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication", "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)", "use_bdlora": "use_bdlora",
}


class LoraError(ValueError):
    """An adapter this engine cannot serve; the message is one line."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    module: str         # the base model's module path, e.g. model.layers.0.self_attn.q_proj
    target: str         # its last name: q_proj ... down_proj
    rank: int
    in_features: int
    out_features: int
    scale: float        # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    a_key: str          # tensor names in adapter_model.safetensors
    b_key: str


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: Path
    modules: tuple[LoraModule, ...]
    base_model: str | None

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def read_adapters(pairs: list[tuple[str, str]], model_config: ModelConfig, base_name: str | None) -> list[Adapter]:
    """Every adapter of `--lora-adapters`, read and checked against the base model (in flag order)."""
    check_names(pairs, base_name)
    adapters = [read_adapter(name, path) for name, path in pairs]
    for adapter in adapters:
        check_against(adapter, model_config, base_name)
    return adapters


def read_adapter(name: str, path: str | Path) -> Adapter:
    where = f"LoRA adapter {name!r} ({path})"
    directory = Path(path)
    if not directory.is_dir():
        raise LoraError(f"{where}: no such directory; pass NAME=DIR of a PEFT adapter (adapter_config.json + "
                        "adapter_model.safetensors)")
    config = _read_config(directory / "adapter_config.json", where)
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        hint = " (only adapter_model.bin: re-save it with safe_serialization=True)" \
            if (directory / "adapter_model.bin").exists() else ""
        raise LoraError(f"{where}: adapter_model.safetensors is missing{hint}")
    shapes = _tensor_shapes(weights, where)
    return Adapter(name, directory, _modules(config, shapes, where), config.get("base_model_name_or_path"))


def _read_config(file: Path, where: str) -> dict[str, Any]:
    if not file.is_file():
        raise LoraError(f"{where}: adapter_config.json is missing; is this a PEFT adapter directory?")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoraError(f"{where}: adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{where}: adapter_config.json is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{where}: peft_type {config.get('peft_type')!r} is not supported; only LoRA adapters are")
    refused = [what for key, what in _REFUSED.items() if config.get(key)]
    if str(config.get("bias", "none")) != "none":
        refused.append(f"bias={config['bias']!r} (trained base biases)")
    if refused:
        raise LoraError(f"{where}: {', '.join(refused)} is not supported; only plain LoRA (x A^T B^T, optionally "
                        "rsLoRA) can be served beside the base model, merge the adapter into the model instead")
    if not isinstance(config.get("r", 8), int) or not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise LoraError(f"{where}: r and lora_alpha in adapter_config.json must be numbers")
    return config


def _tensor_shapes(file: Path, where: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise LoraError(f"{where}: cannot read adapter_model.safetensors ({type(exc).__name__}: {exc})") from None


def _modules(config: dict[str, Any], shapes: dict[str, tuple[int, ...]], where: str) -> tuple[LoraModule, ...]:
    found: dict[str, dict[str, str]] = {}
    for key in shapes:
        match = _KEY.match(key)
        if match is None:
            raise LoraError(f"{where}: tensor {key!r} is not a lora_A/lora_B weight (DoRA magnitudes, embeddings and "
                            "saved modules are not supported)")
        found.setdefault(match["module"], {})[match["ab"]] = key
    if not found:
        raise LoraError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    modules = []
    for module, keys in sorted(found.items()):
        if set(keys) != {"A", "B"}:
            raise LoraError(f"{where}: module {module!r} has lora_{'A' if 'A' in keys else 'B'} but not "
                            f"lora_{'B' if 'A' in keys else 'A'}")
        a, b = shapes[keys["A"]], shapes[keys["B"]]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] < 1:
            raise LoraError(f"{where}: module {module!r} has lora_A {a} and lora_B {b}; expected [r, in] and [out, r]")
        rank = a[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(LoraModule(module, module.rsplit(".", 1)[-1], rank, a[1], b[0], float(scale), keys["A"],
                                  keys["B"]))
    return tuple(modules)


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches the end of the module path."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target the engine can adapt, for this base model."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if config.num_experts == 0:  # a mixture of experts has no single MLP matrix per layer
        shapes.update({"up_proj": (h, i), "down_proj": (i, h)})
        if config.mlp_gated:
            shapes["gate_proj"] = (h, i)
    return shapes


def adaptable_modules(config: ModelConfig) -> list[str]:
    """Checkpoint paths of every module an adapter may target (runtime LoRA allocates them all up front)."""
    shapes = expected_shapes(config)
    return [f"model.layers.{i}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}.{target}"
            for i in range(config.num_hidden_layers) for target in shapes]


def check_against(adapter: Adapter, config: ModelConfig, base_name: str | None) -> None:
    """Refuse target modules the engine cannot adapt and shapes that are not the base model's."""
    where = f"LoRA adapter {adapter.name!r} ({adapter.path})"
    expected = expected_shapes(config)
    layer = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.[a-z_]+$")
    bad = sorted({m.module for m in adapter.modules if m.target not in expected or not layer.match(m.module)})
    if bad:
        raise LoraError(f"{where}: target modules {bad[:4]} are not supported for {config.architecture}; supported: "
                        f"{', '.join(expected)} of each decoder layer")
    trained_on = f" (it was trained on {adapter.base_model!r})" if adapter.base_model else ""
    for module in adapter.modules:
        index = int(layer.match(module.module).group(1))
        in_out = (module.in_features, module.out_features)
        if index >= config.num_hidden_layers or in_out != expected[module.target]:
            got = f"layer {index}" if index >= config.num_hidden_layers else f"(in, out) {in_out}"
            raise LoraError(f"{where}: does not fit this base model{trained_on}: {module.module} has {got}, the model "
                            f"has {config.num_hidden_layers} layers and {module.target} (in, out) "
                            f"{expected[module.target]}")
    if adapter.base_model and base_name and Path(adapter.base_model).name not in (base_name, Path(base_name).name):
        logger.warning("%s was trained on %r and is served on %r: the shapes fit, check that it is the same model",
                       where, adapter.base_model, base_name)

