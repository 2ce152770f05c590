"""Preparing offline nodes: where `download` and `compile` run (here, or as a job) and what they print.

Compute nodes are offline on most DRAC clusters, so the profile says where each step runs
(`network.download_on`, `network.compile_on`); the user can force either with --here / --job.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tgi_hpc.cluster import Cluster
from tgi_hpc.jobspec import CompileSpec, DownloadSpec, JobSpec, ShellPath
from tgi_hpc.profile_loader import require_account, resources_for


@dataclass
class PrepareResult:
    kind: str
    where: str                      # "here" or "job"
    job_id: str | None = None
    log: str | None = None
    script: str | None = None
    state: str | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        if self.where == "here":
            return "\n".join(f"{k}: {v}" for k, v in self.details.items())
        if self.job_id is None:
            return self.script or ""
        end = f", ended {self.state}" if self.state else f"; follow it with: tgi-hpc logs {self.job_id} -f"
        return f"{self.kind} job {self.job_id} submitted{end}\n  log: {self.log}"


def _runs_here(cluster: Cluster, here: bool | None, default: str) -> bool:
    if here is not None:
        return here
    return not cluster.uses_slurm or default == "login"


def _submit(cluster: Cluster, spec: JobSpec, *, wait: bool, dry_run: bool, progress: Callable[[str], None]) -> PrepareResult:
    from tgi_hpc import jobs

    require_account(cluster.profile)
    if dry_run:
        return PrepareResult(spec.kind, "job", script=jobs.render(cluster, spec))
    sub = jobs.submit(cluster, spec)
    progress(f"submitted {spec.kind} job {sub.job_id}; log: {sub.log_path}")
    result = PrepareResult(spec.kind, "job", sub.job_id, sub.log_path)
    if wait:
        done = jobs.wait(cluster, sub.job_id, until={"COMPLETED"}, timeout=24 * 3600,
                         on_change=lambda st: progress(f"job {st.job_id}: {st.state}"))
        result.state = done.state
    return result


def _hub_client_settings(cluster: Cluster) -> None:
    """Profile settings for the Hub client when it runs here rather than in a job (DRAC asks for
    HF_HUB_DISABLE_XET=1 on login nodes). HF_HUB_OFFLINE is for offline jobs, never for a download."""
    import os

    value = cluster.profile.environment.env.get("HF_HUB_DISABLE_XET")
    if value is not None:
        os.environ.setdefault("HF_HUB_DISABLE_XET", value)


def run_download(cluster: Cluster, model: str, revision: str = "main", *, here: bool | None = None,
                 store: str | None = None, wait: bool = False, dry_run: bool = False,
                 progress: Callable[[str], None] = lambda m: None) -> PrepareResult:
    from tgi_hpc.model_store import validate_model_id, validate_revision

    validate_model_id(model)
    validate_revision(revision)
    if _runs_here(cluster, here, cluster.profile.network.download_on):
        from tgi_hpc.download import download_model
        from tgi_hpc.hf_token import find_token

        target = Path(store or cluster.expand(cluster.profile.paths.models))
        _hub_client_settings(cluster)
        stored = download_model(model, target, revision=revision, token=find_token(), progress=True)
        return PrepareResult("download", "here", details={"model": stored.model_id, "revision": stored.revision,
                                                         "path": str(stored.path), "size_bytes": stored.size_bytes,
                                                         "format": stored.format})
    spec = DownloadSpec(kind="download", resources=resources_for(cluster.profile, "download"),
                        model=model, revision=revision)
    return _submit(cluster, spec, wait=wait, dry_run=dry_run, progress=progress)


def run_compile(cluster: Cluster, *, release_dir: str | None = None, cuda_archs: str = "", with_kernels: bool = False,
                here: bool | None = None, wait: bool = False, dry_run: bool = False,
                progress: Callable[[str], None] = lambda m: None) -> PrepareResult:
    target = release_dir or cluster.expand(cluster.profile.paths.releases, strict=not dry_run)
    if _runs_here(cluster, here, cluster.profile.network.compile_on):
        from tgi_hpc.release import ReleaseSpec, build_release

        spec = ReleaseSpec(release_dir=Path(target), cuda_archs=[a for a in cuda_archs.replace(",", ";").split(";") if a],
                           with_kernels=with_kernels)
        manifest = build_release(spec, progress=progress)
        return PrepareResult("compile", "here", details=manifest if isinstance(manifest, dict) else asdict(manifest))
    spec = CompileSpec(kind="compile", resources=resources_for(cluster.profile, "compile"),
                       release_dir=ShellPath("", target), cuda_archs=cuda_archs, with_kernels=with_kernels)
    return _submit(cluster, spec, wait=wait, dry_run=dry_run, progress=progress)
