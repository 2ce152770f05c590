"""Cluster profiles: the schema every profile YAML must match (loading and merging: tgi_hpc.profiles.loader)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

JobKind = Literal["serve", "compile", "download", "batch"]
GpuRequest = Literal["gpus_per_task", "gres", "gpus", "gpus_per_node"]


class _Strict(BaseModel):
    # A misspelled key must be an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """Slurm resources for one job kind (or one catalog entry)."""

    partition: str | None = None
    time: str | None = None               # Slurm time string, e.g. "3:00:00" or "1-00:00:00"
    cpus_per_task: int | None = None
    mem: str | None = None                # e.g. "48G"
    gpus: int | None = None               # GPUs for the job (0 = CPU job); all nodes together
    nodes: int | None = None              # nodes the job spans (None = 1); see MultiNode
    gpu_type: str | None = None           # e.g. "a100l"; None = any
    constraint: str | None = None         # Slurm --constraint expression
    extra: dict[str, str | bool] = Field(default_factory=dict)  # other #SBATCH flags (name without --)


class CatalogEntry(_Strict):
    """Default resources for models up to `max_params_b` billion parameters (at 2 bytes each: a quantized
    model counts as its weight bytes / 2, see tgi_hpc.models.size.catalog_size_b)."""

    max_params_b: float
    label: str                            # e.g. "7-8B"
    resources: Resources


class MultiNode(_Strict):
    """Serve jobs larger than one node: srun starts one engine rank per GPU, tensor parallelism within a
    node, pipeline stages across nodes. A profile without this section refuses --nodes above 1."""

    max_nodes: int                        # most nodes one serve job may span (the docs' limit, or ours)
    gpus_per_node: int                    # GPUs such a job takes on each node
    gpu_memory_gb: float                  # memory of one of those GPUs (sizes the job from the model)
    resources: Resources = Field(default_factory=Resources)  # partition, GPU type, per-rank CPUs, per-node mem
    env: dict[str, str] = Field(default_factory=dict)        # interconnect settings (NCCL_*) for every rank
    source: str


class ServingPlan(_Strict):
    """What the KV cache of a served model is sized for when the profile picks its GPUs and nodes (ours: the
    engine's default context of 4096 tokens, a modest batch, and the share of GPU memory the engine takes)."""

    context_tokens: int = 4096
    concurrent_requests: int = 16
    gpu_memory_fraction: float = 0.85     # engine: 0.9 of the GPU, less the CUDA context and activations


class MultiNodeOverride(_Strict):
    """A cluster's differences from its profile's multinode section."""

    max_nodes: int | None = None
    gpus_per_node: int | None = None
    gpu_memory_gb: float | None = None
    resources: Resources | None = None
    env: dict[str, str] | None = None
    source: str | None = None


class SlurmSection(_Strict):
    account: str | None = None
    account_required: bool = False        # DRAC: every job needs --account=def-xxx
    gpu_request: GpuRequest = "gpus_per_task"
    gpu_types: list[str] = Field(default_factory=list)   # what --gres/--gpus may name on this cluster
    gpu_memory_gb: dict[str, float] = Field(default_factory=dict)  # GPU type -> its memory (sizes --gpu-type jobs)
    gpus_per_node: dict[str, int] = Field(default_factory=dict)    # GPU type -> GPUs in one node of that type
    allowed_gpu_counts: list[int] = Field(default_factory=list)  # GPUs a job may ask for (empty = any)
    requeue_signal: str = "USR1"          # --signal=B:<sig>@<delay> for keep-alive
    requeue_signal_delay_s: int = 120
    max_requeues: int = 10
    # Services (serve --replicas/--handover): Slurm's KillWait, the seconds between SIGTERM and SIGKILL
    # (30 by default: https://slurm.schedmd.com/slurm.conf.html#OPT_KillWait); the engine drains within it.
    kill_wait_s: int = Field(default=30, ge=1)
    # How a successor waits for its turn: begin (sbatch --begin), dependency (--dependency=after:JOB+MIN),
    # or at_lead (the job submits it at the lead time). https://slurm.schedmd.com/sbatch.html
    handover_submit: Literal["begin", "dependency", "at_lead"] = "begin"
    handover_floor_s: int = Field(default=300, ge=0)   # the shortest lead, whatever was observed (ours)
    defaults: dict[JobKind, Resources] = Field(default_factory=dict)  # per job kind
    extra: dict[str, str | bool] = Field(default_factory=dict)        # #SBATCH flags for every job


class PathsSection(_Strict):
    # Values may use $VARS that expand on the node ($SCRATCH, $SLURM_TMPDIR); they are
    # trusted profile data, double-quoted when rendered.
    scratch: str
    models: str                           # model store (tgi-hpc download writes here)
    releases: str                         # engine releases (tgi-hpc compile writes here)
    jobs: str                             # per-job dirs: script, logs, endpoint.json
    node_local: str = "$SLURM_TMPDIR"     # fast per-job disk
    project: str | None = None
    shared_weights: list[str] = Field(default_factory=list)  # read-only model folders serve looks in first
    scratch_purge_days: int | None = None  # scratch files this old are deleted (None: no purge)


class EnvironmentSection(_Strict):
    modules: list[str] = Field(default_factory=list)      # `module load` arguments, in order
    setup: list[str] = Field(default_factory=list)        # raw shell lines run before activation
    env: dict[str, str] = Field(default_factory=dict)     # exported in every job (caches, offline flags)


class NetworkSection(_Strict):
    compute_nodes_internet: bool          # can a job reach the Hub / PyPI?
    download_on: Literal["job", "login"]  # where `tgi-hpc download` runs by default
    compile_on: Literal["job", "login"]


class TimeRule(_Strict):
    """Wall-time bounds a cluster enforces (Slurm time strings), with the page that states them."""

    min: str | None = None
    max: str | None = None
    source: str
    min_source: str | None = None         # the page for `min`, when another page states it


class PartitionRule(_Strict):
    """What one partition allows; GPU types None = any."""

    max_time: str | None = None
    max_gpus: int | None = None
    max_cpus_per_task: int | None = None
    gpu_types: list[str] | None = None
    source: str


class WholeNodes(_Strict):
    """GPU jobs get whole nodes: a job asks for exactly a node's GPUs of one type, on every node it spans
    (a one-node job may also ask for one of the `partial` counts)."""

    gpus_per_node: dict[str, int]         # GPU (node) type -> GPUs in one node of that type
    partial: list[int] = Field(default_factory=list)  # counts below a whole node a one-node job may ask for
    untyped: str | None = None            # the node type a request without a GPU type gets (None: name one)
    source: str


class GpuTypeRule(_Strict):
    """GPU jobs must name a GPU type (a request without one may be refused or land on any GPU)."""

    source: str


class MigRule(_Strict):
    """MIG instances (GPU types matching `pattern`, fnmatch): at most `max_instances` in one job."""

    pattern: str
    max_instances: int = 1
    source: str


class AccessNote(_Strict):
    """A rule for reaching the login node (shown when SSH fails), with the page that states it."""

    text: str
    source: str


class AccountRule(_Strict):
    prefix: str                           # e.g. "aip-" on the PAICE clusters
    source: str


class JobRules(_Strict):
    """Cluster rules checked before submitting; every refusal cites `source`."""

    time: TimeRule | None = None          # every job (GPU jobs where cpu_time is set)
    cpu_time: TimeRule | None = None      # jobs without GPUs, when their limits differ
    whole_nodes: WholeNodes | None = None
    gpu_type: GpuTypeRule | None = None   # GPU jobs must name their type
    mig: MigRule | None = None
    account: AccountRule | None = None
    partitions: dict[str, PartitionRule] = Field(default_factory=dict)


class ClusterDetection(_Strict):
    # How to recognise this cluster from a login node.
    hostname_patterns: list[str] = Field(default_factory=list)  # fnmatch on socket.getfqdn()
    env: dict[str, str] = Field(default_factory=dict)           # fnmatch on values: {"CC_CLUSTER": "narval"}


class ClusterOverride(_Strict):
    """Per-cluster differences inside a multi-cluster profile (DRAC)."""

    login_host: str | None = None
    cpu_login_host: str | None = None     # where jobs without GPUs are submitted, when not login_host
    detect: ClusterDetection = Field(default_factory=ClusterDetection)
    gpu_request: GpuRequest | None = None
    gpu_types: list[str] | None = None
    gpu_memory_gb: dict[str, float] | None = None
    gpus_per_node: dict[str, int] | None = None
    allowed_gpu_counts: list[int] | None = None
    defaults: dict[JobKind, Resources] = Field(default_factory=dict)
    catalog: list[CatalogEntry] | None = None
    access: list[AccessNote] | None = None
    network: NetworkSection | None = None
    modules: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)    # merged into environment.env
    paths: dict[str, str | int | list[str] | None] = Field(default_factory=dict)  # merged into paths
    rules: JobRules | None = None         # merged into rules
    multinode: MultiNodeOverride | None = None  # merged into the profile's multinode section
    retired: bool = False
    replaced_by: str | None = None        # what to use instead of a retired cluster


