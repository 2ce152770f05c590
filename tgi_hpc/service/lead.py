"""How early a successor must be submitted: the observed queue wait plus load time, with a floor."""
from __future__ import annotations

from dataclasses import dataclass

from tgi_hpc.errors import UsageError

RECENT = 3   # the worst of the last few observations: one lucky fast start must not shrink the lead


def lead_time(queue_waits: list[float], load_times: list[float], floor_s: float,
              explicit_s: float | None = None) -> float:
    """Seconds before the predecessor's end at which its successor becomes eligible to start."""
    if explicit_s is not None:
        return float(explicit_s)
    queue = max(queue_waits[-RECENT:], default=0.0)
    load = max(load_times[-RECENT:], default=0.0)
    return max(float(floor_s), queue + load)


def check_lead(lead_s: float, time_limit_s: int) -> None:
    """At serve time: a lead of a whole job (or more) would start each successor as soon as its
    predecessor does, doubling the allocation for nothing."""
    if lead_s <= 0:
        raise UsageError(f"--handover {lead_s:g} s: the lead must be positive")
    if lead_s >= time_limit_s:
        raise UsageError(f"--handover {lead_s:g} s is not shorter than the job's time limit ({time_limit_s} s): "
                         "give a shorter lead or a longer --time")


@dataclass(frozen=True)
class Plan:
    """When the successor may start, seen from the predecessor: `delay_s` from now (0 = at once)."""

    lead_s: float
    delay_s: float
    late: bool         # the lead is longer than what is left: start the successor at once


def plan(ends_at: float, now: float, lead_s: float) -> Plan:
    remaining = ends_at - now
    delay = remaining - lead_s
    return Plan(lead_s, max(0.0, delay), delay < 0)
