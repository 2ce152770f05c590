"""`tgi-hpc compile` (build the offline engine release) and `tgi-hpc release verify`."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


@click.command("compile")
@click.option("--release-dir", help="Where releases live (default: the profile's paths.releases).")
@click.option("--cuda-archs", default="", help='GPU architectures for kernels, e.g. "8.0;8.6;8.9;9.0".')
@click.option("--with-kernels", is_flag=True, help="Also build flash-attention for those architectures.")
@click.option("--here/--job", "here", default=None,
              help="Build in this process or as a job. Default: the profile's network.compile_on.")
@click.option("--wait/--no-wait", "wait_done", default=False, help="With --job: wait until the job ends.")
@click.option("--dry-run", is_flag=True, help="With --job: print the job script; submit nothing.")
@with_app
def compile_command(app: App, release_dir, cuda_archs, with_kernels, here, wait_done, dry_run) -> None:
    """Build (or bring up to date) the engine release every serve job activates."""
    from tgi_hpc.prepare import run_compile

    result = run_compile(app.cluster(strict_paths=not dry_run), release_dir=release_dir, cuda_archs=cuda_archs,
                         with_kernels=with_kernels, here=here, wait=wait_done, dry_run=dry_run, progress=app.info)
    app.emit(result.to_dict(), result.summary())


@click.group()
def release() -> None:
    """Inspect engine releases."""


@release.command("verify")
@click.argument("release_dir", required=False)
@click.option("--fix", is_flag=True, help="Restore exec bits (lost by Globus) before verifying.")
@with_app
def verify(app: App, release_dir, fix) -> None:
    """Import the engine from the release, run a tiny CPU generation, check GPU kernels on a GPU node."""
    from dataclasses import asdict
    from pathlib import Path

    from tgi_hpc.errors import ReleaseError
    from tgi_hpc.release import fix_permissions, verify_release

    if release_dir is None:
        cluster = app.cluster()
        release_dir = str(Path(cluster.expand(cluster.profile.paths.releases)) / "current")
    path = Path(release_dir)
    if fix:
        for fixed in fix_permissions(path):
            app.info(f"fixed permissions: {fixed}")
    report = verify_release(path)
    data = asdict(report) if not isinstance(report, dict) else report
    app.emit(data, "\n".join(f"{k}: {v}" for k, v in data.items()))
    if not data.get("ok", False):
        raise ReleaseError(f"release {path} failed verification (see above)")
