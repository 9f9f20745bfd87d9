"""Placement: which engine replica runs a request — the routers of a pool (the gateway's place
stage, gateway/pipeline/placement.py, and the simulator's pool, backend/sim/pool.py, run this
same code).

A router sees each replica as its last live-state report (`common.wire.EngineLoad`, one per
iteration) plus what was sent to it since (`Backlog`: RT work the report cannot show yet), and
remembers what it placed itself: the tokens sent to each replica since its last report (so a
burst of arrivals between two reports does not all land on the replica that looked emptiest)
and which replica's prefix cache holds which prompt prefix (`PrefixTracker`).

Routers (`ROUTERS`, `make_router`):

    slo          RT with a TTFT target: the replica where the calibrated latency model
                 (`SloForecaster`, the SLO admission's forecast) predicts the most slack
                 against the request's contract — relative slack, min over TTFT and TPOT —
                 with its cached prefix taken off the prompt; the one replica holding the
                 request's longest cached prefix is kept when its forecast meets the contract
                 (a conversation's turns stay together) — a prefix several replicas hold (a
                 system prompt every request starts with) binds the request to none of them;
                 an idle replica whose calibration is not verified yet is forecast at its
                 profile's pace. When no replica is predicted to meet it, the decision says
                 so (`PlaceDecision.unattainable`): the admission applies the tenant's
                 outcome.
                 BE, batch lines and RT without a target: the replica with the most leftover
                 capacity (KV not used or claimed by waiting prompts), kept on the replica
                 holding the prompt's prefix (a batch's groups) unless that replica is
                 overloaded (below).
    round-robin  replicas in turn.
    least-load   fewest running + waiting tokens (context of the decoding requests, prompt
                 tokens not computed yet, and tokens sent since the report).
    prefix       cache-aware, as the SGLang model gateway's: when the pool is imbalanced
                 (max − min load > `imbalance_tokens` and max > `imbalance_ratio` × min) the
                 least loaded replica; otherwise the replica with the longest prefix match when
                 it covers at least `cache_threshold` of the prompt, else the least loaded.

Cost: the slo router forecasts at most `forecast_candidates` replicas per RT request — those
with the least RT prompt work ahead (the forecast's dominant term), plus the one holding the
prefix — so a decision stays within about 100 µs at 64 replicas (bench/studies/placement_cost.py);
every other measure is a few integer sums per replica.

Pure: no I/O, no clock. Routers are stateful objects (their memory of what they placed), one per
pool; `choose` records the placement it returns.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from backend.policy.feasibility import (
    MIN_VERIFIED_ITERATIONS,
    NO_BACKLOG,
    Backlog,
    Forecast,
    SloAsk,
    SloForecaster,
    idle,
)
from common.wire import EngineLoad, Tier

ROUTERS = ("slo", "round-robin", "least-load", "prefix")
"""Router names (`--routers`, the gateway's `gateway.router`)."""
CLAIM_HELD_FRAC = 0.9
"""A prefix-memory claim holds when the engine found at least this share of it cached (its
count ends on its own page and block boundaries)."""
CACHE_SHARE_CUT = 0.7
CACHE_SHARE_STEP = 0.02
CACHE_SHARE_MIN = 0.05
"""The slo router's prefix memory spans `SloAware.cache_share` of the replicas' KV pools: cut
to CACHE_SHARE_CUT × itself when an engine held less than it claimed, raised by
CACHE_SHARE_STEP when a claim held, never below CACHE_SHARE_MIN."""
TRACKER_BOUND_EVERY = 256
"""The slo router sums its replicas' KV sizes (its prefix memory's bound) at least this often,
in decisions."""


class Replica(msgspec.Struct, frozen=True):
    """What a router sees of one replica."""

    name: str
    """Stable name (its URL; the simulator's index): the router's memory is keyed by it."""
    load: EngineLoad | None
    """Its last live-state report; None: none yet, or a stock engine that reports none (it
    counts as empty but for what was sent to it)."""
    backlog: Backlog = NO_BACKLOG
    """RT work sent to it that `load` does not show yet (the gateway's `LoadWatcher.backlog`)."""
    ttft_extra_s: float = 0.0
    """What admitted requests' first tokens on it taught its TTFT forecast (the gateway's
    `TtftFeedback.extra_s` for this replica): time its engine model does not see — its HTTP
    server and tokenizer, its host's CPU taken by a neighbour — seconds."""
    slot_wait_scale: float = 1.0
    """How much shorter its request slots' waits came out than forecast (the gateway's
    `TtftFeedback.slot_wait_scale` for this replica; 1: as forecast)."""


class PlaceAsk(msgspec.Struct, frozen=True):
    """One request, as placement sees it."""

    tier: Tier
    prompt_tokens: int
    prefix_keys: tuple[int, ...] = ()
    """Chained keys of the prompt's full cache blocks (`prefix_keys`): key i names the whole
    prefix up to block i, so equal keys are equal prefixes."""
    block_tokens: int = 64
    """Tokens per block of `prefix_keys`."""
    slo: SloAsk | None = None
    """RT with a TTFT target: its contract (the slo router forecasts it); None otherwise."""


class PlaceDecision(msgspec.Struct, frozen=True):
    """Where a request goes, and what the forecast said there."""

    index: int
    """Index of the chosen replica in the list given to `choose`."""
    forecast: Forecast | None = None
    """The slo router's forecast of an RT request on the chosen replica (None: not forecast)."""
    cached_tokens: int = 0
    """Prompt tokens that forecast took as held by the chosen replica's prefix cache (its
    prefix memory's claim; `SloAware.observe_cached` checks it against the engine's count)."""

    @property
    def unattainable(self) -> bool:
        """No replica was predicted to meet the request's contract (the chosen one is the
        closest): the admission applies the tenant's outcome (shed, downgrade, accept)."""
        return self.forecast is not None and not self.forecast.feasible


class Router(Protocol):
    """A placement policy."""

    name: str
    forecasts: bool
    """True when it forecasts an RT request's contract with the prefix its replica's cache holds
    taken off the prompt: then even one replica is placed through it (the forecast is the SLO
    admission's, and its memory of prefixes must see every request)."""

    def choose(self, ask: PlaceAsk, replicas: Sequence[Replica]) -> PlaceDecision:
        """The replica to run *ask* on, among *replicas* (at least one); records the placement."""
        ...

    def observe_cached(self, claimed_tokens: int, engine_cached_tokens: int) -> None:
        """A request placed with *claimed_tokens* of its prompt taken as cached (its
        `PlaceDecision.cached_tokens`) found *engine_cached_tokens* in the engine's prefix
        cache (the engine's count, once it computed the prompt)."""
        ...

    def forecast_alone(self, ask: PlaceAsk, replica: Replica) -> PlaceDecision:
        """*ask* on the one replica there is (index 0): its forecast (a router that
        forecasts), recording nothing — with one replica the memory steers no choice, so the
        caller records the prompt when it has run (`remember`), off the admission's path."""
        ...

    def remember(self, name: str, prefix_keys: Sequence[int]) -> None:
        """Replica *name* computed a prompt with these blocks: its cache holds them now."""
        ...


def prefix_keys(blocks: Iterable[Sequence[int] | int]) -> tuple[int, ...]:
    """Chained keys of a prompt's blocks (each block a token tuple, or a block hash): key i
    hashes key i−1 with block i, so it names the whole prefix up to block i. The simulator's
    prefix cache chains its blocks the same way (backend/sim/track.py)."""
    keys: list[int] = []
    key = 0
    for block in blocks:
        key = hash((key, block if isinstance(block, int) else tuple(block)))
        keys.append(key)
    return tuple(keys)


def token_prefix_keys(tokens: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """`prefix_keys` of a token sequence's full blocks of *block_tokens* (the gateway's view of
    a prompt: the engine's radix cache matches tokens)."""
    # `prefix_keys` unrolled for token blocks: the gateway keys every prompt it places
    keys: list[int] = []
    key = 0
    for start in range(0, len(tokens) // block_tokens * block_tokens, block_tokens):
        key = hash((key, tuple(tokens[start : start + block_tokens])))
        keys.append(key)
    return tuple(keys)


class PrefixTracker:
    """Which replicas were sent which prompt prefixes: an approximation of their prefix caches
    (the engines evict under pressure; the tracker forgets the least recently used keys past
    `max_keys`)."""

    def __init__(self, max_keys: int = 1 << 17) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be ≥ 1, got {max_keys}")
        self.max_keys = max_keys
        self._owners: OrderedDict[int, set[str]] = OrderedDict()

    def match(self, keys: Sequence[int]) -> tuple[str, int] | None:
        """(replica, blocks) of the longest prefix of *keys* a replica holds (the first name
        among equals); None when no replica holds the first block."""
        depth, holders = self.deepest(keys)
        return (min(holders), depth) if depth else None

    def deepest(self, keys: Sequence[int]) -> tuple[int, frozenset[str]]:
        """(blocks, holders) of the longest prefix of *keys* any replica holds: every replica
        holding all of it (empty, 0 when none holds the first block)."""
        depth, last = 0, None
        owners = self._owners
        for key in keys:
            found = owners.get(key)
            if not found:
                break
            depth, last = depth + 1, found
        return depth, frozenset(last or ())

    def depth_on(self, name: str, keys: Sequence[int]) -> int:
        """Blocks of *keys* replica *name* holds (its prefix match)."""
        depth = 0
        for key in keys:
            holders = self._owners.get(key)
            if holders is None or name not in holders:
                break
            depth += 1
        return depth

    def record(self, name: str, keys: Sequence[int]) -> None:
        """Replica *name* was sent a prompt with these blocks: its cache will hold them."""
        owners = self._owners
        for key in keys:
            holders = owners.get(key)
            if holders is None:
                owners[key] = {name}
            else:
                holders.add(name)
                owners.move_to_end(key)
        while len(owners) > self.max_keys:
            owners.popitem(last=False)

    def forget(self, name: str) -> None:
        """Replica *name* lost its cache (restarted, or left the pool)."""
        for key in [k for k, holders in self._owners.items() if name in holders]:
            holders = self._owners[key]
            holders.discard(name)
            if not holders:
                del self._owners[key]


class _Sent:
    """Tokens sent to each replica since its last report (cleared when a newer one arrives)."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[int, int]] = {}  # name → (report's iteration, tokens)

    def tokens(self, replica: Replica) -> int:
        seen = self._by_name.get(replica.name)
        if seen is None:
            return 0
        iteration = replica.load.iteration if replica.load is not None else -1
        return seen[1] if seen[0] == iteration else 0

    def add(self, replica: Replica, tokens: int) -> None:
        iteration = replica.load.iteration if replica.load is not None else -1
        self._by_name[replica.name] = (iteration, self.tokens(replica) + tokens)


def load_tokens(load: EngineLoad | None) -> int:
    """Running + waiting tokens of a report: the decoding requests' context and the prompt
    tokens not computed yet, both tiers."""
    if load is None:
        return 0
    return (
        load.rt_context_tokens
        + load.rt_waiting_prompt_tokens
        + load.be_context_tokens
        + load.be_waiting_prompt_tokens
    )


def leftover_tokens(load: EngineLoad | None) -> int:
    """KV a replica has left for more work: capacity less what is used and what its waiting
    prompts will claim (may be < 0: over-committed). A replica without a report counts as
    empty with a nominal pool of 1 M tokens."""
    if load is None:
        return 1 << 20
    return (
        load.kv_capacity_tokens
        - load.kv_used_tokens
        - load.rt_waiting_prompt_tokens
        - load.be_waiting_prompt_tokens
    )


class _NoForecast:
    """A router that forecasts nothing: the `Router` calls only a forecasting one needs."""

    forecasts = False

    def observe_cached(self, claimed_tokens: int, engine_cached_tokens: int) -> None:
        pass  # no forecast rests on its prefix memory

    def forecast_alone(self, ask: PlaceAsk, replica: Replica) -> PlaceDecision:
        return PlaceDecision(0)  # it forecasts nothing

    def remember(self, name: str, prefix_keys: Sequence[int]) -> None:
        pass  # its memory is kept by `choose`


class RoundRobin(_NoForecast):
    """Replicas in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, ask: PlaceAsk, replicas: Sequence[Replica]) -> PlaceDecision:
        _check(replicas)
        return PlaceDecision(next(self._turn) % len(replicas))


class LeastLoad(_NoForecast):
    """Fewest running + waiting tokens, tokens sent since the report included."""

    name = "least-load"

    def __init__(self) -> None:
        self._sent = _Sent()

    def choose(self, ask: PlaceAsk, replicas: Sequence[Replica]) -> PlaceDecision:
        _check(replicas)
        sent = self._sent
        loads = [load_tokens(r.load) + sent.tokens(r) for r in replicas]
        index = loads.index(min(loads))
        sent.add(replicas[index], ask.prompt_tokens)
        return PlaceDecision(index)


class PrefixAware(_NoForecast):
    """Cache-aware (the SGLang model gateway's policy, on tokens): least load when the pool is
    imbalanced, else the longest prefix match if it covers `cache_threshold` of the prompt,
    else least load."""

    name = "prefix"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        imbalance_tokens: int = 8192,
        imbalance_ratio: float = 1.5,
        tracker: PrefixTracker | None = None,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if imbalance_tokens < 0 or imbalance_ratio < 1.0:
            raise ValueError("need imbalance_tokens ≥ 0 and imbalance_ratio ≥ 1")
        self.cache_threshold = cache_threshold
        """Share of the prompt's blocks a match must cover to place by it."""
        self.imbalance_tokens = imbalance_tokens
        """Load gap (tokens) past which the pool counts as imbalanced (with the ratio)."""
        self.imbalance_ratio = imbalance_ratio
        """Load ratio max ÷ min past which the pool counts as imbalanced (with the gap)."""
        self.tracker = tracker or PrefixTracker()
        self._sent = _Sent()

    def choose(self, ask: PlaceAsk, replicas: Sequence[Replica]) -> PlaceDecision:
        _check(replicas)
        sent = self._sent
        loads = [load_tokens(r.load) + sent.tokens(r) for r in replicas]
        low, high = min(loads), max(loads)
        index = loads.index(low)
        imbalanced = high - low > self.imbalance_tokens and high > self.imbalance_ratio * low
        if not imbalanced and ask.prefix_keys:
            hit = _match_among(self.tracker, ask.prefix_keys, replicas)
            if hit is not None and hit[1] >= self.cache_threshold * len(ask.prefix_keys):
                index = hit[0]
        chosen = replicas[index]
        sent.add(chosen, ask.prompt_tokens)
        self.tracker.record(chosen.name, ask.prefix_keys)
        return PlaceDecision(index)


class SloAware:
    """RT to the most slack against its contract; the rest to the most leftover capacity,
    prefixes kept together (the module doc)."""

    name = "slo"
    forecasts = True

    def __init__(
        self,
        forecaster: SloForecaster,
        *,
        forecast_candidates: int = 3,
        imbalance_tokens: int = 8192,
        tracker: PrefixTracker | None = None,
    ) -> None:
        if forecast_candidates < 1:
            raise ValueError(f"forecast_candidates must be ≥ 1, got {forecast_candidates}")
        self.forecaster = forecaster
        self.forecast_candidates = forecast_candidates
        """Replicas forecast per RT request (those with the least RT work ahead)."""
        self.imbalance_tokens = imbalance_tokens
        """BE: leftover capacity (tokens) the prefix-holding replica may lag the best one by
        and still be chosen."""
        self.tracker = tracker or PrefixTracker()
        self._sent = _Sent()
        self._decisions = 0
        self._bound_replicas = 0  # replicas when the tracker's bound was last summed
        self._bound_keys = 0  # the pools' KV in blocks, when last summed
        self.cache_share = 1.0
        """The share of the replicas' KV pools their prefix caches are taken to keep: lowered
        when an engine held less of a prompt than the memory claimed (`observe_cached`),
        raised back slowly while its claims hold."""

    def choose(self, ask: PlaceAsk, replicas: Sequence[Replica]) -> PlaceDecision:
        _check(replicas)
        self._bound_tracker(replicas, ask.block_tokens)
        if ask.slo is not None:
            decision = self._place_rt(ask, ask.slo, replicas)
        else:
            hit = _match_among(self.tracker, ask.prefix_keys, replicas) if ask.prefix_keys else None
            decision = PlaceDecision(self._place_be(ask, replicas, hit))
        chosen = replicas[decision.index]
        self._sent.add(chosen, ask.prompt_tokens)
        self.tracker.record(chosen.name, ask.prefix_keys)
        return decision

    def _bound_tracker(self, replicas: Sequence[Replica], block_tokens: int) -> None:
        """The prefix memory keeps no more blocks than the replicas' KV pools hold together
        (once every replica has reported its size): the engines evict their caches' least
        recently used prefixes to make room, and a prefix remembered past that would be
        forecast as cached when its prompt is computed again (a small engine — the CPU's
        16K-token pool — holds a few conversations, not the last 8 M tokens sent)."""
        # a pool's KV sizes change only when replicas come or go: summed again then, and
        # every TRACKER_BOUND_EVERY decisions (a replica's first report)
        self._decisions += 1
        if len(replicas) == self._bound_replicas and self._decisions % TRACKER_BOUND_EVERY:
            return
        total = 0
        for r in replicas:
            load = r.load
            if load is None or load.kv_capacity_tokens <= 0:
                return
            total += load.kv_capacity_tokens
        self._bound_replicas = len(replicas)
        self._bound_keys = max(1, total // max(1, block_tokens))
        self.tracker.max_keys = max(1, int(self._bound_keys * self.cache_share))

    def forecast_alone(self, ask: PlaceAsk, replica: Replica) -> PlaceDecision:
        """*ask* on the one replica there is: an RT contract forecast with the prefix the
        replica's cache holds taken off its prompt; nothing recorded (`remember` does, once
        the prompt has run: the gateway's one engine, where the admission's cost counts)."""
        self._bound_tracker((replica,), ask.block_tokens)
        if ask.slo is None:
            return PlaceDecision(0)
        cached = self.tracker.depth_on(replica.name, ask.prefix_keys) * ask.block_tokens
        if cached >= ask.prompt_tokens:
            cached = ask.prompt_tokens - 1  # at least a token is computed
        return PlaceDecision(0, self._forecast(replica, ask.slo, cached), max(0, cached))

    def remember(self, name: str, prefix_keys: Sequence[int]) -> None:
        self.tracker.record(name, prefix_keys)

    def observe_cached(self, claimed_tokens: int, engine_cached_tokens: int) -> None:
        """The engine's count of a request's cached prompt tokens against what the forecast
        took as cached: the prefix memory's bound follows what the engines really keep (their
        pools hold running requests' KV too, and evict their caches' least recently used
        prefixes first). A claim the engine did not hold cuts the share of the pools the
        memory spans by CACHE_SHARE_CUT; a claim it held raises it by CACHE_SHARE_STEP (a
        loop like TCP's window: claims that fail are costly — a forecast too short, a request
        admitted to miss —, so the memory shrinks fast and grows back slowly)."""
        if claimed_tokens <= 0:
            return
        if engine_cached_tokens < CLAIM_HELD_FRAC * claimed_tokens:
            self.cache_share = max(CACHE_SHARE_MIN, self.cache_share * CACHE_SHARE_CUT)
        else:
            self.cache_share = min(1.0, self.cache_share + CACHE_SHARE_STEP)
        if self._bound_keys:
            self.tracker.max_keys = max(1, int(self._bound_keys * self.cache_share))

    def _place_rt(self, ask: PlaceAsk, slo: SloAsk, replicas: Sequence[Replica]) -> PlaceDecision:
        sent = self._sent
        # The prefix the cache holds, and where. Only one replica holding it makes the request
        # stay there (a conversation's history): a prefix several replicas hold — a system
        # prompt or a chat template every request starts with — is no reason to prefer one of
        # them, and keeping it so sent every new conversation to the same replica until its
        # forecast failed (Azure conversations with a shared first block, 8 replicas: joint
        # attainment 0.984, below round-robin's 0.996); it is taken off each holder's forecast.
        depth, holders = self.tracker.deepest(ask.prefix_keys)
        hit: tuple[int, int] | None = None
        shared = 0
        if holders:
            held = [i for i, r in enumerate(replicas) if r.name in holders]
            if len(held) == 1:
                hit = (held[0], depth)
            elif held:
                shared = depth * ask.block_tokens
            else:  # its holders are not candidates now (down): the best candidate holding any
                hit = _match_among(self.tracker, ask.prefix_keys, replicas)

        def work_ahead(i: int) -> int:
            r = replicas[i]
            load = r.load
            waiting = load.rt_waiting_prompt_tokens if load is not None else 0
            return waiting + r.backlog.prompt_tokens + sent.tokens(r)

        headroom = self.forecaster.headroom
        best: tuple[float, int, Forecast, int] | None = None
        if hit is not None:  # its turns stay together where the contract holds
            cached = hit[1] * ask.block_tokens
            forecast = self._forecast(replicas[hit[0]], slo, cached)
            if forecast.feasible:
                return PlaceDecision(hit[0], forecast, cached)
            best = (_slack(forecast, slo, headroom), hit[0], forecast, cached)
        count = len(replicas)
        if count <= self.forecast_candidates:
            candidates: Iterable[int] = range(count)
        else:
            candidates = heapq.nsmallest(self.forecast_candidates, range(count), key=work_ahead)
        for i in candidates:
            if hit is not None and i == hit[0]:
                continue
            cached = shared if shared and replicas[i].name in holders else 0
            forecast = self._forecast(replicas[i], slo, cached)
            slack = _slack(forecast, slo, headroom)
            if best is None or slack > best[0]:
                best = (slack, i, forecast, cached)
        assert best is not None
        return PlaceDecision(best[1], best[2], best[3])

    def _forecast(self, r: Replica, slo: SloAsk, cached: int) -> Forecast:
        """The forecast on *r*: its report (an empty one without), the RT sent since, what its
        own outcomes taught (`Replica.ttft_extra_s`), and the prompt less what its cache holds
        (at least a token is computed).

        An idle replica whose calibration has not learned from `MIN_VERIFIED_ITERATIONS` yet is
        forecast at its profile's pace: the few iterations it ran (a fresh engine's first ones
        are slow) are no measure of it, and a worse forecast than its busy neighbours' would
        keep it idle for good — nothing it runs could correct it (seen: one SGLang engine's
        DP rank 0, 11 warm-up iterations at 2× the profile, got none of the chats its rank 1
        served). Its first requests then teach the calibration its real pace."""
        load = r.load or EngineLoad(iteration=0, at_unix_s=0.0)
        if load.calibration_samples < MIN_VERIFIED_ITERATIONS and idle(load, r.backlog):
            load = msgspec.structs.replace(
                load,
                latency_factors=(1.0, 1.0, 1.0),
                pace_ratio_p90=1.0,
                pace_ratio_recent_mean=1.0,
            )
        if cached:  # computed after the prefix its cache holds
            prompt = max(1, slo.prompt_tokens - cached)
            ask = msgspec.structs.replace(
                slo, prompt_tokens=prompt, cached_tokens=slo.prompt_tokens - prompt
            )
        else:
            ask = slo
        return self.forecaster.forecast(load, ask, r.backlog, r.ttft_extra_s, r.slot_wait_scale)

    def _place_be(
        self, ask: PlaceAsk, replicas: Sequence[Replica], hit: tuple[int, int] | None
    ) -> int:
        sent = self._sent
        left = [leftover_tokens(r.load) - sent.tokens(r) for r in replicas]
        best = left.index(max(left))
        if hit is not None and left[hit[0]] >= left[best] - self.imbalance_tokens:
            return hit[0]
        return best


def _slack(forecast: Forecast, slo: SloAsk, headroom: float) -> float:
    """Relative slack of a forecast against the contract (within the headroom): the smaller of
    1 − TTFT ÷ its budget (`Forecast.ttft_budget_s`) and 1 − TPOT ÷ the headroom of its target;
    < 0 when a target is predicted to be missed."""
    slack = 1.0 - forecast.ttft_s / forecast.ttft_budget_s
    if forecast.tpot_s is not None and slo.tpot_target_s:
        slack = min(slack, 1.0 - forecast.tpot_s / (headroom * slo.tpot_target_s))
    return slack


def _match_among(
    tracker: PrefixTracker, keys: Sequence[int], replicas: Sequence[Replica]
) -> tuple[int, int] | None:
    """(index, blocks) of the candidate with the longest prefix match; None without a match."""
    hit = tracker.match(keys)
    if hit is None:
        return None
    names = [r.name for r in replicas]
    if hit[0] in names:
        return names.index(hit[0]), hit[1]
    # the tracker's best holder is not a candidate now (down): the best candidate holding any
    depths = [tracker.depth_on(name, keys) for name in names]
    deepest = max(depths)
    return (depths.index(deepest), deepest) if deepest else None


def _check(replicas: Sequence[Replica]) -> None:
    if not replicas:
        raise ValueError("no replica to place the request on")


def make_router(
    name: str, forecaster: SloForecaster | None = None
) -> SloAware | RoundRobin | LeastLoad | PrefixAware:
    """The router *name* (one of `ROUTERS`); the slo router needs the SLO *forecaster*.
    ValueError naming the choices for an unknown name."""
    if name == "slo":
        if forecaster is None:
            raise ValueError("the slo router needs an SLO forecaster (a latency model)")
        return SloAware(forecaster)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix":
        return PrefixAware()
    raise ValueError(f"unknown router {name!r} (choose from {', '.join(ROUTERS)})")
