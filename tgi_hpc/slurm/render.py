"""Render a job script from the profile (cluster facts) and a JobSpec (this submission).

`#SBATCH` lines are computed here, in Python; templates only lay out shell. Every value reaches
the script through `tgi_hpc.quoting` (the Jinja finalizer refuses anything else).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

import jinja2

from tgi_hpc import __version__
from tgi_hpc.data import data_dir
from tgi_hpc.errors import TemplateError
from tgi_hpc.profiles.schema import Profile, Resources
from tgi_hpc.quoting import Shell, finalize, sbatch_value, sh, sh_comment, sh_env, sh_join, sh_name, trusted
from tgi_hpc.service.state import services_dir
from tgi_hpc.slurm import multinode
from tgi_hpc.slurm.jobspec import BatchSpec, CompileSpec, DownloadSpec, EngineSpec, JobSpec, LoraAdapter, ServeSpec, ShellPath

TITLES = {
    "serve": "tgi-hpc serve job: runs the engine and publishes its endpoint",
    "download": "tgi-hpc download job: stores Hugging Face weights in the model store",
    "compile": "tgi-hpc compile job: builds the offline engine release",
    "batch": "tgi-hpc batch job: runs shards of a batch of requests with the engine in-process",
}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates") / "slurm")),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=finalize,
    )
    env.filters.update(sh=sh, sh_env=sh_env, sh_comment=sh_comment)
    return env


def path_word(path: ShellPath) -> Shell:
    """A path as one shell word: profile $VARS in the base expand, the rest is literal."""
    if not path.base:
        return sh(path.rel)
    if not path.rel:
        return sh_env(path.base)
    return Shell(sh_env(path.base.rstrip("/") + "/") + sh(path.rel))


def _gpu_flags(profile: Profile, res: Resources) -> dict[str, str]:
    if not res.gpus:
        return {}
    if (res.nodes or 1) > 1:
        return multinode.gpu_flags(profile, res)
    count = f"{res.gpu_type}:{res.gpus}" if res.gpu_type else str(res.gpus)
    spelling = profile.slurm.gpu_request if profile.slurm else "gpus_per_task"
    if spelling == "gres":
        return {"gres": f"gpu:{count}"}
    if spelling == "gpus_per_task":
        # Slurm 22.05 refuses --gpus-per-task without -n.
        return {"ntasks": "1", "gpus-per-task": count}
    if spelling == "gpus":
        return {"gpus": count}
    return {"gpus-per-node": count}


def sbatch_flags(profile: Profile, spec: JobSpec, log_dir: str) -> dict[str, str | bool]:
    """The job's Slurm options, as {flag: value}; True is a bare flag."""
    res, slurm = spec.resources, profile.slurm
    # append: a requeued run keeps the earlier runs' output in the same log
    # chdir: the job runs in the job dir on scratch ($HOME is read-only on some compute nodes)
    flags: dict[str, str | bool] = {"job-name": spec.name, "output": f"{log_dir.rstrip('/')}/%j.out",
                                    "open-mode": "append", "chdir": log_dir}
    for key, value in (("partition", res.partition), ("time", res.time), ("mem", res.mem),
                       ("cpus-per-task", res.cpus_per_task), ("constraint", res.constraint),
                       ("account", slurm.account if slurm else None)):
        if value not in (None, ""):
            flags[key] = str(value)
    flags.update(_gpu_flags(profile, res))
    if isinstance(spec, BatchSpec) and spec.array_size > 0:
        # one task per holder of the batch's ledger; each task logs to ARRAYJOB_TASK.out
        flags["array"] = f"0-{int(spec.array_size) - 1}"
        flags["output"] = f"{log_dir.rstrip('/')}/%A_%a.out"
    if isinstance(spec, ServeSpec) and spec.service:
        flags["no-requeue"] = True   # a service replaces a lost job with a successor; a requeue would double it
    elif spec.keep_alive and slurm:
        flags["requeue"] = True
        flags["signal"] = f"B:{slurm.requeue_signal}@{slurm.requeue_signal_delay_s}"
    if slurm:
        flags.update(slurm.extra)
    flags.update(res.extra)
    return flags


def sbatch_directives(flags: Mapping[str, str | bool]) -> list[Shell]:
    lines = []
    for key in sorted(flags):
        name = key.replace("_", "-")
        if not name.replace("-", "").isalnum():
            raise TemplateError(f"not a valid sbatch option name: {key!r}")
        value = flags[key]
        if value is False:
            continue
        lines.append(Shell(f"#SBATCH --{name}" if value is True else f"#SBATCH --{name}={sbatch_value(value)}"))
    return lines


def _common(profile: Profile, spec: JobSpec, job_dir: str, python: str) -> dict[str, object]:
    env_pairs = [(sh_name(k), sh_env(v)) for k, v in profile.environment.env.items()]
    env_pairs += [(sh_name(k), sh(v)) for k, v in spec.env.items()]
    mods = profile.environment.modules
    return {
        "title": sh_comment(TITLES[spec.kind]),
        "version": sh_comment(__version__),
        "profile_label": sh_comment(profile.name + (f" (cluster {profile.cluster})" if profile.cluster else "")),
        "directives": sbatch_directives(sbatch_flags(profile, spec, job_dir)) if profile.slurm else [],
        "job_dir": sh_env(job_dir),
        "modules": sh_join(mods) if mods else "",
        "setup": [trusted(line) for line in profile.environment.setup],
        "env": env_pairs,
        "tgi_hpc_python": sh(python),
    }


