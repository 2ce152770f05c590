"""Checkpoint loading: safetensors (one file or a sharded index) or random "dummy" weights.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)`; `loaded` is a lazy
safetensors slice, so a rank reads only the rows/columns of its own shard.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# HF name fragment -> (our fused parameter fragment, shard id)
PackedMapping = dict[str, tuple[str, Any]]


def shape_of(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def read_shard(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows/columns [start, start+size) of `loaded` along `dim`, reading only those bytes."""
    index = [slice(None)] * len(shape_of(loaded))
    index[dim] = slice(start, start + size)
    return torch.as_tensor(loaded[tuple(index)])


def read_full(loaded: Any) -> torch.Tensor:
    return torch.as_tensor(loaded[:]) if len(shape_of(loaded)) else torch.as_tensor(loaded)


def default_weight_loader(param: nn.Parameter, loaded: Any) -> None:
    tensor = read_full(loaded)
    if tensor.shape != param.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit parameter "
                         f"of shape {tuple(param.shape)}")
    param.data.copy_(tensor)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: convert the checkpoint to safetensors "
                                "or use --load-format dummy")
    return found


def iterate_checkpoint(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor of the checkpoint."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_slice(name)


def load_safetensors(model: nn.Module, model_dir: str | Path, packed: PackedMapping,
                     skip: tuple[str, ...] = ()) -> None:
    """Load a checkpoint into `model`, routing fused q/k/v and gate/up through `packed`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids: set[int] = set()
    elsewhere = model.other_stage_parameters() if hasattr(model, "other_stage_parameters") else ()
    for name, target, shard_id, loaded in _routed_checkpoint(model, Path(model_dir), packed, skip):
        if target not in params and target.startswith(elsewhere):
            continue  # another pipeline stage holds it (engine/pipeline.py)
        if target not in params:
            if target.endswith(".bias") and not read_full(loaded).any():
                continue  # some GPTQ exports write all-zero biases for bias-free layers
            raise ValueError(f"{model_dir}: checkpoint tensor {name!r} has no place in the model "
                             f"(architecture/config mismatch?)")
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        if shard_id is None:
            (loader or default_weight_loader)(param, loaded)
        else:
            loader(param, loaded, shard_id)
        loaded_ids.add(id(param))
    missing = [name for name, param in params.items()
               if id(param) not in loaded_ids and not getattr(param, "optional", False)]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint has no weights for {sorted(missing)[:8]}")
    finish_loading(model)


def finish_loading(model: nn.Module) -> None:
    """Let layers post-process loaded weights (quantization methods that quantize at load)."""
    for module in model.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()


def _routed_checkpoint(model: nn.Module, model_dir: Path, packed: PackedMapping,
                       skip: tuple[str, ...]) -> Iterator[tuple[str, str, Any, Any]]:
    """(checkpoint name, parameter name, shard id, tensor) for every tensor the model takes.

    A model whose checkpoint names or layouts differ from its parameters (renamed modules, fused
    q/k/v to split, per-expert matrices, GPT-2's transposed Conv1D) defines
    `route_checkpoint_tensor(name, loaded) -> [(parameter, shard id, tensor), ...]`
    (engine/models/checkpoint.py); the others go through `packed`.
    """
    route = getattr(model, "route_checkpoint_tensor", None)
    for name, loaded in iterate_checkpoint(model_dir):
        if any(fragment in name for fragment in skip):
            continue
        if route is None:
            yield (name, *_resolve(name, packed), loaded)
            continue
        for target, shard_id, part in route(name, loaded):
            yield name, target, shard_id, part


def _resolve(name: str, packed: PackedMapping) -> tuple[str, Any]:
    for fragment, (fused, shard_id) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard_id
    return name, None


def load_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes: norms at 1, everything else N(0, 0.02), drawn on the device."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        if not param.is_floating_point() or param.element_size() == 1:  # packed/fp8 quantized: left as built
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=generators[param.device])
    finish_loading(model)
