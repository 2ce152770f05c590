"""ServiceClient: call a service from code running on the cluster (another job, a notebook on a node).

It reads the service's state file (shared filesystem) to find the READY replicas, balances requests over
them (least outstanding), follows handovers, and retries a request on another replica when the one it
picked refuses the connection or answers 503 `draining` (the request was not started there: safe to
send again). A request cut off mid-way by a replica that dies raises ReplicaLost (it may have run), unless
`retry_lost=True`. Importable without torch: httpx only.

    from tgi_hpc.service.client import ServiceClient
    with ServiceClient.from_env() as client:      # after: eval "$(tgi-hpc endpoint NAME)"
        print(client.generate("Hello", max_new_tokens=20)["generated_text"])
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx

from tgi_hpc.errors import TgiHpcError
from tgi_hpc.service.balance import Balancer, Target
from tgi_hpc.service.state import ServiceState


class ServiceUnavailable(TgiHpcError):
    """No replica of the service took the request within the retry time."""


class ReplicaLost(TgiHpcError):
    """The replica went away while it ran the request (scancel, node failure): it may or may not have run."""


_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
_LOST_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class ServiceClient:
    def __init__(self, state_file: str | None = None, urls: list[str] | None = None, api_key: str | None = None, *,
                 timeout: float = 120.0, retry_for: float = 60.0, retry_lost: bool = False, refresh_s: float = 2.0):
        if not state_file and not urls:
            raise ValueError("give the service's state file (TGI_HPC_SERVICE_STATE) or its URLs (TGI_HPC_URLS)")
        self.state_file, self.retry_for, self.retry_lost, self.refresh_s = state_file, retry_for, retry_lost, refresh_s
        self.balancer = Balancer()
        self._static = [Target.from_url(str(i), u) for i, u in enumerate(urls or [])]
        self._read_at = 0.0
        self._key = api_key
        self._http = httpx.Client(timeout=timeout, trust_env=False)
        self._refresh(force=True)

    @classmethod
    def from_env(cls, **kwargs: Any) -> ServiceClient:
        """From what `eval "$(tgi-hpc endpoint NAME)"` exports."""
        urls = os.environ.get("TGI_HPC_URLS", "").split()
        return cls(os.environ.get("TGI_HPC_SERVICE_STATE") or None, urls or None,
                   os.environ.get("TGI_HPC_API_KEY") or None, **kwargs)

    def _refresh(self, force: bool = False) -> None:
        if not self.state_file:
            self.balancer.update(self._static)
            return
        if not force and time.monotonic() - self._read_at < self.refresh_s:
            return
        try:
            state = ServiceState.from_json(Path(self.state_file).read_text())
        except (OSError, ValueError, TypeError):
            return   # keep the last list: a reader may meet the file between two writers
        self._read_at = time.monotonic()
        self.balancer.update([Target.from_url(j.job_id, j.url) for j in state.serving()])
        if self._key is None and state.api_key_file:
            try:
                self._key = Path(state.api_key_file).read_text().strip() or None
            except OSError:
                pass

    @property
    def urls(self) -> list[str]:
        self._refresh()
        return [t.url for t in self.balancer.targets]

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request to some replica; on a refused connection or a draining replica, another one."""
        headers = {**({"Authorization": f"Bearer {self._key}"} if self._key else {}), **kwargs.pop("headers", {})}
        deadline, tried, last = time.monotonic() + self.retry_for, set(), "no replica is READY"
        while True:
            self._refresh()
            target = self.balancer.acquire(exclude=tried)
            if target is None:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"no replica of the service took the request within {self.retry_for:.0f} s "
                                             f"(last: {last})")
                tried = set()
                time.sleep(1.0)
                self._refresh(force=True)
                continue
            try:
                response = self._http.request(method, target.url + path, headers=headers, **kwargs)
            except _CONNECT_ERRORS as exc:   # never reached the replica: safe on another one
                self.balancer.failed(target)
                tried.add(target)
                last = f"{target.url} (job {target.job_id}): {type(exc).__name__}"
                continue
            except _LOST_ERRORS as exc:
                self.balancer.failed(target)
                if not self.retry_lost:
                    raise ReplicaLost(f"replica {target.url} (job {target.job_id}) went away during the request "
                                      f"({type(exc).__name__}: {exc}); it may have run: send it again if that is "
                                      "harmless (ServiceClient(retry_lost=True) does)") from exc
                tried.add(target)
                last = f"{target.url} (job {target.job_id}) went away"
                continue
            finally:
                self.balancer.release(target)
            if response.status_code == 503 and _is_draining(response):   # not started there
                self.balancer.failed(target)
                tried.add(target)
                last = f"{target.url} (job {target.job_id}) is draining"
                continue
            return response

    def generate(self, inputs: str, **parameters: Any) -> dict:
        """TGI's /generate; raises httpx.HTTPStatusError on an error answer (its body says why)."""
        response = self.request("POST", "/generate", json={"inputs": inputs, "parameters": parameters})
        response.raise_for_status()
        return response.json()

    def chat(self, messages: list[dict], **kwargs: Any) -> dict:
        """OpenAI's /v1/chat/completions."""
        response = self.request("POST", "/v1/chat/completions", json={"model": "tgi", "messages": messages, **kwargs})
        response.raise_for_status()
        return response.json()

    def embed(self, inputs: str | list[str], *, dimensions: int | None = None, batch_size: int = 256,
              truncate: bool = False, prompt_name: str | None = None,
              input_type: str | None = None) -> list[list[float]]:
        """OpenAI's /v1/embeddings on a pooling model (engine/pooling/): one vector per input, in order, sent
        `batch_size` inputs per request (each request may go to another replica). `truncate`: cut inputs longer
        than the model takes (else the server answers 422). `prompt_name` (one of the model's sentence-transformers
        prompts) or `input_type` "query" / "document" (sentence-transformers' encode_query / encode_document)
        choose the prompt put before each input; neither: the model's default prompt, if it has one."""
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        vectors: list[list[float]] = []
        for start in range(0, len(texts), batch_size):
            body: dict[str, Any] = {"model": "tgi", "input": texts[start:start + batch_size]}
            if dimensions is not None:
                body["dimensions"] = dimensions
            if truncate:
                body["truncate"] = True
            body.update({k: v for k, v in (("prompt_name", prompt_name), ("input_type", input_type)) if v})
            response = self.request("POST", "/v1/embeddings", json=body)
            response.raise_for_status()
            data = sorted(response.json()["data"], key=lambda d: d["index"])
            vectors += [d["embedding"] for d in data]
        return vectors

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_draining(response: httpx.Response) -> bool:
    try:
        return response.json().get("error_type") == "draining"
    except ValueError:
        return False
