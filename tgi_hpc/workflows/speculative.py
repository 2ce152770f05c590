"""`serve --speculative-model ORG/NAME|FOLDER`: the draft the engine's `--speculative-model` reads (a smaller
model with the same tokenizer, Medusa heads or an EAGLE-3 layer), resolved where the jobs run, its engine flags
checked, its folder checked complete and its vocabulary checked against the model's before anything is submitted,
and its weights and KV cache added to the job's sizing (tgi_hpc/models/draft.py); the job stages it beside the
weights."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tgi_hpc.errors import ModelNotFoundError, SlurmError, UsageError
from tgi_hpc.models.draft import (MAX_HEADER_BYTES, DraftFootprint, check_heads_fit, draft_footprint, parse_header,
                                  tokenizer_vocab)
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


def read_draft(cluster: Cluster, source: str, where: ShellPath, target: ShellPath, target_config: dict | None,
               dtype_bytes: int = 2) -> DraftFootprint | None:
    """The draft's footprint, read where the jobs run, once its vocabulary is checked against the target's
    (UsageError naming the difference); None while its folder or config.json is not there yet
    (check_speculative then refuses it before submitting)."""
    try:
        path = cluster.expand(str(where))
        listing = cluster.runner.run(["ls", "-1A", path])
    except SlurmError:
        return None
    config = _json(cluster, f"{path}/config.json")
    if listing.returncode != 0 or config is None:
        return None
    names = sorted(n for n in listing.stdout.split("\n") if n.endswith(".safetensors"))
    headers = {}
    for name in names:
        try:
            header = _header(cluster, f"{path}/{name}", f"--speculative-model {source}: {name}")
        except SlurmError:     # no od or dd there
            return None
        if header is None:
            return None
        headers.update(header)
    footprint = draft_footprint(config, headers, dtype_bytes)
    if target_config is not None:
        check_heads_fit(config, headers, target_config, source)
        if footprint.kind == "draft":
            _check_tokenizer(cluster, source, path, cluster.expand(str(target)))
    return footprint


def _json(cluster: Cluster, path: str) -> dict | None:
    try:
        found = json.loads(cluster.runner.read_file(path))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _header(cluster: Cluster, path: str, name: str) -> dict | None:
    """A safetensors header, read with od and GNU dd where the file is (a few KB, never the weights); None where
    those tools fail (the engine reads the file itself at start-up)."""
    size = cluster.runner.run(["od", "-An", "-tu8", "-N8", path])
    if size.returncode != 0:
        return None
    length = int(size.stdout.strip()) if size.stdout.strip().isdigit() else -1
    if not 2 <= length <= MAX_HEADER_BYTES:
        raise UsageError(f"{name} is not a safetensors file (no header length)")
    raw = cluster.runner.run(["dd", f"if={path}", "bs=65536", "iflag=skip_bytes,count_bytes", "skip=8",
                              f"count={length}", "status=none"])
    if raw.returncode != 0:
        return None
    return parse_header(raw.stdout, name)


def _check_tokenizer(cluster: Cluster, source: str, draft: str, target: str) -> None:
    """A draft model must map tokens as the target does: equal tokenizer.json files, else equal vocabularies."""
    files = [f"{draft}/tokenizer.json", f"{target}/tokenizer.json"]
    sums = cluster.runner.run(["sha256sum", *files])
    digests = [line.split()[0] for line in sums.stdout.splitlines() if line.strip()]
    if sums.returncode == 0 and len(digests) == 2 and digests[0] == digests[1]:
        return
    try:
        draft_vocab, target_vocab = (tokenizer_vocab(cluster.runner.read_file(f)) for f in files)
    except (OSError, UnicodeDecodeError):
        return       # one of them has no tokenizer.json: the engine compares the loaded tokenizers at start-up
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        raise UsageError(f"--speculative-model {source} has another tokenizer than the model "
                         f"({_difference(draft_vocab, target_vocab)}): its drafts would be other tokens; use a "
                         "draft trained with the model's tokenizer")


def _difference(draft: tuple, target: tuple) -> str:
    if draft[0] != target[0]:
        return f"a {draft[0]} tokenizer, the model's is {target[0]}"
    if len(draft[1]) != len(target[1]):
        return f"{len(draft[1])} tokens in its vocabulary, the model has {len(target[1])}"
    if draft[1] != target[1]:
        return "the same number of tokens with other ids"
    return "other added or special tokens"
