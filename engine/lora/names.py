"""`--lora-adapters name=path,name2=path2` (or bare paths, named after their directory) -> [(name, path)].

Torch-free: the launcher parses the flag before importing the engine.
"""
from __future__ import annotations

import re
from pathlib import PurePath

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
BASE_ALIASES = ("tgi",)   # OpenAI clients written for TGI send model="tgi" for the served model


def parse_lora_adapters(text: str) -> list[tuple[str, str]]:
    """Split the flag's value; a ValueError names the first bad entry."""
    pairs: list[tuple[str, str]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, has_name, path = item.partition("=")
        if not has_name:
            name, path = PurePath(item.rstrip("/")).name, item
        name, path = name.strip(), path.strip()
        if not path:
            raise ValueError(f"LoRA adapter {item!r} has no path; use NAME=PATH")
        if not _NAME.match(name):
            raise ValueError(f"LoRA adapter name {name!r} is not valid: use letters, digits and . _ - / : "
                             "(starting with a letter or digit)")
        if name in (n for n, _ in pairs):
            raise ValueError(f"LoRA adapter name {name!r} is given twice; each adapter needs its own name")
        pairs.append((name, path))
    return pairs


def check_names(pairs: list[tuple[str, str]], base_name: str | None) -> None:
    """Adapter names must differ from each other and from the names that mean the base model."""
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise ValueError(f"LoRA adapter name {name!r} is given twice; each adapter needs its own name")
        if name in BASE_ALIASES or (base_name and name == base_name):
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name; rename the adapter "
                             "(NAME=PATH), requests for this name get the base model")
        seen.add(name)
