"""Readiness probes: /health answers 200 (cheap: what `status` asks), and with `generate` a one-token
generation goes through too (what `serve --wait` and tunnels ask before saying READY)."""
from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Probe:
    ready: bool
    detail: str


def probe(url: str, api_key: str | None = None, timeout: float = 10.0, transport: httpx.BaseTransport | None = None,
          generate: bool = True) -> Probe:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url, timeout=timeout, headers=headers, transport=transport, trust_env=False) as client:
            health = client.get("/health")
            if health.status_code != 200:
                return Probe(False, f"/health answered {health.status_code}")
            if not generate:
                return Probe(True, "/health ok")
            gen = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 1}})
            if gen.status_code != 200 or "generated_text" not in gen.json():
                return Probe(False, f"/generate answered {gen.status_code}: {gen.text[:200]}")
    except (httpx.HTTPError, ValueError) as exc:
        return Probe(False, f"not answering yet ({type(exc).__name__})")
    return Probe(True, "ready")


# Run on the login node when the CLI is elsewhere (a laptop cannot reach node:port directly).
# The API key comes on stdin, never in argv.
_REMOTE_PROBE = r"""
import json, sys, urllib.request, urllib.error
url, key, generate = sys.argv[1].rstrip("/"), sys.stdin.read().strip(), sys.argv[2:] == ["generate"]
headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})}
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def ask(path, body=None):
    req = urllib.request.Request(url + path, data=body, headers=headers)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
try:
    code, _ = ask("/health")
    if code != 200:
        print(json.dumps([False, "/health answered %d" % code])); sys.exit()
    if not generate:
        print(json.dumps([True, "/health ok"])); sys.exit()
    code, body = ask("/generate", json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 1}}).encode())
    ok = code == 200 and "generated_text" in json.loads(body or b"{}")
    print(json.dumps([ok, "ready" if ok else "/generate answered %d" % code]))
except Exception as e:
    print(json.dumps([False, "not answering yet (%s)" % type(e).__name__]))
"""


def probe_from(runner, url: str, api_key: str | None, generate: bool = True) -> Probe:
    """Probe from where the Slurm commands run: here, or the login node over SSH."""
    from tgi_hpc.remote.runner import LocalRunner

    if isinstance(runner, LocalRunner):
        return probe(url, api_key, generate=generate)
    argv = ["python3", "-c", _REMOTE_PROBE, url, *(["generate"] if generate else [])]
    result = runner.run(argv, input=api_key or "", timeout=40)
    try:
        import json

        ready, detail = json.loads(result.stdout.strip().splitlines()[-1])
        return Probe(bool(ready), str(detail))
    except (ValueError, IndexError):
        return Probe(False, f"probe failed on the login node: {result.stderr.strip()[:200]}")


def probe_engines(runner, endpoint, api_key: str | None, generate: bool = True) -> Probe:
    """A job serving several models is ready when every engine is: the first that is not says why."""
    engines = endpoint.engines
    for engine in engines:
        result = probe_from(runner, endpoint.url_of(engine), api_key, generate=generate)
        if not result.ready:
            return Probe(False, f"{engine.model}: {result.detail}") if len(engines) > 1 else result
    return result
