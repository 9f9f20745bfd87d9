"""The simulated engine: a discrete-event simulator (`simulate`) that runs the same policy objects
as the real engine on a virtual clock, and an HTTP server (`backend.sim.server`) with the SGLang
surface on a real clock.

Public API (the bench runner is written against these names)::

    simulate(source, policy, latency, config, *, progress=None) -> SimResult
    SimRequest, ArrivalSource, ListSource, SimConfig
    SimResult, RequestRecord, IterationLog
    InfeasiblePlanError, StalledPolicyError
"""

from backend.sim.config import SimConfig
from backend.sim.core import InfeasiblePlanError
from backend.sim.engine import StalledPolicyError, simulate
from backend.sim.records import IterationLog, RequestRecord, SimResult
from backend.sim.source import ArrivalSource, ListSource, SimRequest

__all__ = [
    "ArrivalSource",
    "InfeasiblePlanError",
    "IterationLog",
    "ListSource",
    "RequestRecord",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "StalledPolicyError",
    "simulate",
]
