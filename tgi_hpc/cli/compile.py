"""`tgi-hpc compile` (build the offline engine release) and `tgi-hpc release verify`."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


@click.command("compile")
@click.option("--release-dir", help="Where releases live (default: the profile's paths.releases).")
@click.option("--cuda-archs", default="", help='GPU architectures for kernels, e.g. "8.0;8.6;8.9;9.0".')
@click.option("--with-kernels", is_flag=True,
              help="Also build flash-attention for those architectures (optional: the engine's own Triton "
                   "attention ships with CUDA torch and needs no build; this is hours of nvcc).")
@click.option("--name", help="Release name (default: a hash of the inputs, so a rerun is a no-op).")
@click.option("--torch-spec", help='PyTorch requirement, e.g. "torch==2.6.0" (a CUDA build on clusters).')
@click.option("--offline", "wheelhouse", metavar="WHEELHOUSE",
              help="Build with no index, from this wheelhouse (e.g. an earlier release's wheelhouse/).")
@click.option("--venv-tool", type=click.Choice(["venv", "virtualenv"]), default="venv", show_default=True,
              help="virtualenv for DRAC's `virtualenv --no-download`.")
@click.option("--here/--job", "here", default=None,
              help="Build in this process or as a job. Default: the profile's network.compile_on.")
@click.option("--wait/--no-wait", "wait_done", default=False, help="With --job: wait until the job ends.")
@click.option("--dry-run", is_flag=True, help="With --job: print the job script; submit nothing.")
@with_app
def compile_command(app: App, release_dir, cuda_archs, with_kernels, name, torch_spec, wheelhouse, venv_tool,
                    here, wait_done, dry_run) -> None:
    """Build (or bring up to date) the engine release every serve job activates."""
    from tgi_hpc.release.options import CompileOptions
    from tgi_hpc.workflows.prepare import run_compile

    opts = CompileOptions(release_dir, name, cuda_archs, with_kernels, torch_spec, wheelhouse, venv_tool)
    result = run_compile(app.cluster(strict_paths=not dry_run), opts, here=here, wait=wait_done, dry_run=dry_run,
                         progress=app.info)
    result.again = app.again()
    app.emit(result.to_dict(), result.summary())


@click.group()
def release() -> None:
    """Inspect engine releases."""


@release.command("verify")
@click.argument("release_dir", required=False)
@click.option("--fix", is_flag=True,
              help="Repair a copied release first: python links and exec bits (lost by Globus), moved paths.")
@with_app
def verify(app: App, release_dir, fix) -> None:
    """Import the engine from the release, run a tiny CPU generation; on a GPU node also a GPU generation
    and the engine's attention self-check (`python -m engine.attention_check`)."""
    from dataclasses import asdict
    from pathlib import Path

    from tgi_hpc.errors import ReleaseError
    from tgi_hpc.release.repair import repair_release
    from tgi_hpc.release.verify import verify_release

    if release_dir is None:
        cluster = app.cluster()
        release_dir = str(Path(cluster.expand(cluster.profile.paths.releases)) / "current")
    path = Path(release_dir)
    if fix:
        for fixed in repair_release(path):
            app.info(f"repaired: {fixed}")
    report = verify_release(path)
    app.emit(asdict(report), report.format())
    if not report.ok:
        raise ReleaseError(f"release {path} failed verification: {'; '.join(report.problems)}")
