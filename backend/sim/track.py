"""The engine core's records: `Track` (its private bookkeeping of one request) and `Batch` (what
`EngineCore.apply` started). Both are plain objects with `__slots__`: the simulator builds and
reads them once per request and per iteration."""

from __future__ import annotations

from array import array

from backend.policy.latency import BatchShape
from backend.policy.types import Plan, ReqState
from backend.sim.source import SimRequest


class Track:
    """Engine-private bookkeeping of one request (the policy sees only `state`)."""

    __slots__ = (
        "admitted_s",
        "finish_s",
        "first_cached",
        "keys",
        "pinned",
        "private",
        "req",
        "state",
        "target",
        "times",
        "usable_blocks",
    )

    def __init__(self, req: SimRequest, state: ReqState, usable_blocks: int) -> None:
        self.req = req
        self.state = state
        self.target = max(1, min(req.output_len, req.max_new_tokens))
        """Tokens it generates before it finishes."""
        self.times: array[float] = array("d")
        """Emission time of every token."""
        self.private = 0
        """Private KV tokens (not in pinned blocks)."""
        self.pinned: list[int] = []
        """Hashes of the leading prefix blocks it references."""
        self.usable_blocks = usable_blocks
        """Full prompt blocks that carry a hash (cacheable)."""
        self.keys = _chain(req.prefix_hashes[:usable_blocks])
        """Cache keys of those blocks: key i names the whole prefix up to block i, so equal keys
        mean equal prefixes even when the workload's hashes are not chained."""
        self.first_cached: int | None = None
        """Prompt tokens served from the cache at its first admission."""
        self.admitted_s: float | None = None
        self.finish_s: float | None = None


class Batch:
    """What `apply` decided to run: the tracks involved and the shape to time."""

    __slots__ = ("decodes", "num_evictions", "plan", "prefills", "shape", "start_s")

    def __init__(
        self,
        plan: Plan,
        start_s: float,
        decodes: list[Track],
        prefills: list[tuple[Track, int]],
        shape: BatchShape,
        num_evictions: int,
    ) -> None:
        self.plan = plan
        self.start_s = start_s
        self.decodes = decodes
        self.prefills = prefills
        self.shape = shape
        self.num_evictions = num_evictions


def _chain(hashes: tuple[int, ...]) -> tuple[int, ...]:
    keys: list[int] = []
    key = 0
    for h in hashes:
        key = hash((key, h))
        keys.append(key)
    return tuple(keys)
