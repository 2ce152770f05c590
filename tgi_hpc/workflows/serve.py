"""Turn `tgi-hpc serve` options into a ServeSpec: resolve the model, size the job, check engine flags."""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.models.footprint import Footprint, footprint
from tgi_hpc.models.quantization import LEGACY_FILE, check_quantize, with_legacy_config
from tgi_hpc.models.size import catalog_size_b
from tgi_hpc.models.store import model_dir, validate_model_id
from tgi_hpc.profiles.loader import require_account
from tgi_hpc.profiles.merge import parse_set
from tgi_hpc.profiles.rules import fit_partition
from tgi_hpc.profiles.schema import Profile
from tgi_hpc.quoting import sh
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.jobspec import ServeSpec, ShellPath
from tgi_hpc.workflows.checks import check_release, check_snapshot, find_shared_weights
from tgi_hpc.workflows.engine_flags import engine_args
from tgi_hpc.workflows.engines import ModelPlan, check_models, fraction_args, plan_engines, total_size
from tgi_hpc.workflows.lora import attach, check_adapters, resolve_adapters
from tgi_hpc.workflows.speculative import (check_speculative, check_speculative_flags, read_draft,
                                           resolve_speculative)
from tgi_hpc.workflows.placement import place

# serve option -> engine (TGI launcher) flag
LIMIT_FLAGS = {
    "max_input_tokens": "--max-input-tokens", "max_total_tokens": "--max-total-tokens",
    "max_batch_prefill_tokens": "--max-batch-prefill-tokens", "max_batch_total_tokens": "--max-batch-total-tokens",
    "max_concurrent_requests": "--max-concurrent-requests", "max_best_of": "--max-best-of",
    "max_stop_sequences": "--max-stop-sequences", "quantize": "--quantize", "dtype": "--dtype",
}


@dataclass
class ServeOptions:
    model: str
    revision: str = "main"
    gpus: int | None = None        # the job's total GPUs (all nodes together)
    gpu_type: str | None = None    # one of the profile's slurm.gpu_types; sizes the job from its memory
    nodes: int | None = None       # None: one node, or as many as the model needs (tgi_hpc/workflows/placement.py)
    time: str | None = None
    partition: str | None = None
    limits: dict[str, object] = field(default_factory=dict)   # keys of LIMIT_FLAGS
    env: list[str] = field(default_factory=list)              # K=V
    engine_args: list[str] = field(default_factory=list)      # FLAG=VALUE
    keep_alive: bool = False
    api_key: bool = True
    shared_weights: bool = True    # look in the profile's read-only weight folders before the model store
    other_models: list[str] = field(default_factory=list)     # --model A --model B: B..., one engine each
    loras: list[str] = field(default_factory=list)            # NAME=ORG/ADAPTER or NAME=FOLDER
    memory_fractions: list[float] = field(default_factory=list)   # --cuda-memory-fraction, one per model
    speculative_model: str | None = None   # a draft (model, Medusa heads, EAGLE-3) in the store or a folder


def gpu_type_from_overrides(overrides: Sequence[str]) -> str | None:
    """`--set slurm.defaults.serve.gpu_type=X` asks for that type as --gpu-type X does (otherwise a catalog
    entry's type would win over it, and the --set would be accepted and ignored)."""
    found = None
    for item in overrides:
        parts, value = parse_set(item)
        if parts == ("slurm", "defaults", "serve", "gpu_type") and value not in (None, ""):
            found = str(value)
    return found


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--env {item!r}: expected NAME=VALUE with NAME a valid variable name")
        if key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "API_KEY"):
            raise UsageError(f"--env {key}=... would write a secret into the job script; "
                             "export it in your shell instead (sbatch passes the environment on)")
        env[key] = value
    return env


def _is_path(cluster: Cluster, model: str) -> bool:
    if model.startswith(("/", ".", "~")):
        return True
    return isinstance(cluster.runner, LocalRunner) and Path(model).is_dir()


