"""What one plan works with: the running set split once by tier and phase, and the per-plan
state the RT and BE phases share (the batch, τ, the admission round, the queues)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from backend.policy.tandem.admission import AdmissionRound, LengthModel
from backend.policy.tandem.batch import TandemBatch
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.queues import BeQueue, RtQueue
from backend.policy.tandem.timing import Timer
from backend.policy.types import ReqState
from common.wire import Tier


@dataclass
class RunningView:
    """The running requests split by tier and phase (one pass over the running list)."""

    rt_decode: list[ReqState] = field(default_factory=list)
    rt_partial: list[ReqState] = field(default_factory=list)
    be_decode: list[ReqState] = field(default_factory=list)
    be_partial: list[ReqState] = field(default_factory=list)
    rt_kv_tokens: int = 0
    """KV held by running RT requests, tokens."""
    long_mid: dict[str, int] = field(default_factory=lambda: {"rt": 0, "be": 0})
    """Long prompts mid-prefill per tier (ERA)."""

    @property
    def rt_running(self) -> list[ReqState]:
        return self.rt_decode + self.rt_partial

    @property
    def be_running(self) -> list[ReqState]:
        return self.be_decode + self.be_partial


def split_running(running: list[ReqState], long_tokens: int) -> RunningView:
    """Splits `running` into RT/BE decodes and partial prefills (admission order kept)."""
    view = RunningView()
    rt_kv = 0
    for r in running:
        partial = r.prefilled < r.prefill_len
        if r.tier == "rt":
            rt_kv += r.kv_tokens
            (view.rt_partial if partial else view.rt_decode).append(r)
        else:
            (view.be_partial if partial else view.be_decode).append(r)
        if partial and r.prefill_len >= long_tokens:
            view.long_mid[r.tier] += 1
    view.rt_kv_tokens = rt_kv
    return view


@dataclass
class PlanContext:
    """Per-plan state shared by the phases."""

    now_s: float
    config: TandemConfig
    timer: Timer
    batch: TandemBatch
    view: RunningView
    admission: AdmissionRound
    lengths: LengthModel
    rt_queue: RtQueue
    be_queue: BeQueue
    eps: float
    """Latency safety margin this plan uses."""
    be_frac: float
    """Share of the time RT leaves under τ that BE may use."""
    max_prefill: int
    """Engine cap on prefill tokens per iteration."""
    has_rt: bool = True
    """Some RT request is running or waiting."""
    budget_s: float = 0.0
    """L for this plan: the latency budget, or the idle budget with no RT around."""
    tau_s: float = 0.0
    """τ: the iteration-time target."""
    deadline_spread: float = 1.0
    """How many times its calibrated prediction an iteration is taken to last in an RT
    prompt's slack (`TandemConfig.deadline_spread`): the engine's recent p90 of
    measured ÷ predicted, ≥ 1; 1 when off, or on an engine that runs as predicted."""
    hard_s: float = math.inf
    """No RT token in the batch may be emitted later than now + this (its allowance)."""
    be_time_share: float = 1.0
    """BE's recent share of the engine's predicted time while it had work (1: not behind)."""
    rider_cost: float = 1.0
    """Measured ÷ predicted cost of BE work riding in iterations with RT work, recently
    (`feedback.RiderCost`; 1 without `rt_stretch`): BE's allowance there is divided by it."""
    decodes_allowed: bool = True
    """False in the prompts' half of a split iteration (`rt_phase.split_pays`): every decode
    sits it out."""
    deferred_rt_decode_s: float = 0.0
    """In the prompts' half of a split iteration: the predicted time of the RT decodes it holds
    back, alone (RT work BE's allowance is measured against, with the batch's own; not the BE
    decodes': a chat beside a batch would wait for BE prompt work sized by the batch's own
    decodes)."""
    prefills_allowed: bool = True
    """False in the decodes' half of a split iteration: no prompt chunk, RT or BE."""
    overdue_room_s: float = 0.0
    """In the prompts' half of a split iteration run for an overdue RT prompt
    (`rt_phase.split_pays`): the hard cap it gets at least, seconds, however soon the decodes'
    next token is due (0: none)."""
    rt_backlog: bool = False
    """RT prompt work is left after the RT phase (a prompt waiting, or one mid-prefill with
    more left than this plan's chunk): RT is what the engine lacks time for, so BE gets only
    its starvation floor, not `rt_stretch` or `be_min_time_share` (set by the policy)."""

    def cap_tau(self) -> None:
        """Keeps τ within (1 − ε) × the hard cap."""
        if self.config.use_slack:
            self.tau_s = min(self.tau_s, (1 - self.eps) * self.hard_s)

    def is_long(self, r: ReqState) -> bool:
        return r.prefill_len >= self.config.long_prompt_tokens

    def era_blocked(self, r: ReqState, tier: Tier) -> bool:
        """Starting `r` would put one long prompt too many mid-prefill in its tier."""
        return (
            self.config.use_era
            and not r.is_running
            and self.is_long(r)
            and self.view.long_mid[tier] >= self.config.max_long_prefills
        )

    def started(self, r: ReqState, chunk: int, tier: Tier) -> None:
        """`r` got a chunk: a long prompt not finished by it now counts as mid-prefill."""
        if not r.is_running and self.is_long(r) and chunk < r.prefill_len - r.prefilled:
            self.view.long_mid[tier] += 1

    def on_evict(self, r: ReqState) -> None:
        """An evicted request waits again at the front of its tier."""
        if r.tier == "rt":
            self.rt_queue.requeue(r)
        else:
            self.be_queue.requeue(r)
