"""Tensor-parallel process group helpers; rank 0 / size 1 when no group was initialised.

The group is module state set by `init_tensor_parallel`, not torch's default-group check, so a
single-rank runner works in a process where somebody else initialised torch.distributed.
"""
from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_group_initialised = False


def tp_rank() -> int:
    return dist.get_rank() if _group_initialised else 0


def tp_size() -> int:
    return dist.get_world_size() if _group_initialised else 1


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
    global _group_initialised
    if world_size == 1:
        return
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: run one "
                           "tensor-parallel engine per process, or close() the previous one first")
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _group_initialised = True


def destroy_tensor_parallel() -> None:
    global _group_initialised
    if _group_initialised and dist.is_initialized():
        dist.destroy_process_group()
    _group_initialised = False


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; a no-op on one rank."""
    if tp_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def all_reduce_min(value: int, device: torch.device) -> int:
    if tp_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `tensor` along the last dim on rank 0; None on other ranks."""
    if tp_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(tensor, parts, dst=0)
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
