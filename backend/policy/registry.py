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
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.tandem.presets import tolerance_5pct
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
    "tandem-tol5": tolerance_5pct,
}


def _kv_layout(make: Callable[..., Policy], name: str, layout: str) -> Callable[..., Policy]:
    """`make` whose policy asks the engine for a KV layout (`kv_layout` attribute, read by the
    bench runner: "bicache" = BROS's bidirectional blocks with lazy checkpointing, "token" =
    SGLang's token pool with recompute)."""

    def made(latency: LatencyModel, **options: Any) -> Policy:
        policy = make(latency, **options)
        policy.name = name
        policy.kv_layout = layout  # type: ignore[attr-defined]
        return policy

    return made


TANDEM_KV_LAYOUT = "token"
"""The config switch of the bicache layout for `tandem` (bench/results/W1-bicache/README.md says
why it is off); `tandem-bicache` and `tandem-no-bicache` pin it either way."""
_FACTORIES["tandem"] = _kv_layout(_FACTORIES["tandem"], "tandem", TANDEM_KV_LAYOUT)
_FACTORIES["tandem-bicache"] = _kv_layout(_tandem("tandem-bicache"), "tandem-bicache", "bicache")
_FACTORIES["tandem-no-bicache"] = _kv_layout(
    _tandem("tandem-no-bicache"), "tandem-no-bicache", "token"
)

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
