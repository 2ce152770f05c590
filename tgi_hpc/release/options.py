"""`tgi-hpc compile`'s options: the same on the login node, over SSH and inside a compile job."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tgi_hpc.release.builder import offline_pip_args
from tgi_hpc.release.spec import ReleaseSpec


@dataclass
class CompileOptions:
    release_dir: str | None = None     # where releases live (default: the profile's paths.releases)
    name: str | None = None
    cuda_archs: str = ""
    with_kernels: bool = False
    torch_spec: str | None = None      # e.g. a CUDA build on clusters
    wheelhouse: str | None = None      # build offline from this wheelhouse
    venv_tool: str = "venv"            # DRAC documents `virtualenv --no-download`

    def job_args(self) -> list[str]:
        """The same options for `python -m tgi_hpc.slurm.job compile` inside the job."""
        args = ["--cuda-archs", self.cuda_archs] if self.cuda_archs else []
        args += ["--with-kernels"] if self.with_kernels else []
        for flag, value in (("--name", self.name), ("--torch-spec", self.torch_spec),
                            ("--wheelhouse", self.wheelhouse)):
            args += [flag, value] if value else []
        return args + (["--venv-tool", self.venv_tool] if self.venv_tool != "venv" else [])


def release_spec(target: str, opts: CompileOptions) -> ReleaseSpec:
    """The spec a build gets from these options, with `target` the folder where releases live."""
    extra = {"torch_spec": opts.torch_spec} if opts.torch_spec else {}
    return ReleaseSpec(release_dir=Path(target), name=opts.name,
                       cuda_archs=[a for a in opts.cuda_archs.replace(",", ";").split(";") if a],
                       with_kernels=opts.with_kernels, venv_tool=opts.venv_tool,  # type: ignore[arg-type]
                       pip_args=offline_pip_args(Path(opts.wheelhouse)) if opts.wheelhouse else [], **extra)
