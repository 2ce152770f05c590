"""Convert PyTorch .bin weight shards to safetensors; torch is imported only when a conversion runs."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from tgi_hpc.errors import DownloadError

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"  # what transformers reads next to several shards


def convert_bin_to_safetensors(folder: Path, bin_files: list[str]) -> list[str]:
    """Rewrite PyTorch .bin shards as safetensors (plus an index for several shards); returns the new names.

    Tensors that share storage (tied embeddings) are copied so every name keeps its own tensor.
    The .bin files are left for the caller to delete.
    """
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as exc:
        from tgi_hpc.errors import DownloadError

        raise DownloadError(f"this repo has only .bin weights; converting them needs torch and safetensors "
                            f"({exc}): run the download where the engine is installed (`pip install "
                            f"'tgi-hpc[engine]'`, or `tgi-hpc download --job`)") from exc

    weight_map: dict[str, str] = {}
    outputs, total = [], 0
    for name in sorted(bin_files):
        out = name.replace("pytorch_model", "model").removesuffix(".bin") + ".safetensors"
        state = torch.load(folder / name, map_location="cpu", weights_only=True)
        tensors = _unshared(state, name)
        save_file(tensors, str(folder / f"{out}.tmp"), metadata={"format": "pt"})
        os.replace(folder / f"{out}.tmp", folder / out)
        weight_map.update(dict.fromkeys(tensors, out))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        outputs.append(out)
        logger.info("converted %s to %s", name, out)
        del state, tensors
    if len(outputs) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
        outputs.append(_INDEX)
    return outputs


def _unshared(state: Any, name: str) -> dict[str, Any]:
    import torch

    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise DownloadError(f"{name} is not a flat PyTorch state dict; cannot convert it to safetensors")
    seen, tensors = set(), {}
    for key, t in state.items():
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        tensors[key] = t if whole and storage.data_ptr() not in seen else t.contiguous().clone()
        seen.add(storage.data_ptr())
    return tensors
