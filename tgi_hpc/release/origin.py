"""Where this tgi-hpc was installed from (PEP 610's direct_url.json), so a release installs the engine from
the same source: a VCS URL at its commit, a local wheel, a directory, an archive URL, else the index."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tgi_hpc.errors import ReleaseError

DIST_NAME = "tgi-hpc"


@dataclass(frozen=True)
class Origin:
    """`kind`: "index" (pip's index: the published version), "vcs" or "archive" (a URL pip can install
    again), "wheel" or "dir" (a local path)."""

    kind: str
    url: str = ""        # vcs/archive: the PEP 508 direct reference's URL
    path: Path | None = None


def parse_direct_url(text: str | None, where: str = "direct_url.json") -> Origin:
    """The origin a direct_url.json describes (None or empty: installed from an index)."""
    if not text or not text.strip():
        return Origin("index")
    try:
        data = json.loads(text)
        url = data["url"] if isinstance(data, dict) else None
        if not isinstance(url, str) or not url:
            raise TypeError("no url")
    except (ValueError, KeyError, TypeError) as e:
        raise ReleaseError(f"cannot read {where} ({e}): reinstall tgi-hpc (pip install --force-reinstall ...)") from e
    parts = urlsplit(url)
    if isinstance(data.get("vcs_info"), dict):
        vcs = data["vcs_info"]
        commit = vcs.get("commit_id") or vcs.get("requested_revision") or ""
        fragment = f"#subdirectory={data['subdirectory']}" if data.get("subdirectory") else ""
        return Origin("vcs", f"{vcs.get('vcs', 'git')}+{url}" + (f"@{commit}" if commit else "") + fragment)
    if parts.scheme != "file":
        if "dir_info" in data:
            raise ReleaseError(f"{where}: a directory at a non-file URL ({url})")
        return Origin("archive", url)   # an https wheel or sdist: pip can fetch it again
    path = Path(unquote(parts.path))
    if "dir_info" in data:
        return Origin("dir", path=path)
    if path.suffix == ".whl":
        return Origin("wheel", path=path)
    return Origin("archive", url, path)   # a local sdist


def installed_origin() -> Origin:
    """This interpreter's installed tgi-hpc's origin (not installed at all: the index)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(DIST_NAME)
    except PackageNotFoundError:
        return Origin("index")
    where = f"{dist._path}/direct_url.json" if hasattr(dist, "_path") else "direct_url.json"
    return parse_direct_url(dist.read_text("direct_url.json"), where)