def _model_location(cluster: Cluster, opts: ServeOptions) -> ShellPath:
    """Where the job finds the weights: a snapshot directory, a read-only shared copy (Mila's
    /network/weights), or the model store's copy of a Hub id."""
    model, revision = opts.model, opts.revision
    if _is_path(cluster, model):
        return ShellPath("", cluster_path(cluster, model))
    rel = model_dir(Path("/"), validate_model_id(model), revision).relative_to("/")
    shared = cluster.profile.paths.shared_weights
    if shared and opts.shared_weights and revision == "main":   # shared copies carry no revision
        found = find_shared_weights(cluster, model, shared)
        if found:
            return ShellPath("", found)
    return ShellPath(cluster.profile.paths.models, str(rel))


def cluster_path(cluster: Cluster, path: str) -> str:
    """An absolute path where the jobs run: resolved here on a login node, on the login node from a laptop."""
    if isinstance(cluster.runner, LocalRunner):
        return str(Path(path).expanduser().resolve())
    if path.startswith("~/") or path == "~":
        return cluster.expand("$HOME" + path[1:])
    if not path.startswith("/"):
        raise UsageError(f"{path!r}: from a laptop, give an absolute path on the cluster (or ~/...)")
    return path


def _read_config(cluster: Cluster, where: ShellPath, offline: bool) -> dict | None:
    """The snapshot's config.json (with an old GPTQ export's quantize_config.json folded in, as the engine
    reads it), read where the jobs run (over SSH from a laptop, unless `offline`), if it is there already."""
    if offline and not cluster.is_local:
        return None
    try:
        path = cluster.expand(str(where))
    except SlurmError:
        return None
    config, legacy = _read_json(cluster, f"{path}/config.json"), _read_json(cluster, f"{path}/{LEGACY_FILE}")
    return with_legacy_config(config, legacy) if isinstance(config, dict) else None


def _read_json(cluster: Cluster, path: str) -> dict | None:
    try:
        found = json.loads(cluster.runner.read_file(path))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def check_before_submit(cluster: Cluster, spec: ServeSpec, release: ShellPath, explicit_release: bool) -> None:
    """The release and a complete snapshot must be where the job will look (else it fails after the queue)."""
    in_store = spec.model_dir.base == cluster.profile.paths.models
    check_snapshot(cluster, cluster.expand(str(spec.model_dir)), spec.model, in_store)
    for engine in spec.engines[1:]:
        in_store = engine.model_dir.base == cluster.profile.paths.models
        check_snapshot(cluster, cluster.expand(str(engine.model_dir)), engine.model, in_store)
    check_adapters(cluster, tuple(a for e in spec.engines for a in e.loras) if spec.engines else spec.loras)
    if spec.speculative_model:
        check_speculative(cluster, spec.speculative_model, spec.speculative_dir)
    check_release(cluster, cluster.expand(str(release)), explicit_release)


