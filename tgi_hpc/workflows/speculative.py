"""`serve --speculative-model ORG/NAME|FOLDER`: the draft the engine's `--speculative-model` reads (a smaller
model with the same tokenizer, Medusa heads or an EAGLE-3 layer), resolved where the jobs run, its engine flags
checked, and its folder checked complete before anything is submitted; the job stages it beside the weights."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tgi_hpc.errors import ModelNotFoundError, UsageError
from tgi_hpc.models.store import model_dir, validate_model_id
from tgi_hpc.quoting import sh
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.jobspec import ShellPath

WEIGHTS = (".safetensors", "pytorch_model.bin")


def check_speculative_flags(source: str, engine_args: list[str], num_models: int, nodes: int) -> None:
    """What the engine would refuse after the queue, refused here."""
    flags = {item.partition("=")[0]: item.partition("=")[2] for item in engine_args}
    if num_models > 1:
        raise UsageError("--speculative-model with several --model is not supported: serve the drafted model alone")
    if nodes > 1:
        raise UsageError(f"--speculative-model on {nodes} nodes is not supported (pipeline parallelism)")
    if "--speculative-layers" in flags:
        raise UsageError("--speculative-model and --engine-arg --speculative-layers are two drafters: pick one")
    if "--lora-adapters" in flags:
        raise UsageError("--speculative-model with LoRA adapters is not supported by the engine")
    speculate = flags.get("--speculate", "")
    if speculate != "auto" and not (speculate.isdigit() and 1 <= int(speculate) <= 16):
        raise UsageError(f"--speculative-model {source!r} drafts --speculate N tokens per step: add "
                         "--engine-arg --speculate=N (1 to 16) or --engine-arg --speculate=auto")


def resolve_speculative(cluster: Cluster, source: str, cluster_path: Callable[[Cluster, str], str]) -> ShellPath:
    """The draft's folder where the jobs run: a folder as given, else its snapshot in the model store."""
    if source.startswith(("/", ".", "~")) or (isinstance(cluster.runner, LocalRunner)
                                              and Path(source).expanduser().is_dir()):
        return ShellPath("", cluster_path(cluster, source))
    model_id, _, revision = source.partition("@")
    rel = model_dir(Path("/"), validate_model_id(model_id), revision or "main").relative_to("/")
    return ShellPath(cluster.profile.paths.models, str(rel))


def check_speculative(cluster: Cluster, source: str, where: ShellPath) -> None:
    """The draft folder holds a config.json and weights where the job will look (else it fails after the queue)."""
    path = cluster.expand(str(where))
    in_store = where.base == cluster.profile.paths.models
    result = cluster.runner.run(["ls", "-1A", path])
    if result.returncode != 0:
        hint = f": run `tgi-hpc download --model {sh(source)}` first" if in_store else ""
        raise ModelNotFoundError(f"--speculative-model {source}: {path} does not exist{hint}")
    names = set(result.stdout.split("\n")) - {""}
    missing = [what for what, ok in (("config.json", "config.json" in names),
                                     ("weights (*.safetensors or pytorch_model.bin)",
                                      any(n.endswith(WEIGHTS) for n in names))) if not ok]
    if missing:
        hint = f"; run `tgi-hpc download --model {sh(source)}` again" if in_store else ""
        raise ModelNotFoundError(f"--speculative-model {source} at {path} is incomplete: no "
                                 f"{' and no '.join(missing)}{hint}")
