"""LoRA adapters loaded into a running engine (its runtime routes, vLLM's shape: POST /v1/load_lora_adapter
{"lora_name", "lora_path"}, /v1/unload_lora_adapter {"lora_name"}, and /v1/models), and a service's record of
them, so that each successor loads them before it is marked READY (slurm.handover).

The record is one small JSON file beside the service's state, `NAME.adapters.json`: {"adapters": {NAME: PATH}}.
`tgi-hpc adapter load|unload` writes it before it calls the replicas; a successor loads what it lists before it is
READY and once more right after (an adapter recorded in between is then loaded too).
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from tgi_hpc.errors import TgiHpcError, UsageError

CALL_TIMEOUT = httpx.Timeout(30.0, read=None)   # an unload waits for the adapter's requests in flight
ALREADY_LOADED = "is already loaded"


class AdapterRefused(UsageError):
    """The server refused the call (its 4xx message: a bad folder, a name taken, runtime LoRA off...)."""


def record_path(state_file: str) -> str:
    return state_file[: -len(".json")] + ".adapters.json"


def parse_record(text: str) -> dict[str, str]:
    """NAME -> PATH from a record's text; a damaged or foreign file lists nothing."""
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    adapters = data.get("adapters") if isinstance(data, dict) else None
    if not isinstance(adapters, dict):
        return {}
    return {k: v for k, v in adapters.items() if isinstance(k, str) and isinstance(v, str)}


def record_text(adapters: dict[str, str]) -> str:
    return json.dumps({"adapters": dict(sorted(adapters.items()))}, indent=1) + "\n"


def load(url: str, headers: dict[str, str], name: str, path: str, *,
         transport: httpx.BaseTransport | None = None) -> str:
    """Load adapter `name` from `path` (a folder where the server runs); the server's answer."""
    return _post(url, headers, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, transport)


def unload(url: str, headers: dict[str, str], name: str, *, transport: httpx.BaseTransport | None = None) -> str:
    """Unload adapter `name`; the server answers once its requests in flight have finished."""
    return _post(url, headers, "/v1/unload_lora_adapter", {"lora_name": name}, transport)


def served_models(url: str, headers: dict[str, str], *, transport: httpx.BaseTransport | None = None) -> list[str]:
    """The ids /v1/models lists: the base model first, then its adapters."""
    try:
        with httpx.Client(timeout=30.0, headers=headers, transport=transport, trust_env=False) as client:
            answer = client.get(f"{url.rstrip('/')}/v1/models")
    except httpx.HTTPError as exc:
        raise TgiHpcError(f"cannot reach {url}: {exc}") from None
    if answer.status_code != 200:
        raise _refusal(url, answer)
    try:
        return [str(card["id"]) for card in answer.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise TgiHpcError(f"{url}/v1/models answered something that is not a model list: {answer.text[:200]}") \
            from None


def load_recorded(url: str, api_key: str | None, record_file: str | Path, loaded: set[str], *,
                  transport: httpx.BaseTransport | None = None) -> list[str]:
    """In a successor's job: load each recorded adapter not in `loaded` (which grows); the names loaded now. An
    adapter the server refuses (its folder gone) is left out, with its reason, and the job serves on."""
    import logging

    try:
        recorded = parse_record(Path(record_file).read_text())
    except OSError:
        return []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done: list[str] = []
    for name, path in recorded.items():
        if name in loaded:
            continue
        try:
            load(url, headers, name, path, transport=transport)
        except TgiHpcError as exc:
            if ALREADY_LOADED not in str(exc):
                logging.getLogger(__name__).warning("recorded adapter %s (%s) not loaded: %s", name, path, exc)
                continue
        loaded.add(name)
        done.append(name)
    return done


def _post(url: str, headers: dict[str, str], route: str, body: dict, transport: httpx.BaseTransport | None) -> str:
    try:
        with httpx.Client(timeout=CALL_TIMEOUT, headers=headers, transport=transport, trust_env=False) as client:
            answer = client.post(f"{url.rstrip('/')}{route}", json=body)
    except httpx.HTTPError as exc:
        raise TgiHpcError(f"cannot reach {url}: {exc}") from None
    if answer.status_code != 200:
        raise _refusal(url, answer)
    return answer.text.strip()


def _refusal(url: str, answer: httpx.Response) -> TgiHpcError:
    """The server's TGI error body {"error", "error_type"} as one of ours: a 4xx is the caller's to fix."""
    try:
        message = str(answer.json()["error"])
    except (ValueError, KeyError, TypeError):
        message = answer.text.strip()[:300] or answer.reason_phrase
    if answer.status_code == 401:
        message = f"{message} (the API key was refused)"
    cls = AdapterRefused if 400 <= answer.status_code < 500 else TgiHpcError
    return cls(f"{url} answered {answer.status_code}: {message}")
