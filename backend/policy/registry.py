"""Policy names → policy objects (the names of API.md): `tandem`, its ablations
`tandem-no-<part>` (one concept switched off each), and the baselines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.policy.baselines.fcfs import FcfsPolicy
from backend.policy.baselines.oracle import OraclePolicy
from backend.policy.baselines.rr import RoundRobinPolicy
from backend.policy.baselines.sglang_like import SglangLikePolicy
from backend.policy.baselines.two_phase import FixedOfflinePolicy, StaticChunkPolicy
from backend.policy.latency import LatencyModel
from backend.policy.tandem import TandemPolicy
from backend.policy.types import Policy


def _sglang(name: str, reserve: str, preemption: bool) -> Callable[..., Policy]:
    def make(latency: LatencyModel, **options: Any) -> Policy:
        options.setdefault("reserve", reserve)
        options.setdefault("priority_preemption", preemption)
        policy = SglangLikePolicy(latency, **options)
        policy.name = name
        return policy

    return make


def _tandem(name: str, **switches: bool) -> Callable[..., Policy]:
    def make(latency: LatencyModel, **options: Any) -> Policy:
        policy = TandemPolicy(latency, **{**switches, **options})
        policy.name = name
        return policy

    return make


TANDEM_ABLATIONS = {
    "tandem-no-pastfuture": "use_pastfuture",
    "tandem-no-slack": "use_slack",
    "tandem-no-aimd": "use_aimd",
    "tandem-no-era": "use_era",
}
"""Ablation name → the TandemConfig switch it turns off."""


def _rt_only(latency: LatencyModel, **options: Any) -> Policy:
    return FcfsPolicy(latency, rt_only=True, **options)


_FACTORIES: dict[str, Callable[..., Policy]] = {
    "fcfs": FcfsPolicy,
    "priority": _sglang("priority", "ratio", True),
    "rr": RoundRobinPolicy,
    "aggressive": _sglang("aggressive", "none", False),
    "conservative": _sglang("conservative", "full", False),
    "fixed-offline": FixedOfflinePolicy,
    "static-chunk": StaticChunkPolicy,
    "oracle": OraclePolicy,
    "rt-only": _rt_only,
    "tandem": _tandem("tandem"),
    **{name: _tandem(name, **{switch: False}) for name, switch in TANDEM_ABLATIONS.items()},
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
"""Every name `make_policy` accepts."""


def make_policy(name: str, latency: LatencyModel, **options: Any) -> Policy:
    """A fresh policy object by name; `options` go to its constructor (e.g. token_budget).
    Raises ValueError for an unknown name or option."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    try:
        return factory(latency, **options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from None
