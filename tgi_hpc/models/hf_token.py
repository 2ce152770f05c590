"""Find the user's Hugging Face token without ever printing, logging or copying it."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def find_token(env: Mapping[str, str] = os.environ) -> str | None:
    """The Hugging Face token to use, or None.

    Looked up in order: `HF_TOKEN` (then the legacy `HUGGING_FACE_HUB_TOKEN`), the file written by
    `hf auth login` (`HF_TOKEN_PATH`, else `HF_HOME/token`, HF_HOME defaulting to ~/.cache/huggingface),
    and finally huggingface_hub's own lookup when `env` is the real environment.
    """
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if token := env.get(name, "").strip():
            return token
    if token := _read_token_file(_token_path(env)):
        return token
    if env is os.environ:  # other stores (e.g. Colab secrets); only for the real environment
        try:
            from huggingface_hub import get_token
        except ImportError:
            return None
        return get_token() or None
    return None


def _token_path(env: Mapping[str, str]) -> Path:
    if env.get("HF_TOKEN_PATH"):
        return Path(env["HF_TOKEN_PATH"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "token"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "token"


def _read_token_file(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):  # absent or unreadable: no token, and nothing to report
        return None