def build_serve_spec(cluster: Cluster, opts: ServeOptions, *, offline: bool = False) -> ServeSpec:
    """`offline`: a dry run from a laptop, which opens no SSH connection (sized from the name then)."""
    profile = cluster.profile
    require_account(profile)
    where = _model_location(cluster, opts)
    config = _read_config(cluster, where, offline)
    quantize = check_quantize(opts.limits.get("quantize"), config)   # refused here, before any queue
    first = ModelPlan(opts.model, where, catalog_size_b(opts.model, config, quantize))
    check_models([opts.model, *opts.other_models])
    others = [_plan_model(cluster, replace(opts, model=m), offline) for m in opts.other_models]
    if others and (opts.nodes or 1) > 1:
        raise UsageError("--nodes with several --model is not supported: one model spans the nodes")
    # one model: sized by its weights + KV cache (the catalog, or several nodes: tgi_hpc/workflows/placement.py)
    dtype_bytes = 4 if opts.limits.get("dtype") == "float32" else 2
    fp = None if others else footprint(opts.model, config, quantize, dtype_bytes=dtype_bytes)
    size = total_size([first.size_b, *(p.size_b for p in others)])
    if fp is not None and config is None:
        size = fp.weight_gb / 2          # a known model's card, where only its name was available
    draft_dir, uncounted = ShellPath(), ()
    if opts.speculative_model:
        check_speculative_flags(opts.speculative_model, opts.engine_args, 1 + len(others), opts.nodes or 1)
        draft_dir = resolve_speculative(cluster, opts.speculative_model, cluster_path)
        fp, size, uncounted = _with_draft(cluster, opts, profile, fp, size, draft_dir, where, config, offline,
                                          dtype_bytes)
    text = (config or {}).get("text_config", config or {})
    placement = place(profile, fp, size, opts.gpus, opts.nodes, num_heads=text.get("num_attention_heads"),
                      context_tokens=opts.limits.get("max_total_tokens"), gpu_type=opts.gpu_type)
    resources = placement.resources
    if placement.nodes > 1 and opts.loras:
        raise UsageError(f"--lora on {placement.nodes} nodes is not supported: adapters are served on one node")
    default = profile.slurm.defaults.get("serve") if profile.slurm else None
    resources = fit_partition(profile, resources, default.partition if default else None)
    choices = {k: v for k, v in (("partition", opts.partition), ("time", opts.time)) if v}
    if choices:
        resources = resources.model_copy(update=choices)
    num_shard = max(1, opts.gpus if opts.gpus is not None else (resources.gpus or 1))
    if placement.nodes > 1:
        num_shard = placement.gpus_per_node   # tensor parallelism within a node, a pipeline stage per node
    argv = []
    for key, value in {**opts.limits, "quantize": quantize}.items():
        if value is not None:
            argv += [LIMIT_FLAGS[key], str(value)]
    argv += engine_args(opts.engine_args)
    spec = ServeSpec(
        kind="serve", resources=resources, keep_alive=opts.keep_alive, env=parse_env(opts.env),
        model=opts.model, model_dir=where, num_shard=num_shard, engine_args=tuple(argv),
        api_key=opts.api_key, stage_model=cluster.uses_slurm, nodes=placement.nodes,
        sizing=placement.notes + uncounted,
    )
    if opts.speculative_model:
        check_speculative_flags(opts.speculative_model, opts.engine_args, 1 + len(others), placement.nodes)
        spec = replace(spec, speculative_model=opts.speculative_model, speculative_dir=draft_dir)
    return _with_models_and_adapters(cluster, spec, opts, [first, *others], offline)


def _with_draft(cluster: Cluster, opts: ServeOptions, profile: Profile, fp: Footprint | None, size: float | None,
                draft_dir: ShellPath, where: ShellPath, config: dict | None, offline: bool,
                dtype_bytes: int) -> tuple[Footprint | None, float | None, tuple[str, ...]]:
    """The job sized for the model and its draft (weights + the draft's own KV cache over the same planned
    tokens), the draft's vocabulary checked against the model's; as before where the draft cannot be read here."""
    readable = not offline or cluster.is_local
    draft = read_draft(cluster, opts.speculative_model, draft_dir, where, config, dtype_bytes) if readable else None
    if draft is None:
        return fp, size, (f"the draft {opts.speculative_model} is not counted: its files were not read here",)
    plan = profile.serving_plan
    tokens = (opts.limits.get("max_total_tokens") or plan.context_tokens) * plan.concurrent_requests
    # the catalog counts bf16 parameters with the target's KV cache planned: the draft as the bf16 parameters
    # its weights and KV cache would fill
    size = None if size is None else size + (draft.weight_gb + draft.kv_bytes_per_token * tokens / 1e9) / 2
    if fp is not None:
        fp = replace(fp, weight_gb=fp.weight_gb + draft.weight_gb,
                     kv_bytes_per_token=fp.kv_bytes_per_token + draft.kv_bytes_per_token,
                     draft=draft.describe(opts.speculative_model))
    return fp, size, ()


def _plan_model(cluster: Cluster, opts: ServeOptions, offline: bool) -> ModelPlan:
    """Another --model of the job: where it is, and its size (checked against --quantize like the first)."""
    where = _model_location(cluster, opts)
    config = _read_config(cluster, where, offline)
    quantize = check_quantize(opts.limits.get("quantize"), config)
    return ModelPlan(opts.model, where, catalog_size_b(opts.model, config, quantize))


