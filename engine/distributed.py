"""Process group helpers; rank 0 / size 1 when no group was initialised.

The groups are module state set by `init_parallel`, not torch's default-group check, so a
single-rank runner works in a process where somebody else initialised torch.distributed.
Tensor-parallel collectives (`all_reduce`, `gather_to_rank0`) run in this rank's tensor group (its
pipeline stage); `all_reduce_min` agrees over every rank; the pipeline's point-to-point sends use
global ranks (engine/pipeline.py).
"""
from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel_layout import ParallelLayout

logger = logging.getLogger(__name__)

_group_initialised = False
_tp_group: dist.ProcessGroup | None = None    # None with one tensor rank per stage
_tp_ranks: list[int] = [0]
_layout = ParallelLayout(0, 1)


def tp_rank() -> int:
    return _layout.tp_rank


def tp_size() -> int:
    return _layout.tp_size


def layout() -> ParallelLayout:
    """This process's place among the ranks (a single rank when nothing was initialised)."""
    return _layout


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def create_store(host: str, port: int, world_size: int, is_master: bool,
                 timeout_s: float = 300.0) -> dist.TCPStore:
    """Rendezvous store. The master binds `port` (0 = any free port, read back from `.port`)."""
    return dist.TCPStore(host, port, world_size, is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_tensor_parallel(rank: int, world_size: int, store: dist.Store, device: torch.device,
                         timeout_s: float = 300.0) -> None:
    """Join the engine's process group (one per process; every rank calls this)."""
    init_parallel(ParallelLayout.single_node(rank, world_size), store, device, timeout_s)


def init_parallel(parallel: ParallelLayout, store: dist.Store | None, device: torch.device,
                  timeout_s: float = 300.0) -> None:
    """Join the world group, then every stage's tensor group (all ranks create all groups, in order)."""
    global _group_initialised, _tp_group, _tp_ranks, _layout
    if parallel.world_size == 1:
        return
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: run one "
                           "tensor-parallel engine per process, or close() the previous one first")
    # NCCL bound to this rank's GPU up front: communicators are created eagerly on the right device (not
    # guessed from the current device at the first collective), and none is made for a device it never uses
    bound = {"device_id": torch.device("cuda", device.index if device.index is not None
                                       else torch.cuda.current_device())} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device), store=store, rank=parallel.rank, world_size=parallel.world_size,
                            timeout=timedelta(seconds=timeout_s), **bound)
    _group_initialised, _layout = True, parallel
    _tp_ranks = parallel.stage_ranks(parallel.stage)
    if parallel.pp_size == 1:
        _tp_group = dist.group.WORLD
    elif parallel.tp_size > 1:
        for stage in range(parallel.pp_size):
            group = dist.new_group(parallel.stage_ranks(stage))
            if stage == parallel.stage:
                _tp_group = group


def destroy_tensor_parallel() -> None:
    global _group_initialised, _tp_group, _tp_ranks, _layout
    if _group_initialised and dist.is_initialized():
        dist.destroy_process_group()
    _group_initialised, _tp_group, _tp_ranks, _layout = False, None, [0], ParallelLayout(0, 1)


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over this stage's tensor ranks, in place; a no-op on one rank."""
    if tp_size() > 1:
        dist.all_reduce(tensor, group=_tp_group)
    return tensor


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over every rank of every stage (KV blocks, kernel checks: all must agree)."""
    if not _group_initialised:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """The stage's tensor rank 0's `tensor` on every tensor rank, in place; a no-op on one rank."""
    if tp_size() > 1:
        dist.broadcast(tensor, src=_tp_ranks[0], group=_tp_group)
    return tensor


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """Concatenate the stage's tensor ranks' `tensor` along the last dim on its tensor rank 0; None elsewhere."""
    if tp_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(tensor, parts, dst=_tp_ranks[0], group=_tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def is_port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pick_master_port(host: str, preferred: int) -> int:
    """The configured port if nobody holds it, else 0 (the store then binds any free port),
    so two engines on one node never collide."""
    if preferred and is_port_free(host, preferred):
        return preferred
    if preferred:
        logger.info("master port %d is busy on %s; binding a free one", preferred, host)
    return 0
