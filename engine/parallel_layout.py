"""ParallelLayout: where one process sits in the engine's ranks (tensor x pipeline), and which layers it holds.

Ranks are numbered stage-major: rank = stage * tp_size + tp_rank. With `srun`'s default block distribution
(consecutive task ids on one node) a stage is a node, so tensor parallelism stays inside a node and only
the pipeline's hidden states cross the network. `from_env` reads the ranks an external launcher gave this
process: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else srun's SLURM_PROCID / SLURM_STEP_NUM_TASKS
(SLURM_NTASKS) / SLURM_LOCALID.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    rank: int
    tp_size: int
    pp_size: int = 1
    local_rank: int = 0            # which GPU of its node this process uses

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"tensor ({self.tp_size}) and pipeline ({self.pp_size}) sizes must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the {self.world_size} ranks "
                             f"({self.pp_size} stages x {self.tp_size} shards)")

    @classmethod
    def single_node(cls, rank: int, num_shard: int) -> ParallelLayout:
        """The spawned tensor-parallel ranks of one engine process tree (GPU = rank)."""
        return cls(rank=rank, tp_size=num_shard, pp_size=1, local_rank=rank)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    @property
    def prev_rank(self) -> int:
        """The same tensor rank one stage up (it sends this rank its hidden states)."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def logits_rank(self) -> int:
        """The rank that holds the gathered logits: tensor rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def layer_range(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.pp_size, self.stage)


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """Layers of `stage`: an even split, the first `num_layers % pp_size` stages taking one more."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def from_env(env: Mapping[str, str], tp_size: int, pp_size: int) -> ParallelLayout | None:
    """This process's place among ranks started by srun or torchrun; None when it is the only one.

    The launcher's world size must equal tp_size * pp_size (one process per GPU): anything else would
    leave ranks waiting for peers that never come.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS",
                 "SLURM_LOCALID")
    else:
        names = None
    world = _int(env, names[1]) if names else 1
    if world <= 1:
        if pp_size > 1:
            raise ValueError(f"--pipeline-parallel-size {pp_size} needs one process per GPU started by srun or "
                             "torchrun (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS in the environment)")
        return None
    if world != tp_size * pp_size:
        raise ValueError(f"{names[1]}={world} processes, but --num-shard {tp_size} x --pipeline-parallel-size "
                         f"{pp_size} = {tp_size * pp_size} ranks: start one process per GPU, or fix the sizes")
    local = _int(env, names[2]) if names[2] in env else 0
    return ParallelLayout(rank=_int(env, names[0]), tp_size=tp_size, pp_size=pp_size, local_rank=local)