def _loras(profile: Profile, loras: tuple[LoraAdapter, ...]) -> list[dict[str, Shell]]:
    """Each adapter's name, folder, and node-local copy (staged like the weights)."""
    return [{"name": sh(a.name), "dir": path_word(a.where),
             "stage_dir": path_word(ShellPath(profile.paths.node_local, f"tgi-hpc-lora/{a.name}"))} for a in loras]


def _engine(profile: Profile, spec: ServeSpec, index: int, engine: EngineSpec) -> dict[str, object]:
    """One engine of a several-models job, every value quoted (templates/slurm/serve_engines.sh.j2)."""
    first, count = engine.gpu_slice or (0, 0)
    return {
        "index": index, "model": sh(engine.model), "model_comment": sh_comment(engine.model),
        "model_dir": path_word(engine.model_dir), "num_shard": int(engine.num_shard),
        "stage_dir": path_word(ShellPath(profile.paths.node_local, f"tgi-hpc-models/{index}")),
        "gpu_first": int(first), "gpu_count": int(count),
        "engine_args": sh_join(list(engine.engine_args)) if engine.engine_args else "",
        "loras": _loras(profile, engine.loras), "adapter_names": sh(",".join(a.name for a in engine.loras)),
    }


def render_job(profile: Profile, spec: JobSpec, *, job_dir: str, release_dir: ShellPath | None = None,
               python: str = sys.executable) -> str:
    """The whole job script for `spec` on `profile`; `job_dir` holds logs, the script and endpoint.

    `python` runs tgi-hpc's in-job helpers for download/compile jobs: this interpreter on a login
    node; from a laptop, the profile's `remote_python` (tgi-hpc must be installed there too).
    """
    context = _common(profile, spec, job_dir, python)
    if isinstance(spec, ServeSpec):
        slurm = profile.slurm
        context.update(
            release_dir=path_word(release_dir or ShellPath(profile.paths.releases, "current")),
            model=sh(spec.model),
            model_comment=sh_comment(" + ".join(e.model for e in spec.engines) if spec.engines else spec.model),
            model_dir=path_word(spec.model_dir),
            stage_model=spec.stage_model,
            stage_dir=path_word(ShellPath(profile.paths.node_local, "tgi-hpc-model")),
            num_shard=int(spec.num_shard),
            engine_args=sh_join(list(spec.engine_args)) if spec.engine_args else "",
            # /info, /v1/models and every response name the model as the user did, not a node-local path
            served_model_name="" if "--served-model-name" in spec.engine_args else sh(spec.model),
            triton_cache="" if "TRITON_CACHE_DIR" in profile.environment.env else path_word(
                ShellPath(profile.paths.node_local, "triton-cache")),
            api_key=spec.api_key,
            keep_alive=spec.keep_alive and slurm is not None,
            requeue_signal=sh(slurm.requeue_signal) if slurm else "",
            max_requeues=int(slurm.max_requeues) if slurm else 0,
            loras=_loras(profile, spec.loras),
            speculative_dir=path_word(spec.speculative_dir) if spec.speculative_model else "",
            speculative_stage_dir=path_word(ShellPath(profile.paths.node_local, "tgi-hpc-draft")),
            engines=[_engine(profile, spec, i, e) for i, e in enumerate(spec.engines)],
            service=sh_comment(spec.service) if spec.service else "",
            # under the job dir as the job sees it (profile $VARS expand on the node)
            service_state=path_word(ShellPath(services_dir(job_dir), f"{spec.service}.json")),
            service_key_file=path_word(ShellPath(services_dir(job_dir), f"{spec.service}.api-key"))
            if spec.service and spec.service_key_file else "",
            sizing=[sh_comment(line) for line in spec.sizing],
            **multinode.script_context(profile, spec.resources),
        )
    elif isinstance(spec, DownloadSpec):
        context.update(model=sh(spec.model), revision=sh(spec.revision),
                       store_dir=sh_env(profile.paths.models))
    elif isinstance(spec, BatchSpec):
        slurm = profile.slurm
        context.update(
            release_dir=path_word(release_dir or ShellPath(profile.paths.releases, "current")),
            model=sh(spec.model), model_comment=sh_comment(spec.model), model_dir=path_word(spec.model_dir),
            num_shard=int(spec.num_shard), batch_dir=sh(spec.batch_dir), batch_comment=sh_comment(spec.batch_dir),
            engine_args=sh_join(list(spec.engine_args)) if spec.engine_args else "",
            workers=int(spec.workers),
            keep_alive=spec.keep_alive and slurm is not None,
            requeue_signal=sh(slurm.requeue_signal) if slurm else "",
            max_requeues=int(slurm.max_requeues) if slurm else 0)
    elif isinstance(spec, CompileSpec):
        context.update(release_dir=path_word(spec.release_dir),
                       compile_args=sh_join(list(spec.job_args)) if spec.job_args else "")
    try:
        return _environment().get_template(f"{spec.kind}.sh.j2").render(**context)
    except jinja2.UndefinedError as exc:
        raise TemplateError(f"template {spec.kind}.sh.j2 uses an undefined variable: {exc}") from exc
