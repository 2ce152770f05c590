"""PEFT (LoRA) adapters: what makes a repo or folder an adapter, the names they are served under, and whether
an adapter was trained on the model it is served with. An adapter is `adapter_config.json` (its rank, targets
and `base_model_name_or_path`) plus `adapter_model.safetensors`: a few MB, no config.json, no tokenizer."""
from __future__ import annotations

import re

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"    # older PEFT exports; the download converts it to safetensors

# A served name: what requests put in `adapter_id` or OpenAI's `model`, and a folder name in the job.
# No "," or "=" (the engine's --lora-adapters is name=path,name2=path2) and no "/" (it names a folder).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED_NAMES = ("tgi",)   # the engine answers OpenAI's model="tgi" with the base model


def is_adapter_repo(files: list[str]) -> bool:
    """A repo (or folder listing) holding a PEFT adapter at its top level rather than a model."""
    return ADAPTER_CONFIG in files and "config.json" not in files


def plan_adapter_files(files: list[str]) -> list[str]:
    """The files serving an adapter needs: its config and its weights (safetensors preferred)."""
    weights = ADAPTER_WEIGHTS if ADAPTER_WEIGHTS in files else ADAPTER_BIN if ADAPTER_BIN in files else None
    return [ADAPTER_CONFIG] + ([weights] if weights else [])


def adapter_problems(names: set[str]) -> list[str]:
    """What a job would miss in an adapter folder with these files; [] when it is complete."""
    problems = [] if ADAPTER_CONFIG in names else [f"{ADAPTER_CONFIG} is missing"]
    if ADAPTER_WEIGHTS not in names:
        problems.append(f"{ADAPTER_WEIGHTS} is missing")
    return problems


def check_adapter_name(name: str) -> str:
    """`name` if it can be served (1-64 of letters, digits, '.', '_', '-'; the engine's rule, minus '/' and ':'),
    else a ValueError saying why."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-' (no '/', ',', '=' "
                         "or spaces), starting with a letter or digit")
    if name in RESERVED_NAMES:
        raise ValueError(f"adapter name {name!r} means the base model to the engine; choose another")
    return name


def base_model(config: dict) -> str | None:
    """The model the adapter was trained on, as PEFT recorded it (a Hub id or a local path), if any."""
    base = config.get("base_model_name_or_path")
    return base if isinstance(base, str) and base.strip() else None


def _key(model: str) -> str:
    """Hub ids compare whole; a path compares by its last folder name (a store folder ORG--NAME/REV by
    ORG/NAME), lower-cased."""
    parts = [p for p in model.strip().rstrip("/").split("/") if p]
    if model.startswith(("/", ".", "~")) and parts:
        if len(parts) >= 2 and "--" in parts[-2]:       # STORE/ORG--NAME/REVISION
            return parts[-2].replace("--", "/", 1).lower()
        return parts[-1].lower()
    return "/".join(parts).lower()


def same_base(base: str, model: str) -> bool:
    """Whether an adapter whose base is `base` fits the served `model` (Hub ids or paths, either side)."""
    a, b = _key(base), _key(model)
    if a == b:
        return True
    # a Hub id against a local folder: compare the names after the organisation
    return a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1] and ("/" not in a or "/" not in b)
