"""A real readiness probe: /health answers 200 and a one-token generation goes through."""
from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Probe:
    ready: bool
    detail: str


def probe(url: str, api_key: str | None = None, timeout: float = 10.0, transport: httpx.BaseTransport | None = None) -> Probe:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url, timeout=timeout, headers=headers, transport=transport, trust_env=False) as client:
            health = client.get("/health")
            if health.status_code != 200:
                return Probe(False, f"/health answered {health.status_code}")
            gen = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 1}})
            if gen.status_code != 200 or "generated_text" not in gen.json():
                return Probe(False, f"/generate answered {gen.status_code}: {gen.text[:200]}")
    except (httpx.HTTPError, ValueError) as exc:
        return Probe(False, f"not answering yet ({type(exc).__name__})")
    return Probe(True, "ready")
