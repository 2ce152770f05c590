"""Validating a merged profile: one error line per problem, with its origin, dotted key and closest valid key."""
from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from tgi_hpc.errors import ProfileError
from tgi_hpc.profiles.merge import Origins, origin_of
from tgi_hpc.profiles.schema import Profile


def _dotted(loc: Sequence) -> str:
    """slurm.defaults.serve.time; odd keys (newlines, quotes, $(...)) shown by repr, cut at 60 chars."""
    def part(p: Any) -> str:
        if isinstance(p, int):
            return f"[{p}]"
        text = p if isinstance(p, str) and p.replace("_", "").replace("-", "").isalnum() else repr(p)
        return text if len(text) <= 60 else text[:57] + "..."
    return ".".join(part(p) for p in loc)


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _valid_keys(loc: Sequence) -> list[str]:
    """Field names of the model found at `loc` in the schema ([] when it is not a model)."""
    tp: Any = Profile
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return []
            tp = field.annotation
        elif typing.get_origin(tp) in (dict, list):
            tp = typing.get_args(tp)[-1]
        else:
            return []
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _describe(err: Mapping[str, Any], origins: Origins, base: str) -> str:
    loc = [p for p in err["loc"] if p != "[key]"]
    where = origin_of(origins, loc, base)
    key = _dotted(loc)
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        suggestion = f" (did you mean {_dotted([*loc[:-1], hint[0]])}?)" if hint else ""
        return (f"{where}: unknown key {key}{suggestion}"
                + (f"; valid keys there: {', '.join(valid)}" if valid else ""))
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{where}: {key}: {err['msg']}" + ("" if err["type"] == "missing" else f" (got {got})")


def validate_profile(raw: dict, origins: Origins, base: str) -> Profile:
    """`raw` as a Profile; ProfileError listing up to 5 problems, each with its file or --set item."""
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        lines = list(dict.fromkeys(_describe(err, origins, base) for err in e.errors()))
        more = f"\n  (+{len(lines) - 5} more)" if len(lines) > 5 else ""
        raise ProfileError("invalid profile:\n  " + "\n  ".join(lines[:5]) + more
                           + "\nFix the key in that file, or the --set item.") from None

