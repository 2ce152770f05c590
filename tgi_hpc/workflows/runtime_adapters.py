"""`tgi-hpc adapter load|unload|list JOB|SERVICE`: LoRA adapters loaded into, and unloaded from, a server while it
serves (the engine runs with --enable-runtime-lora; service.adapters talks to it).

The target is reached the way `metrics` and `chat` reach it (workflows.access). On a service every READY replica
gets the call, and the service's adapter record is written first, so that successors start with the adapter.
NAME=PATH takes a folder where the server runs, or ORG/ADAPTER from the model store (as `serve --lora` does); the
folder is checked before any server is called.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tgi_hpc.errors import TgiHpcError, UsageError
from tgi_hpc.models.adapter import check_adapter_name
from tgi_hpc.service import adapters as runtime
from tgi_hpc.service.state import state_path
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.workflows import access


@dataclass
class AdapterChange:
    """One load or unload: on which servers it took effect (job ids), and what each answered."""

    action: str                 # load | unload
    target: str                 # the job id, or the service's name
    name: str
    path: str = ""              # where the server reads it (load)
    servers: dict[str, str] = field(default_factory=dict)   # job id -> the server's answer
    service: bool = False

    def to_dict(self) -> dict:
        return {"action": self.action, "target": self.target, "name": self.name, "path": self.path,
                "servers": self.servers, "service": self.service}

    def summary(self) -> str:
        done = "loaded" if self.action == "load" else "unloaded"
        where = f"service {self.target}" if self.service else f"job {self.target}"
        source = f" from {self.path}" if self.path else ""
        return f"adapter {self.name} {done}{source} on {where} ({', '.join(self.servers) or 'no READY replica'})"


def parse_item(item: str) -> tuple[str, str]:
    """"NAME=PATH" or "NAME=ORG/ADAPTER" -> (name, source)."""
    name, sep, source = item.partition("=")
    if not sep or not name or not source:
        raise UsageError(f"{item!r}: expected NAME=PATH (a folder where the server runs) or NAME=ORG/ADAPTER")
    try:
        check_adapter_name(name)
    except ValueError as exc:
        raise UsageError(f"{item!r}: {exc}") from None
    return name, source


def load_adapter(cluster: Cluster, target: str, item: str, *, model: str | None = None, timeout: float = 600,
                 progress=lambda message: None) -> AdapterChange:
    from tgi_hpc.workflows.lora import check_adapters, resolve_adapters
    from tgi_hpc.workflows.serve import cluster_path

    name, _ = parse_item(item)
    [adapter] = resolve_adapters(cluster, [item], set(), cluster_path)
    check_adapters(cluster, (adapter.spec,))
    path = cluster.expand(str(adapter.spec.where))
    with access.connect(cluster, target, model=model, timeout=timeout, progress=progress) as found:
        servers = _servers(found)
        change = AdapterChange("load", found.job_id, name, path, service=found.service)
        if found.service:
            before = _read_record(cluster, found.job_id)
            _record(cluster, found.job_id, lambda adapters: {**adapters, name: path})
        try:
            for job_id, url in servers.items():
                change.servers[job_id] = _each(change, job_id,
                                               lambda u=url: runtime.load(u, found.headers, name, path))
        except TgiHpcError:
            if found.service and not change.servers:    # refused everywhere: successors must not try it
                _record(cluster, found.job_id, lambda adapters: _restore(adapters, name, before))
            raise
    return change


def unload_adapter(cluster: Cluster, target: str, name: str, *, model: str | None = None, timeout: float = 600,
                   progress=lambda message: None) -> AdapterChange:
    try:
        check_adapter_name(name)
    except ValueError as exc:
        raise UsageError(f"{name!r}: {exc}") from None
    with access.connect(cluster, target, model=model, timeout=timeout, progress=progress) as found:
        servers = _servers(found)
        change = AdapterChange("unload", found.job_id, name, service=found.service)
        if found.service:
            _record(cluster, found.job_id, lambda adapters: {k: v for k, v in adapters.items() if k != name})
        for job_id, url in servers.items():
            change.servers[job_id] = _each(change, job_id, lambda u=url: runtime.unload(u, found.headers, name))
    return change


def list_adapters(cluster: Cluster, target: str | None, *, model: str | None = None, timeout: float = 600,
                  progress=lambda message: None) -> dict:
    """{"target", "service", "servers": {job id: {"model", "adapters"}}, "recorded": {NAME: PATH} (a service)}."""
    with access.connect(cluster, target, model=model, timeout=timeout, progress=progress) as found:
        servers = {}
        for job_id, url in _servers(found, several_models=True).items():
            base, *adapters = runtime.served_models(url, found.headers)
            servers[job_id] = {"model": base, "adapters": adapters}
        listing = {"target": found.job_id, "service": found.service, "servers": servers}
        if found.service:
            listing["recorded"] = _read_record(cluster, found.job_id)
    return listing


def _servers(found: access.Access, several_models: bool = False) -> dict[str, str]:
    """Job id -> URL of each server the call goes to (a service: each READY replica)."""
    if len(found.engines) > 1 and not several_models:
        raise UsageError(f"job {found.job_id} serves several models ({', '.join(found.engines)}): name the adapter's "
                         "base model with --model")
    return found.replicas()


def _each(change: AdapterChange, job_id: str, call) -> str:
    """One server's answer; a failure names what already took effect elsewhere. On a service, a replica that
    already has the adapter (a successor that read the record) counts as loaded."""
    try:
        return call()
    except TgiHpcError as exc:
        if change.service and change.action == "load" and runtime.ALREADY_LOADED in str(exc):
            return "already loaded"
        if change.servers:
            raise type(exc)(f"{exc} (replica {job_id}; already {change.action}ed on {', '.join(change.servers)})") \
                from None
        raise


def _record(cluster: Cluster, name: str, edit) -> None:
    path = runtime.record_path(state_path(cluster.job_dir, name))
    cluster.runner.write_file(path, runtime.record_text(edit(_read_record(cluster, name))), mode=0o600)


def _restore(adapters: dict[str, str], name: str, before: dict[str, str]) -> dict[str, str]:
    rest = {k: v for k, v in adapters.items() if k != name}
    return {**rest, name: before[name]} if name in before else rest


def _read_record(cluster: Cluster, name: str) -> dict[str, str]:
    try:
        return runtime.parse_record(cluster.runner.read_file(runtime.record_path(state_path(cluster.job_dir, name))))
    except OSError:
        return {}