class SSHSection(_Strict):
    """`tgi-hpc ssh-config` entries for a profile that is not a shipped cluster (e.g. a local test cluster)."""

    login: dict[str, str] = Field(default_factory=dict)   # options of the login_host alias (HostName, Port...)
    nodes: list[str] = Field(default_factory=list)        # compute-node Host patterns, jumping through the login
    source: str = "this profile"


class Profile(_Strict):
    name: str
    description: str = ""
    login_host: str | None = None         # ssh alias of the login node (None = local)
    ssh: SSHSection | None = None         # ssh-config entries, for profiles that are not shipped clusters
    cpu_login_host: str | None = None     # ssh alias for jobs without GPUs (Trillium: CPU login nodes)
    access: list[AccessNote] = Field(default_factory=list)  # login rules, shown when SSH fails
    detect: ClusterDetection = Field(default_factory=ClusterDetection)
    slurm: SlurmSection | None = None     # None = no Slurm (the built-in `local` profile)
    paths: PathsSection
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    network: NetworkSection
    catalog: list[CatalogEntry] = Field(default_factory=list)
    multinode: MultiNode | None = None    # None: serve jobs stay on one node
    serving_plan: ServingPlan = Field(default_factory=ServingPlan)
    rules: JobRules = Field(default_factory=JobRules)
    clusters: dict[str, ClusterOverride] = Field(default_factory=dict)
    cluster: str | None = None                # which entry of `clusters` was applied
    # From a laptop (remote mode): the cluster-side Python that has tgi-hpc installed; it runs the
    # login-node steps (download, compile, models) and the in-job helpers of download/compile jobs.
    remote_python: str = "python3"
