"""Preparing offline nodes: where `download` and `compile` run (here, or as a job) and what they print.

Compute nodes are offline on most DRAC clusters, so the profile says where each step runs
(`network.download_on`, `network.compile_on`); the user can force either with --here / --job.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tgi_hpc.errors import DownloadError, ReleaseError
from tgi_hpc.profiles.loader import require_account, resources_for
from tgi_hpc.release.options import CompileOptions, release_spec
from tgi_hpc.slurm.cluster import Cluster, submit_host
from tgi_hpc.slurm.jobspec import CompileSpec, DownloadSpec, JobSpec, ShellPath


@dataclass
class PrepareResult:
    kind: str
    where: str                      # "here" or "job"
    job_id: str | None = None
    log: str | None = None
    script: str | None = None
    state: str | None = None
    details: dict = field(default_factory=dict)
    again: str = ""                 # options that reach this cluster, for the command the summary prints

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "again"}

    def summary(self) -> str:
        if self.where == "here":
            return "\n".join(f"{k}: {v}" for k, v in self.details.items())
        if self.job_id is None:
            return self.script or ""
        end = f", ended {self.state}" if self.state else f"; follow it with: tgi-hpc logs {self.job_id} -f{self.again}"
        return f"{self.kind} job {self.job_id} submitted{end}\n  log: {self.log}"


def _runs_here(cluster: Cluster, here: bool | None, default: str) -> bool:
    if here is not None:
        return here
    return not cluster.uses_slurm or default == "login"


def _submit(cluster: Cluster, spec: JobSpec, *, wait: bool, dry_run: bool, progress: Callable[[str], None],
            env: dict[str, str] | None = None) -> PrepareResult:
    from tgi_hpc.slurm import jobs

    require_account(cluster.profile)
    host = submit_host(cluster.profile, spec.resources)
    details = {"submit_host": host} if host else {}
    if dry_run:
        return PrepareResult(spec.kind, "job", script=jobs.render(cluster, spec), details=details)
    target = cluster.for_job(spec.resources)
    try:
        sub = jobs.submit(target, spec, env=env)
        progress(f"submitted {spec.kind} job {sub.job_id}" + (f" from {host}" if target is not cluster else "")
                 + f"; log: {sub.log_path}")
        result = PrepareResult(spec.kind, "job", sub.job_id, sub.log_path, details=details)
        if wait:
            done = jobs.wait(target, sub.job_id, until={"COMPLETED"}, timeout=24 * 3600,
                             on_change=lambda st: progress(st.describe()), on_beat=jobs.heartbeat(progress))
            result.state = done.state
    finally:
        if target is not cluster:
            target.close()
    return result


def _on_login_node(cluster: Cluster, argv: list[str], *, env: dict[str, str] | None = None,
                   timeout: float = 24 * 3600, what: str):
    """From a laptop, a "here" step runs on the login node (`remote_python -m tgi_hpc.slurm.job ...`), where the
    store and releases are; secrets go in `env` (the channel's stdin), never in argv."""
    result = cluster.runner.run([cluster.profile.remote_python, "-m", "tgi_hpc.slurm.job", *argv], env=env, timeout=timeout)
    if result.returncode != 0:
        raise (DownloadError if what == "download" else ReleaseError)(
            f"{what} on the login node failed (exit {result.returncode}): {result.stderr.strip()[-1500:]}")
    return result


def _hub_client_settings(cluster: Cluster) -> None:
    """Profile settings for the Hub client when it runs here rather than in a job (DRAC asks for
    HF_HUB_DISABLE_XET=1 on login nodes). HF_HUB_OFFLINE is for offline jobs, never for a download."""
    value = cluster.profile.environment.env.get("HF_HUB_DISABLE_XET")
    if value is not None:
        os.environ.setdefault("HF_HUB_DISABLE_XET", value)


def run_download(cluster: Cluster, model: str, revision: str = "main", *, here: bool | None = None,
                 store: str | None = None, wait: bool = False, dry_run: bool = False,
                 progress: Callable[[str], None] = lambda m: None) -> PrepareResult:
    from tgi_hpc.models.store import validate_model_id, validate_revision

    validate_model_id(model)
    validate_revision(revision)
    from tgi_hpc.models.hf_token import find_token

    token = find_token()
    # The token reaches a job through sbatch's environment (or the SSH channel's stdin), never argv;
    # a Hub mirror the user set up here (HF_ENDPOINT) goes along.
    secrets = {k: v for k, v in (("HF_TOKEN", token), ("HF_ENDPOINT", os.environ.get("HF_ENDPOINT"))) if v} or None
    if _runs_here(cluster, here, cluster.profile.network.download_on):
        target = store or cluster.expand(cluster.profile.paths.models)
        if not cluster.is_local:
            xet = cluster.profile.environment.env.get("HF_HUB_DISABLE_XET")
            env = {**(secrets or {}), **({"HF_HUB_DISABLE_XET": xet} if xet else {})}
            log = _on_login_node(cluster, ["download", "--model", model, "--revision", revision, "--store", target],
                                 env=env, what="download").stderr
            return PrepareResult("download", "here", details={"model": model, "revision": revision,
                                                             "store": target, "log": log.strip()[-500:]})
        from tgi_hpc.models.download import download_model

        _hub_client_settings(cluster)
        stored = download_model(model, Path(target), revision=revision, token=token, progress=True)
        return PrepareResult("download", "here", details={"model": stored.model_id, "revision": stored.revision,
                                                         "path": str(stored.path), "size_bytes": stored.size_bytes,
                                                         "format": stored.format, "kind": stored.kind})
    spec = DownloadSpec(kind="download", resources=resources_for(cluster.profile, "download"),
                        model=model, revision=revision)
    return _submit(cluster, spec, wait=wait, dry_run=dry_run, progress=progress, env=secrets)


def run_compile(cluster: Cluster, opts: CompileOptions, *, here: bool | None = None, wait: bool = False,
                dry_run: bool = False, progress: Callable[[str], None] = lambda m: None) -> PrepareResult:
    target = opts.release_dir or cluster.expand(cluster.profile.paths.releases, strict=not dry_run)
    if _runs_here(cluster, here, cluster.profile.network.compile_on):
        if not cluster.is_local:
            log = _on_login_node(cluster, ["compile", "--release-dir", target, *opts.job_args()], what="compile",
                                 timeout=6 * 3600).stderr
            return PrepareResult("compile", "here", details={"releases": target, "log": log.strip()[-500:]})
        from tgi_hpc.release.build import build_release

        manifest = build_release(release_spec(target, opts), progress=progress)
        return PrepareResult("compile", "here", details={"release": f"{target}/{manifest.name}",
                                                        "torch": manifest.torch, "cuda": manifest.cuda,
                                                        "kernels": manifest.kernels})
    spec = CompileSpec(kind="compile", resources=resources_for(cluster.profile, "compile"),
                       release_dir=ShellPath("", target), job_args=tuple(opts.job_args()))
    return _submit(cluster, spec, wait=wait, dry_run=dry_run, progress=progress)


def list_stored(cluster: Cluster) -> list[dict]:
    """The model store's content, read where it lives."""
    store = cluster.expand(cluster.profile.paths.models)
    if not cluster.is_local:
        import json

        return json.loads(_on_login_node(cluster, ["models", "--store", store], timeout=120, what="models").stdout)
    from tgi_hpc.models.store import list_models, stored_dict

    return [stored_dict(m) for m in list_models(Path(store))]


def remove_stored(cluster: Cluster, model_id: str, revision: str | None) -> list[str]:
    store = cluster.expand(cluster.profile.paths.models)
    if not cluster.is_local:
        import json

        argv = ["models-rm", "--store", store, "--model", model_id, *(["--revision", revision] if revision else [])]
        return json.loads(_on_login_node(cluster, argv, timeout=600, what="models rm").stdout)
    from tgi_hpc.models.store import remove_model

    return [str(p) for p in remove_model(Path(store), model_id, revision)]
