"""What varies per submission (the profile holds what varies per cluster)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tgi_hpc.profiles.schema import JobKind, Resources

JOB_NAME_PREFIX = "tgi-hpc-"


@dataclass(frozen=True)
class ShellPath:
    """A path whose `base` may hold profile $VARS (expanded on the node) and whose `rel` is literal."""

    base: str = ""
    rel: str = ""

    def __str__(self) -> str:
        if self.base and self.rel:
            return f"{self.base.rstrip('/')}/{self.rel}"
        return self.base or self.rel


@dataclass(frozen=True)
class JobSpec:
    kind: JobKind
    resources: Resources
    keep_alive: bool = False
    env: dict[str, str] = field(default_factory=dict)   # user --env K=V, literal values

    @property
    def name(self) -> str:
        return JOB_NAME_PREFIX + self.kind


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT adapter served beside its base model; requests name it (`adapter_id`, OpenAI `model`)."""

    name: str
    source: str                        # as the user gave it (Hub id in the store, or a folder)
    where: ShellPath = ShellPath()     # its folder where the job runs


@dataclass(frozen=True)
class EngineSpec:
    """One engine of a job that serves several models (one engine per model, each on its own port)."""

    model: str
    model_dir: ShellPath
    num_shard: int = 1
    gpu_slice: tuple[int, int] | None = None   # (first, count) of the job's GPUs it sees; None: all of them
    engine_args: tuple[str, ...] = ()          # the job's flags plus this engine's share (memory, CPU threads)
    loras: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True)
class ServeSpec(JobSpec):
    model: str = ""                    # as the user gave it (Hub id or directory)
    model_dir: ShellPath = ShellPath()
    num_shard: int = 1
    engine_args: tuple[str, ...] = ()  # validated engine flags and values
    api_key: bool = True
    stage_model: bool = True           # copy weights to node-local disk first
    loras: tuple[LoraAdapter, ...] = ()      # adapters of `model` (several models: in `engines`)
    engines: tuple[EngineSpec, ...] = ()     # several models: every engine, the first being `model`
    service: str = ""                  # a service's job (tgi_hpc/service/): its name, state file and shared key
    service_state: str = ""
    service_key_file: str = ""
    nodes: int = 1                     # > 1: one engine rank per GPU on every node (srun), pipeline stages
    sizing: tuple[str, ...] = ()       # how the GPUs and nodes were picked, as comments in the script
    speculative_model: str = ""        # --speculative-model as the user gave it ("" = none)
    speculative_dir: ShellPath = ShellPath()   # its folder where the job runs, staged beside the weights


@dataclass(frozen=True)
class DownloadSpec(JobSpec):
    model: str = ""
    revision: str = "main"


@dataclass(frozen=True)
class CompileSpec(JobSpec):
    release_dir: ShellPath = ShellPath()
    job_args: tuple[str, ...] = ()     # the compile options, for `python -m tgi_hpc.slurm.job compile`


@dataclass(frozen=True)
class BatchSpec(JobSpec):
    """A batch job (tgi_hpc/batch/): the engine in-process over shards of the batch folder's ledger."""

    model: str = ""
    model_dir: ShellPath = ShellPath()
    num_shard: int = 1
    engine_args: tuple[str, ...] = ()
    batch_dir: str = ""                # absolute, on a filesystem every node sees
    array_size: int = 0                # > 0: a job array of this many tasks (--array=0-N-1), each a holder
    workers: int = 1                   # engine processes per job, each a holder (engine.offline --workers)
