"""Liveness of the tensor-parallel ranks an engine spawned itself (engine/model_runner.py).

Each worker writes time.monotonic() (one clock for every process of a node) into its slot of a shared array
from a thread. The thread stops when the process dies, is stopped (SIGSTOP) or wedges holding the GIL, so a
stale beat says the rank is gone even while rank 0 waits for it in a collective. A step that outlasts
`step_timeout_s` while every rank still beats is hung too (a worker stuck in Python code, or NCCL waiting for
a collective that never comes). Either way the engine must stop, not serve 503s until its time limit.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

HEARTBEAT_S = 0.5


def start_heartbeat(beats: Any, rank: int) -> None:
    """beats[rank] = time.monotonic() every HEARTBEAT_S, from a daemon thread of this process."""
    def loop() -> None:
        while True:
            beats[rank] = time.monotonic()
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=loop, name=f"tgi-engine-heartbeat{rank}", daemon=True).start()


@dataclass(slots=True, frozen=True)
class RankState:
    rank: int
    alive: bool
    exit_code: int | None
    last_beat: float        # time.monotonic() of its last heartbeat; 0 = none yet


def stall_reason(now: float, ranks: list[RankState], step_started: float | None,
                 rank_timeout_s: float, step_timeout_s: float) -> str | None:
    """Why the ranks cannot go on (a dead rank, a silent rank, a hung step), or None while they are fine."""
    for state in ranks:
        if not state.alive:
            return f"tensor-parallel rank {state.rank} died (exit code {state.exit_code})"
    for state in ranks:
        if state.last_beat and now - state.last_beat > rank_timeout_s:
            return (f"tensor-parallel rank {state.rank} sent no heartbeat for {now - state.last_beat:.0f} s "
                    f"(--rank-timeout {rank_timeout_s:g}): stopped, or wedged")
    if step_started is not None and now - step_started > step_timeout_s:
        return (f"a tensor-parallel step has run for {now - step_started:.0f} s (--step-timeout "
                f"{step_timeout_s:g}): a rank is hung in a collective")
    return None
