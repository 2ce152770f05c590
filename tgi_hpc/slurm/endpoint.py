"""endpoint.json: where a serve job really listens, written atomically by the job, read by the CLI."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Endpoint:
    job_id: str
    node: str             # Slurm's node name (SLURMD_NODENAME) or the hostname
    host: str             # an address other hosts can connect to
    port: int
    api_key_file: str     # "" when the server runs without a key
    model: str = ""
    restart_count: int = 0
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Endpoint":
        data = json.loads(text)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def endpoint_file(job_dir: str, job_id: str) -> str:
    return f"{job_dir.rstrip('/')}/{job_id}.endpoint.json"
