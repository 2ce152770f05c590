"""The port convention users know: 10000 + the last 4 digits of the job id."""
from __future__ import annotations

import socket


def port_for_job(job_id: str | int, base: int = 10000) -> int:
    digits = "".join(ch for ch in str(job_id).split("_")[0] if ch.isdigit())
    if not digits:
        raise ValueError(f"job id {job_id!r} has no digits")
    return base + int(digits[-4:])


def is_port_free(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do: a port whose old connections linger in TIME_WAIT (a requeued job's
        # previous run) is free to listen on again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(job_id: str | int, base: int = 10000, exclude: set[int] = frozenset(), attempts: int = 200) -> int:
    """The job's port, or the next free one after it: deterministic, so a rerun lands in the same place."""
    first = port_for_job(job_id, base)
    for port in range(first, first + attempts):
        if port not in exclude and port < 65536 and is_port_free(port):
            return port
    raise RuntimeError(f"no free port in {first}..{first + attempts - 1}")
