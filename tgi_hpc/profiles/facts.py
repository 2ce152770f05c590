"""Checking the shipped profiles against the one list of pages they cite (profiles/citations/pages.yaml).

Three checks, each a line per problem:

1. every `source:` (and `min_source:`) of every cluster names a page of the list, with an anchor the list
   knows; every docs URL in a profile's comments names a page of the list;
2. every value the list says a page states for a cluster is the value that cluster's merged profile has;
3. no two clusters disagree with the same page: rules that cite the same page at the same place hold the
   same values (a page that differs per cluster says so through `states`, per cluster).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tgi_hpc.data import data_dir
from tgi_hpc.errors import ProfileError
from tgi_hpc.profiles.yaml_file import read_yaml

_URL = re.compile(r"https://docs\.(?:alliancecan\.ca|mila\.quebec)/[^\s\"'),]*")
SOURCE_KEYS = ("source", "min_source")


def citations_path() -> Path:
    return data_dir("profiles") / "citations" / "pages.yaml"


def read_citations(path: Path | None = None) -> dict[str, dict]:
    """{page URL without anchor: entry}; ProfileError when the list is not a mapping of pages."""
    raw = read_yaml(path or citations_path())
    pages = raw.get("pages") if isinstance(raw, Mapping) else None
    if not isinstance(pages, Mapping) or not all(isinstance(v, Mapping) for v in pages.values()):
        raise ProfileError(f"{path or citations_path()}: expected `pages:` mapping each URL to an entry")
    return {str(url): dict(entry) for url, entry in pages.items()}


def _split(url: str) -> tuple[str, str | None]:
    page, _, anchor = url.partition("#")
    return page, anchor or None


def _sources(data: Any, path: tuple = ()) -> Iterator[tuple[tuple, str, Mapping]]:
    """(path of the citing object, URL, the object) for every source/min_source in a dumped profile."""
    if isinstance(data, Mapping):
        for key in SOURCE_KEYS:
            if isinstance(data.get(key), str):
                yield path, data[key], data
        for key, value in data.items():
            yield from _sources(value, (*path, str(key)))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _sources(value, (*path, i))


def check_url(url: str, pages: Mapping[str, Mapping], where: str, anchored: bool = True) -> list[str]:
    page, anchor = _split(url.rstrip(".:;"))
    if page not in pages:
        return [f"{where}: cites {url}, which is not in the citation list ({citations_path().name})"]
    anchors = pages[page].get("anchors") or []
    if anchored and anchor and anchor not in anchors:
        return [f"{where}: cites {url}; the citation list knows no anchor #{anchor} on that page"]
    return []


def _value_at(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            raise KeyError(dotted)
        data = data[part]
    return data


def _differs(stated: Any, actual: Any) -> bool:
    if isinstance(stated, Mapping):       # a stated mapping is checked key by key (GPU types hold dots)
        return not isinstance(actual, Mapping) or any(k not in actual or _differs(v, actual[k])
                                                      for k, v in stated.items())
    return stated != actual


def _comparable(obj: Mapping) -> dict:
    out = {k: v for k, v in obj.items() if k not in SOURCE_KEYS}
    if obj.get("min_source"):             # `min` comes from another page
        out.pop("min", None)
    return out


def check_profiles(profiles: Mapping[str, Mapping], pages: Mapping[str, Mapping],
                   texts: Mapping[str, str] = {}) -> list[str]:
    """`profiles`: {cluster (or profile) name: its merged profile, dumped to JSON types}; `texts`: {file name:
    its text}, for the URLs in comments. Returns one line per problem (none: the facts hold)."""
    problems: list[str] = []
    for name, text in texts.items():
        for n, line in enumerate(text.splitlines(), 1):
            for url in _URL.findall(line):
                problems += check_url(url, pages, f"{name}:{n}", anchored=False)
    cited: dict[tuple[str, tuple], dict[str, dict]] = {}
    for name, data in profiles.items():
        for path, url, obj in _sources(data):
            where = f"{name}: {'.'.join(map(str, path)) or '(top)'}"
            problems += check_url(url, pages, where)
            key = "min_source" if obj.get("min_source") == url and obj.get("source") != url else "source"
            cited.setdefault((url, path + ((key,) if key == "min_source" else ())), {})[name] = _comparable(obj)
    for (url, path), values in sorted(cited.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if path and path[-1] == "min_source":
            continue
        distinct = {repr(v) for v in values.values()}
        if len(distinct) > 1:
            shown = "; ".join(f"{c}: {v}" for c, v in sorted(values.items()))
            problems.append(f"{url}: clusters disagree on {'.'.join(map(str, path))} ({shown})")
    for url, entry in pages.items():
        for name, facts in (entry.get("states") or {}).items():
            if name not in profiles:
                problems.append(f"{url}: states facts for {name!r}, which is not a shipped cluster")
                continue
            for dotted, stated in (facts or {}).items():
                try:
                    actual = _value_at(profiles[name], dotted)
                except KeyError:
                    problems.append(f"{url}: {name} has no {dotted} (the page states {stated!r})")
                    continue
                if _differs(stated, actual):
                    problems.append(f"{name}: {dotted} is {actual!r}, but {url} states {stated!r}")
    return problems


def shipped_profiles() -> tuple[dict[str, dict], dict[str, str]]:
    """Every live shipped cluster (or cluster-less profile) merged, without user files; and the files' text."""
    from tgi_hpc.profiles.loader import load_profile, profile_dirs

    env = {"TGI_HPC_CONFIG_DIR": "/nonexistent/tgi-hpc-facts"}   # the shipped facts only
    merged, texts = {}, {}
    for path in sorted(p for d in profile_dirs() for p in d.glob("*.yaml")):
        texts[path.name] = path.read_text()
        clusters = read_yaml(path).get("clusters") or {}
        live = [c for c, over in clusters.items() if not (isinstance(over, Mapping) and over.get("retired"))]
        for name in live or [path.stem]:
            profile = load_profile(path.stem, cluster=name if live else None, env=env)
            merged[name] = profile.model_dump(mode="json")
    return merged, texts


def check_shipped() -> list[str]:
    profiles, texts = shipped_profiles()
    return check_profiles(profiles, read_citations(), texts)
