"""`serve --model A --model B`: one job, one engine per model, and how the job's GPUs and CPUs are shared.

- At least one GPU per model: each engine gets its own GPUs (an equal slice of the job's CUDA_VISIBLE_DEVICES,
  tensor-parallel over them); fewer GPUs than models: every engine sees every GPU and gets a share of its
  memory (`--cuda-memory-fraction`, from the models' sizes unless given per model); no GPU: CPU engines, each
  with such a share of the node's memory for its KV cache.
- The CPU threads of the allocation are split between the engines (unless --engine-arg --cpu-threads).
- Ports are picked in the job: the job's port for the first model, then the next free ones.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from tgi_hpc.errors import UsageError
from tgi_hpc.profiles.schema import Resources
from tgi_hpc.slurm.jobspec import EngineSpec, LoraAdapter, ShellPath

logger = logging.getLogger(__name__)

FRACTION_FLAG = "--cuda-memory-fraction"
# Flags that must differ between the engines of one job, so one value for all of them cannot be right.
PER_ENGINE = {FRACTION_FLAG: "--cuda-memory-fraction F once per --model",
              "--served-model-name": "nothing: each engine is named after its --model",
              "--lora-adapters": "--lora NAME=ADAPTER (each goes to the model it was trained on)"}


@dataclass(frozen=True)
class ModelPlan:
    model: str                  # as the user gave it
    where: ShellPath            # its snapshot where the job runs
    size_b: float | None        # catalog size (billions at 2 bytes), None when unknown


def check_models(models: list[str]) -> None:
    seen = set()
    for model in models:
        if model in seen:
            raise UsageError(f"--model {model} is given twice: one engine per model (use --gpus for a bigger one)")
        seen.add(model)


def total_size(sizes: list[float | None]) -> float | None:
    """The job's size for the catalog: the models share it, so their sizes add up (unknown if one is)."""
    return None if any(s is None for s in sizes) else sum(sizes)   # type: ignore[arg-type]


def fraction_args(fractions: list[float]) -> list[str]:
    """One model: --cuda-memory-fraction F goes to its engine as is."""
    if len(fractions) > 1:
        raise UsageError(f"{len(fractions)} --cuda-memory-fraction values for one --model: give one per model")
    _check_fractions(fractions)
    return [FRACTION_FLAG, _fmt(fractions[0])] if fractions else []


def _check_fractions(fractions: list[float]) -> None:
    for f in fractions:
        if not 0 < f <= 1:
            raise UsageError(f"--cuda-memory-fraction {f}: expected a share of the GPU's memory in (0, 1]")


def _fmt(fraction: float) -> str:
    return f"{fraction:.2f}".rstrip("0").rstrip(".")


def memory_shares(plans: list[ModelPlan], given: list[float]) -> list[float]:
    """Shares of every GPU's memory for engines that share the GPUs: given, else by size (equal if unknown),
    rounded down to hundredths so that they never add up to more than the whole."""
    if given:
        if len(given) != len(plans):
            raise UsageError(f"{len(given)} --cuda-memory-fraction values for {len(plans)} models: give one per model")
        _check_fractions(given)
        if sum(given) > 1 + 1e-9:
            raise UsageError(f"the engines share the GPUs, so their --cuda-memory-fraction values must add up to "
                             f"at most 1, not {sum(given):g}")
        return list(given)
    sizes = [p.size_b for p in plans]
    weights = [1.0] * len(plans) if any(not s for s in sizes) else sizes
    return [max(0.01, math.floor(100 * w / sum(weights)) / 100) for w in weights]   # type: ignore[operator]


def gpu_slices(gpus: int, count: int) -> list[tuple[tuple[int, int] | None, int]]:
    """(slice of the job's GPUs or None for all of them, tensor-parallel shards) for each of `count` engines."""
    if gpus >= count:
        each = gpus // count
        if gpus % count:
            logger.warning("%d GPUs for %d models: each engine gets %d, %d stay unused", gpus, count, each,
                           gpus % count)
        return [((i * each, each), each) for i in range(count)]
    return [(None, max(1, gpus))] * count


def _refuse_shared_flags(args: tuple[str, ...]) -> None:
    for flag, instead in PER_ENGINE.items():
        if flag in args:
            raise UsageError(f"--engine-arg {flag} would be the same for every model's engine; use {instead}")


def plan_engines(plans: list[ModelPlan], loras: list[tuple[LoraAdapter, ...]], resources: Resources,
                 args: tuple[str, ...], fractions: list[float]) -> tuple[EngineSpec, ...]:
    """One EngineSpec per model, with its GPUs or memory share, CPU threads and adapters."""
    _refuse_shared_flags(args)
    gpus = resources.gpus or 0
    slices = gpu_slices(gpus, len(plans))
    shared = gpus > 0 and slices[0][0] is None
    # CPU engines share the node's memory too: each sizes its KV cache from its part (engine/host_memory.py)
    shares = memory_shares(plans, fractions) if shared or fractions or (gpus == 0 and len(plans) > 1) else []
    threads = []
    if "--cpu-threads" not in args and resources.cpus_per_task:
        threads = ["--cpu-threads", str(max(1, resources.cpus_per_task // len(plans)))]
    engines = []
    for i, (plan, (gpu_slice, shards)) in enumerate(zip(plans, slices)):
        own = [FRACTION_FLAG, _fmt(shares[i])] if shares else []
        engines.append(EngineSpec(plan.model, plan.where, shards, gpu_slice, (*args, *own, *threads), loras[i]))
    if shared:
        logger.info("%d models share %d GPU(s): memory fractions %s", len(plans), gpus, ", ".join(map(_fmt, shares)))
    return tuple(engines)
