"""The SLO admission's log lines: what an operator, or a developer of the forecast, needs to
tell a refusal the engine's load called for from one a pessimistic forecast made.

* `engine_state` — the engine state a forecast was made on, in words (shared by the refusal
  line here and the admitted-miss line of the record stage, `stages._log_admitted_miss`).
* `RefusalLog` — one INFO line per engine and interval for the RT requests the admission
  refused or downgraded: the latest one's forecast and the state it was judged on, with how
  many there were since the previous line. Under overload a gateway refuses hundreds a second;
  one line a second keeps the log readable, and /metrics counts every one
  (`tandem_slo_admissions_total`).

Pure of the app: the admission check calls `RefusalLog.note` with its decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from backend.policy.feasibility import Shortfall
from common.wire import EngineLoad

log = logging.getLogger(__name__)

STEPS_LEFT_SHOWN = 8
"""How many of the engine's slot-free steps a line shows (k = 1 … this: within how many decode
steps k of its running RT decodes finish; the slot wait is the k-th)."""


def engine_state(engine: str, load: EngineLoad) -> str:
    """The engine state *load* of engine *engine* as one clause: RT decoding and waiting, BE,
    request slots and the steps within which the first of them free up, the calibrated pace,
    the recent pace (now, and at worst but one iteration in ten) and the last iteration."""
    f_decode, f_prefill, f_mixed = load.latency_factors
    slots = ""
    if load.max_running_requests > 0:
        shown = ", ".join(str(s) for s in load.rt_decode_steps_left[:STEPS_LEFT_SHOWN])
        slots = (
            f", {load.max_running_requests} request slots ({load.num_rt_prefilling} RT "
            f"prefilling; slots free within [{shown}] decode steps, a new request "
            f"{load.rt_new_decode_steps})"
        )
    recent = ""
    if load.pace_ratio_recent_mean is not None:
        recent = f"now ×{load.pace_ratio_recent_mean:.2f} "
    return (
        f"engine {engine} then: {load.num_rt_running} RT decoding "
        f"({load.rt_context_tokens} context tokens), {load.num_rt_waiting} RT prompts "
        f"waiting ({load.rt_waiting_prompt_tokens} tokens), {load.num_be_running} BE "
        f"running{slots}, pace ×{f_decode:.2f} decode ×{f_prefill:.2f} prefill "
        f"×{f_mixed:.2f} mixed, {recent}p90 ×{load.pace_ratio_p90:.2f}, last iteration "
        f"{load.iteration_s * 1000:.0f} ms"
    )


class RefusalLog:
    """Logs the SLO admission's refusals (and downgrades) of RT requests, at most one line per
    engine every `interval_s`: the first refusal after a quiet interval at once, then the
    latest one when the interval is up, with the count since the line before."""

    def __init__(
        self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s < 0.0:
            raise ValueError(f"interval_s must be ≥ 0, got {interval_s}")
        self.interval_s = interval_s
        """Least time between two lines about one engine, seconds."""
        self._clock = clock
        self._last_s: dict[str, float] = {}
        """engine → when its last line was written (monotonic seconds)."""
        self._since: dict[str, int] = {}
        """engine → refusals noted since its last line (those not written)."""

    def note(
        self,
        outcome: str,
        request_id: str,
        tenant_id: str,
        shortfall: Shortfall,
        engine: str | None,
        load: EngineLoad | None,
        *,
        waited_s: float,
        ttft_extra_s: float,
        slot_wait_scale: float = 1.0,
    ) -> bool:
        """One RT request refused ("shed") or downgraded on a forecast missing by
        *shortfall*, judged on *engine* in state *load* after *waited_s* at the gateway, with
        *ttft_extra_s* and a request slot's wait scaled by *slot_wait_scale* taught by
        outcomes. Returns whether a line was written."""
        key = engine or ""
        now_s = self._clock()
        last_s = self._last_s.get(key)
        count = self._since.get(key, 0) + 1
        if last_s is not None and now_s - last_s < self.interval_s:
            self._since[key] = count
            return False
        self._last_s[key] = now_s
        self._since[key] = 0
        state = f"; {engine_state(key, load)}" if load is not None else ""
        log.info(
            "SLO admission %s RT request %s of tenant %s: %s; waited %.0f ms at the gateway, "
            "+%.0f ms and slot waits ×%.2f taught by first tokens%s (%d on this engine since "
            "the last such line)",
            "refused" if outcome == "shed" else outcome,
            request_id,
            tenant_id,
            shortfall.describe(),
            waited_s * 1000,
            ttft_extra_s * 1000,
            slot_wait_scale,
            state,
            count,
        )
        return True
