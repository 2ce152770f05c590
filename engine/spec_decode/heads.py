"""What a `--speculative-model` directory holds: Medusa heads, an EAGLE-3 draft layer, or a draft model, read
from its config.json; and the loading of the first two, which draft from the target's hidden states."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def speculative_kind(path: str | None) -> str | None:
    """"medusa" | "eagle3" | "draft" (a causal LM with the target's tokenizer) | None (no --speculative-model)."""
    if not path:
        return None
    config_path = Path(path, "config.json")
    if not config_path.is_file():
        return "draft"    # check_draft_model refuses it with the reason
    config = json.loads(config_path.read_text())
    if "medusa_num_heads" in config:
        return "medusa"
    architectures = " ".join(config.get("architectures") or []).lower()
    if "eagle3" in architectures or "eagle3" in str(config.get("model_type", "")).lower():
        return "eagle3"
    return "draft"


def load_heads(kind: str, path: str, model: Any, model_config: Any, device: torch.device,
               dtype: torch.dtype) -> Any:
    if kind == "medusa":
        from engine.spec_decode.medusa import MedusaHeads
        return MedusaHeads(path, device, dtype)
    from engine.spec_decode.eagle3 import Eagle3Draft
    return Eagle3Draft(path, model, model_config, device, dtype)