def _with_models_and_adapters(cluster: Cluster, spec: ServeSpec, opts: ServeOptions, plans: list[ModelPlan],
                              offline: bool) -> ServeSpec:
    """--lora adapters attached to their models, and with several models one engine each (tgi_hpc.workflows.engines)."""
    names = [p.model for p in plans]
    if opts.loras and "--lora-adapters" in spec.engine_args:
        raise UsageError("--lora and --engine-arg --lora-adapters: give the adapters with --lora only (it checks "
                         "and stages them)")
    adapters = attach(resolve_adapters(cluster, opts.loras, set(names), cluster_path, offline), names)
    if len(plans) == 1:
        fraction = tuple(fraction_args(opts.memory_fractions))
        return replace(spec, loras=adapters[0], engine_args=spec.engine_args + fraction)
    engines = plan_engines(plans, adapters, spec.resources, spec.engine_args, opts.memory_fractions)
    return replace(spec, loras=adapters[0], engines=engines, num_shard=engines[0].num_shard)


def release_dir(cluster: Cluster, release: str | None) -> ShellPath:
    """--release DIR, else the profile's current release; without Slurm, this very environment."""
    if release:
        return ShellPath("", cluster_path(cluster, release))
    if not cluster.uses_slurm:
        return ShellPath("", sys.prefix)
    return ShellPath(cluster.profile.paths.releases, "current")


@dataclass
class ServeResult:
    script: str
    job_id: str | None = None
    script_path: str | None = None
    log_path: str | None = None
    status: dict | None = None
    again: str = ""                # options that reach this cluster, for the commands the summary prints

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "script_path": self.script_path, "log": self.log_path, "status": self.status}

    def summary(self) -> str:
        lines = [f"job {self.job_id} submitted", f"  log:    {self.log_path}", f"  script: {self.script_path}"]
        if self.status and self.status.get("state") == "READY":
            url, key = self.status["url"], self.status.get("api_key_file")
            lines += [f"  READY at {url} on {self.status['node']}"]
            models = self.status.get("models", [])
            lines += [f"  {m['model']} at {m['url']}" + (f" (adapters: {', '.join(m['adapters'])})" if m["adapters"] else "")
                      for m in models if len(models) > 1 or m["adapters"]]
            auth = f' -H "Authorization: Bearer $(cat {sh(key)})"' if key else ""
            lines += [f"  api key file: {key or '(none)'}",
                      f"  try: curl {url}/generate{auth} -H 'Content-Type: application/json' "
                      "-d '{\"inputs\": \"Hello\", \"parameters\": {\"max_new_tokens\": 20}}'"]
        else:
            lines += [f"  follow it with: tgi-hpc status {self.job_id}{self.again}"]
        return "\n".join(lines)


def run_serve(cluster: Cluster, opts: ServeOptions, *, release: str | None = None, dry_run: bool = False,
              wait: bool = False, timeout: float = 1800, progress=lambda message: None,
              again: str = "") -> ServeResult:
    """Build, render, and (unless dry_run) submit; with wait, block until READY."""
    from tgi_hpc.slurm import jobs

    offline = dry_run and not cluster.is_local   # a dry run from a laptop stays offline (no SSH)
    if offline:
        opts = replace(opts, shared_weights=False)
    spec = build_serve_spec(cluster, opts, offline=offline)
    rel = release_dir(cluster, release)
    if spec.model_dir.base == "" and cluster.profile.paths.shared_weights and not _is_path(cluster, opts.model):
        progress(f"using the read-only copy of {opts.model} at {spec.model_dir.rel} (profile: paths.shared_weights)")
    if dry_run:
        return ServeResult(jobs.render(cluster, spec, release_dir=rel))
    check_before_submit(cluster, spec, rel, explicit_release=release is not None)
    sub = jobs.submit(cluster, spec, release_dir=rel)
    what = ", ".join(e.model for e in spec.engines) + ": one engine each" if spec.engines else \
        f"{spec.model}, {spec.num_shard} shard(s)"
    progress(f"submitted job {sub.job_id} ({what}); log: {sub.log_path}")
    result = ServeResult(sub.script, sub.job_id, sub.script_path, sub.log_path, again=again)
    if wait:
        result.status = jobs.wait(cluster, sub.job_id, until={"READY"}, timeout=timeout,
                                  on_change=lambda st: progress(st.describe()),
                                  on_beat=jobs.heartbeat(progress), again=again).to_dict()
    return result
