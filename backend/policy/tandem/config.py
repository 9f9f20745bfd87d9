"""The tandem policy's knobs (synthesis §4 defaults), one frozen struct validated once.

The ablation switches (`use_*`) exist so that `tandem-no-<part>` registry entries can turn one
concept off at a time and the bench can show what each one buys.
"""

from __future__ import annotations

import math

import msgspec

from backend.policy.feasibility import SLOT_FREE_QUANTILE


class TandemConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters of the tandem scheduling loop."""

    latency_budget_s: float = 0.03
    """L: soft cap on the predicted iteration time, seconds (HyGen's profiled latency budget).
    It bounds RT TBT and the wait of a newly arrived RT request; an urgent RT prefill may exceed
    it, never the hard cap set by the RT deadlines in the batch."""
    latency_budget_pace_max: float = 4.0
    """L follows the engine's learned pace (`use_calibration`; the geometric mean of the
    calibration's factors, never below 1) up to this factor: an engine slower than its profile
    does the same work per iteration. At a fixed L in wall seconds a 2× slower engine computes
    half the tokens per iteration, pays the fixed per-iteration cost twice as often and loses
    more than half its RT capacity (W1 at slowdown 2: 41 req/s in SLO where stock FCFS keeps
    50). The RT deadlines' hard cap still bounds every iteration. 1: L in wall seconds."""
    idle_budget_s: float = 0.06
    """Iteration-time cap when no RT request is running or waiting, seconds (BE alone: longer
    iterations amortise the fixed per-iteration cost; an RT arrival waits at most this)."""
    long_prompt_tokens: int = 4096
    """A prompt of at least this many tokens is "long" (ERA, AccelGen), tokens."""
    max_long_prefills: int = 1
    """Long prompts allowed mid-prefill at once, per tier (an urgent RT one bypasses it)."""
    window_s: float = 0.75
    """γ: non-urgent RT prompts whose slack is within this of the head's are candidates for
    the best fit, seconds (AccelGen's window)."""
    best_fit_candidates: int = 8
    """At most this many window candidates are compared by the best fit."""
    reserve_frac: float = 0.05
    """Past-Future reserve: admission keeps the predicted KV peak under capacity × (1 − this)."""
    rt_headroom_frac: float = 0.05
    """Floor of the KV share kept free from BE admission for RT arrivals (the adaptive headroom
    never goes below it), fraction of capacity."""
    rt_headroom_max_frac: float = 0.10
    """Ceiling of the adaptive RT headroom, fraction of capacity (an RT arrival that finds KV
    short evicts BE anyway; the headroom only makes that rarer)."""
    rt_headroom_window_s: float = 30.0
    """The adaptive RT headroom covers RT KV growth seen over this window, seconds."""
    history_window: int = 1000
    """Finished output lengths kept per length key (Past-Future's w)."""
    history_min_samples: int = 20
    """Below this many finished requests a key is predicted by its cold-start prior (the
    request's max_new_tokens)."""
    eps_init: float = 0.10
    """Initial latency safety margin ε: τ = (1 − ε) × the tightest RT allowance."""
    eps_min: float = 0.02
    """Smallest ε (additive decrease stops here)."""
    eps_max: float = 0.30
    """Largest ε (multiplicative increase stops here)."""
    eps_step: float = 0.005
    """Additive decrease of ε per iteration without a miss or an overrun."""
    be_frac_init: float = 0.25
    """Initial BE time share: BE may use this fraction of the time RT leaves under τ."""
    be_frac_step: float = 0.05
    """Additive increase of the BE share per iteration without an RT miss."""
    be_frac_reset: float = 0.25
    """The BE share after an RT deadline miss or near miss (multiplicative decrease)."""
    near_miss_frac: float = 0.05
    """An RT token emitted within this fraction of its allowance before its deadline is a
    near miss (the feedback backs off as for a miss)."""
    first_token_be_frac: float = 1.0
    """Scales the BE share (and `rt_stretch`) in an iteration that emits RT first tokens: every
    second of BE work there is a second of TTFT for each of them (HyGen's mean-TTFT
    interference); 1 = no difference, 0 = such iterations carry only the BE starvation floor."""
    be_min_share: float = 0.03
    """BE always gets at least this fraction of τ when it has work (starvation freedom under
    sustained RT load), even past τ; with `rt_stretch` set, this fraction of the RT work's own
    predicted time in an iteration that carries RT work. While RT overloads the engine the SLO
    admission sheds the RT requests this floor leaves no room for: on W1 at 0.75 λ* with the
    engine 2× slower than its profile, 5 % shed 0.309 of RT (BE 139 tok/s), 3 % sheds 0.294
    (BE 99 tok/s), 0 % 0.278 (BE 33 tok/s): bench/results/slo/README.md."""
    rt_stretch: float | None = None
    """How much longer BE may make an iteration that carries RT work, as a fraction of that
    RT work's own predicted time (0.3: RT tokens come at most 30 % later than they would with
    no BE at all; the BE starvation floor still applies). None: only τ and the RT deadlines
    bound it, so BE stretches RT iterations up to what the contracts allow. A contract is a
    bound, not what a user is used to: with a lax TPOT target (100 ms) on a fast engine (10 ms
    alone), the deadlines alone would let BE make every RT token ×9 slower, within contract.
    No stretch while RT prompt work is left over after the RT part of the plan."""
    rt_active_window_s: float = 10.0
    """With `rt_stretch` set: for this long after an RT request was last waiting or running, an
    iteration without RT work is held to the predicted time of a typical RT request's first
    iteration (its prompt alone), since the next RT arrival waits for the iteration in flight;
    after that, BE iterations grow to `idle_budget_s` (long iterations amortise the
    per-iteration cost). Seconds."""
    rt_active_be_frac: float = 1.0
    """With `rt_stretch` set: the BE-alone iterations of the RT-active window are held to this
    fraction of a typical RT prompt's first iteration (an RT arrival waits for the one in flight,
    half of it on average: 0.5 halves that wait, at the cost of BE paying the fixed
    per-iteration cost twice as often while anyone chats). In (0, 1]."""
    be_min_time_share: float = 0.0
    """With `rt_stretch` set: BE's share of the engine's time (predicted, over about the last
    second in which BE had work) is kept at least this. An iteration with RT work gives BE up to
    this share of it while BE is behind, whatever the stretch allows: under sustained RT load,
    with RT first tokens in nearly every iteration, the stretch alone starves BE. Neither this
    share nor the stretch applies while RT prompt work is left over after the RT part of the
    plan (RT lacks time: BE is paused down to `be_min_share` before an RT request waits for
    it)."""
    rt_anticipation_s: float = 0.0
    """Anticipatory scheduling (`backend.policy.tandem.anticipation`): when the last RT request
    around ends, BE waits up to this long for the next RT arrival, while recent RT arrivals
    mostly came that soon after the previous RT request ended (closed-loop clients: an agent's
    next call, a chat's next message sent at once; such a request is in transit through the
    gateway while a BE iteration would start, and would then wait for all of it). Seconds;
    0: never wait."""
    be_max_wait_s: float = 60.0
    """A waiting BE request older than this is admitted before the caller's order (aging)."""
    be_order_prob: float = 0.8
    """u: probability that the next BE admission follows the caller's order rather than
    oldest-first (HyGen's freshness mix)."""
    rt_prefill_floor_tokens: int = 0
    """RT prompts may stretch an iteration past L (never past the RT deadlines' hard cap) until
    the RT work in it reaches this many tokens (RT decodes count one each, as in the rt-only
    engine's budget); 0 = τ ≤ L also for RT prompts."""
    min_chunk_tokens: int = 16
    """Smallest prefill chunk worth a slot unless it finishes the prompt, tokens."""
    least_chunk_stretch: float = 0.25
    """When no time budget leaves room for even the smallest chunk (`min_chunk_tokens`) and the
    plan would be empty, that chunk runs anyway (an engine must not idle on queued work), grown
    while the iteration stays within this fraction above the smallest chunk's predicted time:
    deep into a long prompt, where every chunk pays for attention over the whole prefix, a
    longer chunk costs little more and saves the prefix's cost many times over (0: the smallest
    chunk as it is). A chunk the budget cuts grows the same way where the smallest chunk
    would cost nearly as much (a conversation's turn after its cached history: cut, it pays
    the history in every chunk)."""
    rt_slot_reserve_frac: float = 0.1
    """Share of the engine's request slots (max_running) that BE admissions leave free, so an
    RT arrival is never kept waiting by the request cap alone (engines with a finite cap)."""
    seed: int = 0
    """Seed of the policy's random draws (length samples, BE order mix)."""
    use_pastfuture: bool = True
    """Past-Future admission; off: admit while the chunk fits now (aggressive)."""
    use_slack: bool = True
    """Slack order, urgency and deadline-derived τ; off: RT in arrival order, τ = L."""
    use_aimd: bool = True
    """AIMD on ε and the BE share; off: both fixed at their initial values (BE share 1)."""
    use_era: bool = True
    """At most `max_long_prefills` long prompts mid-prefill per tier; off: no limit."""
    use_slack_stealing: bool = True
    """A hopeless RT prompt (its TTFT is lost) goes before feasible ones where they can spare
    the time (`queues.PromptPace`): none of them is pushed past `slo_headroom` of its TTFT
    target at the RT phase's pace, the share the admission would have allowed its forecast, so
    what the headroom keeps for the model's error stays kept. A request late by a little is then
    not left waiting for a whole burst to drain (real W6: 2.8–3.9 s in the queue behind it).
    Off: hopeless prompts wait behind every feasible one (EDF's order under overload)."""
    rt_late_bound_frac: float | None = 1.0
    """A hopeless RT prompt more than this fraction of its TTFT target past its deadline (1:
    its wait has reached twice the target) goes before every other waiting RT prompt, one a
    plan (the one latest past its deadline): a request the admission let in is served even
    while the feasible ones never have a moment to spare. Without it, W1 at 3 λ* in the
    simulator kept about 50 requests admitted in its first second waiting 120 s, until the
    arrivals stopped (1.3 s with it; the engine's load report counts such a prompt as ahead,
    `feasibility.load_of`, so the admission sees it). Each jump can make a request still on
    time late: 0.5 gave the same attainment on the simulator's W1 and W6 runs, but W6 at
    1.5 λ* with the engine 1.8× slower in every burst lost 0.8–1.3 points of it (1.0: 0.1–0.5).
    None: no bound."""
    use_fair_share: bool = True
    """Weighted fair share among the tenants of a tier (backend.policy.fair_share): waiting
    requests are offered tenant by tenant, the least served (weighted tokens) first; off: one
    queue per tier, whatever the tenant."""
    split_mixed: bool = False
    """When the latency model says the decodes and the RT prompts of an iteration cost clearly
    more together than apart (`split_min_gain`), run them apart: an iteration of
    prompts (BE's may ride within the stretch), the decodes sitting it out where their TPOT
    deadlines allow, then one of decodes with no prompt. SGLang's torch-native attention (the
    CPU engine) recomputes every decode as a 1-token extend over its whole context in a batch
    with a prompt: 62 decodes and a 31-token prompt took 190 ms together, 60 ms and about 15 ms
    apart. Off: stall-free mixed batches always (a GPU backend's model gives the split nothing:
    the decodes cost the same beside a prompt). The SLO admission forecasts the same way."""
    split_min_gain: float = 0.1
    """With `split_mixed`: prompts and decodes run apart only when the model predicts the two
    iterations take at least this fraction less time than the mixed one (a small gain is not
    worth the decodes' wait). In [0, 1)."""
    use_calibration: bool = True
    """Online latency calibration (`backend.policy.calibration`): predictions are scaled by the
    learned per-regime factor of the engine's pace; off: the profile as measured (the error
    statistics are kept either way, and the SLO admission uses the learned pace regardless)."""
    deadline_spread: bool = True
    """Take a waiting RT prompt's slack at the engine's recent upper pace, not its mean: the
    slack that makes it urgent counts each iteration it still needs as lasting `PaceSpread`'s
    p90 of measured ÷ predicted over the last 32 iterations (≥ 1; exactly 1 on an engine that
    runs as the calibrated model says, so nothing changes there), so it turns urgent sooner.
    Slack order starts a prompt just in time: on a noisy engine one started at the mean pace
    misses whenever its iterations run long (the simulator's W1 with `--engine-noise 0.3`:
    admitted RT attainment at slowdown 2 0.977 without, 0.994 with;
    bench/results/slo/README.md). An urgent prompt's iterations are still sized to its deadline
    at the mean pace. The SLO admission forecasts with the same spread. Off: the mean pace."""
    slo_admission: bool = True
    """Admission against the contract (`backend.policy.feasibility`): an RT request whose TTFT
    or TPOT the engine's current load cannot meet is refused (or downgraded, per the contract)
    before it reaches the engine; off: every request is admitted. The gateway does it for the
    real engine, the simulator's front door for the bench."""
    slo_headroom: float = 0.65
    """The SLO admission's forecast may use this fraction of the time a request has left (the
    forecast is a mean, the contract a bound); a wait for a request slot, a sum of many decode
    steps, may use its square root (`backend.policy.feasibility`)."""
    slo_pace_averaging: bool = True
    """The SLO admission stretches a request slot's wait of n decode steps by the engine's pace
    now plus the gap to its recent p90 over √n (`feasibility.pace_stretch`): one iteration's
    noise averages out over many, a change of pace does not. Off: every step of the wait at the
    p90 (the forecast of a long wait then runs well above what the requests admitted beside it
    get, and refuses some that would have met their contract)."""
    slo_slot_line: bool = True
    """RT requests the SLO admission keeps for a request slot (the gateway's `slo_recheck_frac`)
    form a line in arrival order: a later RT request whose forecast would also wait for a slot
    waits behind them instead of being sent first (gateway/pipeline/slot_line.py; the
    simulator's front door does the same). Off: each is judged on its own, and in a slot crunch
    the later arrivals, with their whole target left, take the slots the earlier ones were
    kept for."""
    slo_slot_wait_feedback: bool = True
    """The SLO admission learns, per engine, how much faster the engine ran the decode steps of
    request slots' waits than it forecast — the engine's mean iteration from an admitted RT
    request's admission to its first token, over the step forecast, for the requests whose
    forecast was mostly such a wait — and scales that wait by it (`feasibility.TtftFeedback`: a
    high quantile, at least 0.5, reverted as soon as a few see a slower pace). Off: the slot
    wait as forecast (session 66's forecast came out 30–40 % longer than the waits on the real
    CPU engine at its capacity, and refused requests kept for a slot that would have met their
    contract; with today's forecast the engine ran the steps at about the forecast pace, and
    the scale stayed at 1: bench/results/slo/README.md, session 71). The count of
    steps is not learned: it is `slo_slot_free_quantile`'s margin where output lengths are not
    known (learned from the whole wait, the scale trimmed it, and 0.4 % of the admitted in a
    slot-bound stream came late; bench/results/slo/README.md, session 71)."""

    slo_slot_free_quantile: float | None = SLOT_FREE_QUANTILE
    """The engine reports when its running RT requests will free their request slots at this
    quantile (`feasibility.RtOutputs.slots_free_steps`: the k-th slot is free within that many
    decode steps with this probability, each request's length drawn from the engine's recent
    RT outputs), and the SLO admission forecasts a slot wait with it. None: the k-th fewest of
    each request's mean steps left (outputs the engine cannot know then made the wait a coin
    toss: a slot-bound stream admitted 4–6 % of its requests late, up to 4× their TTFT)."""

    def __post_init__(self) -> None:
        for name in (
            "latency_budget_s",
            "idle_budget_s",
            "window_s",
            "rt_headroom_window_s",
            "rt_active_window_s",
            "be_max_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.latency_budget_pace_max < 1.0:
            raise ValueError(
                f"latency_budget_pace_max must be ≥ 1, got {self.latency_budget_pace_max}"
            )
        if not 0.0 < self.slo_headroom <= 1.0:
            raise ValueError(f"slo_headroom must be in (0, 1], got {self.slo_headroom}")
        for name in (
            "reserve_frac",
            "rt_headroom_frac",
            "rt_headroom_max_frac",
            "near_miss_frac",
            "be_min_share",
            "be_min_time_share",
            "first_token_be_frac",
            "rt_active_be_frac",
            "rt_slot_reserve_frac",
            "split_min_gain",
            "be_order_prob",
        ):
            value = getattr(self, name)
            if name in ("be_order_prob", "first_token_be_frac", "rt_active_be_frac"):
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"{name} must be in [0, 1], got {value}")
            elif not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not 0.0 <= self.eps_min <= self.eps_init <= self.eps_max < 1.0:
            raise ValueError("need 0 ≤ eps_min ≤ eps_init ≤ eps_max < 1")
        if not 0.0 < self.be_frac_reset <= 1.0 or not 0.0 < self.be_frac_init <= 1.0:
            raise ValueError("be_frac_init and be_frac_reset must be in (0, 1]")
        if self.rt_active_be_frac <= 0.0:
            raise ValueError(f"rt_active_be_frac must be in (0, 1], got {self.rt_active_be_frac}")
        if not (self.least_chunk_stretch >= 0.0 and math.isfinite(self.least_chunk_stretch)):
            raise ValueError(
                f"least_chunk_stretch must be a finite number ≥ 0, got {self.least_chunk_stretch}"
            )
        if not (self.rt_anticipation_s >= 0.0 and math.isfinite(self.rt_anticipation_s)):
            raise ValueError(
                f"rt_anticipation_s must be a finite number ≥ 0, got {self.rt_anticipation_s}"
            )
        if self.rt_late_bound_frac is not None and not self.rt_late_bound_frac >= 0:
            raise ValueError(
                f"rt_late_bound_frac must be ≥ 0 (or null), got {self.rt_late_bound_frac}"
            )
        quantile = self.slo_slot_free_quantile
        if quantile is not None and not 0.0 < quantile < 1.0:
            raise ValueError(f"slo_slot_free_quantile must be in (0, 1) (or null), got {quantile}")
        if self.rt_stretch is not None and self.rt_stretch < 0:
            raise ValueError(f"rt_stretch must be ≥ 0 (or null), got {self.rt_stretch}")
        if self.rt_prefill_floor_tokens < 0:
            raise ValueError(
                f"rt_prefill_floor_tokens must be ≥ 0, got {self.rt_prefill_floor_tokens}"
            )
        for name in (
            "long_prompt_tokens",
            "max_long_prefills",
            "best_fit_candidates",
            "history_window",
            "history_min_samples",
            "min_chunk_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
