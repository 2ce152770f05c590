"""endpoint.json: where a serve job really listens, written atomically by the job, read by the CLI."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine of the job: the model it serves, its port, and the LoRA adapters requests may name."""

    model: str
    port: int
    adapters: tuple[str, ...] = ()

    @property
    def served_names(self) -> list[str]:
        return [self.model, *self.adapters]


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
    adapters: tuple[str, ...] = ()               # LoRA adapters served beside `model`
    models: tuple[EngineEndpoint, ...] = ()      # several models: every engine, the first = model/port above

    @property
    def engines(self) -> list[EngineEndpoint]:
        return list(self.models) or [EngineEndpoint(self.model, self.port, self.adapters)]

    @property
    def served_names(self) -> list[str]:
        """Every name a request may use: each model and each adapter."""
        return [name for engine in self.engines for name in engine.served_names]

    def url_of(self, engine: EngineEndpoint) -> str:
        return f"http://{self.host}:{engine.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Endpoint":
        data = json.loads(text)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["adapters"] = tuple(known.get("adapters", ()))
        known["models"] = tuple(EngineEndpoint(m["model"], int(m["port"]), tuple(m.get("adapters", ())))
                                for m in known.get("models", ()))
        return cls(**known)


def endpoint_file(job_dir: str, job_id: str) -> str:
    return f"{job_dir.rstrip('/')}/{job_id}.endpoint.json"
