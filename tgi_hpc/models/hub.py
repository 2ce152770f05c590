"""Hugging Face Hub access for one download: the file listing, resumable GETs, errors that say what to do.

The token stays in this module's calls: it goes to huggingface_hub only, and never to a redirect target on
another host (the LFS CDN). huggingface_hub is imported only when a download runs.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from tgi_hpc.errors import DownloadError

logger = logging.getLogger(__name__)

_OFFLINE = ("HF_HUB_OFFLINE=1 is set, so huggingface_hub refuses to download: unset it for the download "
            "(on a node with internet access)")
PROGRESS_LOG_INTERVAL_S = 30.0  # progress lines in non-terminal output (Slurm logs): one per file this often


class HubFile(NamedTuple):
    """One file of the Hub's tree listing, independent of the huggingface_hub version."""

    path: str
    size: int
    blob_id: str
    sha256: str | None  # LFS files only


class Hub:
    """The Hub calls of one download; holds the token so that it never leaves this object's calls."""

    def __init__(self, model_id: str, endpoint: str | None, token: str | None, progress: bool = True):
        from huggingface_hub import HfApi, constants
        from huggingface_hub.file_download import http_get

        self.model_id, self.endpoint, self._token = model_id, endpoint, token or False
        # a terminal gets huggingface_hub's tqdm bars; a log file gets a line now and then (hub >= 2 only)
        logs = progress and not sys.stderr.isatty() and "tqdm_class" in inspect.signature(http_get).parameters
        self._progress = {"tqdm_class": _LogProgress} if logs else {}
        self.base = (endpoint or constants.ENDPOINT).rstrip("/")
        parts = urlsplit(self.base)  # the manifest records the endpoint: never with credentials in it
        self.origin = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        self.api = HfApi(endpoint=endpoint, token=self._token)
        if constants.HF_HUB_OFFLINE:  # read by huggingface_hub at import; say so before any request fails
            raise DownloadError(_OFFLINE)

    def listing(self, revision: str) -> tuple[str, dict[str, HubFile]]:
        """The commit sha of `revision` and its files."""
        from huggingface_hub.hf_api import RepoFile

        with self.errors(revision):
            commit = self.api.model_info(self.model_id, revision=revision).sha
            tree = self.api.list_repo_tree(self.model_id, recursive=True, revision=commit)
            entries = {f.path: HubFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None)
                       for f in tree if isinstance(f, RepoFile)}
        if not commit:
            raise DownloadError(f"{self.base} gave no commit sha for {self.model_id} ({revision})")
        return commit, entries

    def get(self, commit: str, entry: HubFile, part: Path, resume: int) -> None:
        """Append the rest of `entry` to `part`; the token goes to the Hub host only, never to a CDN."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.model_id, entry.path, revision=commit, endpoint=self.endpoint)
        with self.errors(commit):
            meta = get_hf_file_metadata(url, token=self._token, endpoint=self.endpoint)
            if meta.size is not None and meta.size != entry.size:
                raise DownloadError(f"{entry.path} of {self.model_id}: the Hub lists {entry.size} bytes but serves "
                                    f"{meta.size}; try again later")
            headers = build_hf_headers(token=self._token if _same_origin(url, meta.location) else False)
            with open(part, "ab") as f:
                http_get(meta.location, f, resume_size=resume, headers=headers, expected_size=entry.size,
                         displayed_filename=entry.path, **self._progress)

    @contextlib.contextmanager
    def errors(self, revision: str) -> Iterator[None]:
        """Turn huggingface_hub and network errors into DownloadErrors that say what to do."""
        from huggingface_hub import errors as hf

        page, login = f"{self.base}/{self.model_id}", "log in with `hf auth login` or set HF_TOKEN"
        token_state = "a token was sent" if self._token else "no Hugging Face token was found"
        try:
            yield
        except DownloadError:
            raise
        except hf.GatedRepoError as e:
            raise DownloadError(f"{self.model_id} is gated/private: accept the licence on {page} and {login} "
                                f"({token_state})") from e
        except hf.RepositoryNotFoundError as e:
            raise DownloadError(f"{self.model_id} was not found on {self.base}, or it is gated/private: check the "
                                f"id; if it is gated/private, accept the licence on {page} and {login} "
                                f"({token_state})") from e
        except hf.RevisionNotFoundError as e:
            raise DownloadError(f"revision {revision!r} of {self.model_id} does not exist on {self.base}: "
                                "check the branch, tag or commit") from e
        except hf.EntryNotFoundError as e:
            raise DownloadError(f"a file of {self.model_id} disappeared from {self.base} during the download "
                                f"({e}); run the download again") from e
        except hf.HfHubHTTPError as e:
            status = getattr(e.response, "status_code", None)
            if status in (401, 403):
                raise DownloadError(f"{self.model_id} is gated/private: accept the licence on {page} and {login} "
                                    f"({token_state})") from e
            raise DownloadError(f"{self.base} refused the download of {self.model_id}: {e}") from e
        except Exception as e:
            if type(e).__name__ == "OfflineModeIsEnabled":
                raise DownloadError(_OFFLINE) from e
            if _is_network_error(e):
                raise DownloadError(f"cannot reach {self.base} ({type(e).__name__}: {e}); compute nodes usually "
                                    "have no internet: download on a login node (or a node with internet)") from e
            if isinstance(e, OSError):  # a short read, a full disk: what is on disk stays resumable
                raise DownloadError(f"downloading {self.model_id} failed ({e}); fix the cause and run the "
                                    "download again: it resumes where it stopped") from e
            raise


def _same_origin(url: str, target: str) -> bool:
    a, b = urlsplit(url), urlsplit(target)
    return (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)


def _is_network_error(e: Exception) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return type(e).__module__.split(".")[0] in {"httpx", "httpx2", "httpcore", "requests", "urllib3"}


class _LogProgress:
    """A tqdm stand-in for log files: logs "file: done of total" every PROGRESS_LOG_INTERVAL_S seconds."""

    def __init__(self, *, desc: str = "", total: int | None = None, initial: int = 0, **_: Any):
        self.desc, self.total, self.n, self._last = desc, total, initial, time.monotonic()

    def __enter__(self) -> _LogProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self._last >= PROGRESS_LOG_INTERVAL_S:
            self._last = time.monotonic()
            total = format_size(self.total) if self.total else "?"
            logger.info("%s: %s of %s", self.desc, format_size(self.n), total)


def format_size(num_bytes: int) -> str:
    """Bytes for people: "1.23 GB" from 1 GB up, else "45.6 MB"."""
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"
