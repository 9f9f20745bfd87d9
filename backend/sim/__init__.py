"""The simulated engine: a discrete-event simulator (`simulate`) that runs the same policy objects
as the real engine on a virtual clock, and an HTTP server (`backend.sim.server`) with the SGLang
surface on a real clock.

What the bench runner uses, by the module that defines it (import each name from there)::

    engine   simulate(source, policy, latency, config, *, progress=None) -> SimResult,
             StalledPolicyError
    source   SimRequest, ArrivalSource, ListSource
    config   SimConfig
    records  SimResult, RequestRecord, IterationLog
    core     InfeasiblePlanError
"""
