"""Strict YAML for profiles: duplicate keys rejected, Slurm times kept as strings, errors with file:line:col."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tgi_hpc.errors import ProfileError


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in mapping
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain scalar", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1 reads 1:00:00 as the base-60 integer 3600; a Slurm time must stay a string.
_BASE60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:str", _BASE60, list("-+0123456789"))
for _first in "-+0123456789":
    _rules = _UniqueKeyLoader.yaml_implicit_resolvers[_first]
    _rules.insert(0, _rules.pop())   # checked before the int/float rules


def parse_yaml(text: str) -> Any:
    """`text` read with the strict loader; raises yaml.YAMLError like yaml.load."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping in the profile file `path`; ProfileError naming file, line and column otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"{path}: cannot read profile ({e.strerror or e}).") from None
    try:
        data = parse_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ProfileError(f"{where}: invalid YAML: {e.problem or e.context}. Fix the file.") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: invalid YAML: {e}. Fix the file.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile must be a YAML mapping of keys, not {type(data).__name__}.")
    return data
