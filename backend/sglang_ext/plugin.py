"""tandem's SGLang plugin: the entry point SGLang's ``load_plugins()`` calls in each process.

Declared in pyproject.toml (entry-point group ``sglang.srt.plugins``, name ``tandem``) and enabled
by ``SGLANG_PLUGINS=tandem`` (``backend.launch.sglang.engine_env`` sets it). SGLang calls
:func:`register` once in every one of its processes — the HTTP/tokenizer main process, the
scheduler and the detokenizer — before the scheduler object is built, so hooks registered here
are in place before ``Scheduler.__init__`` captures any bound method.

Its configuration is one :class:`~common.config.EngineSettings`, decoded from the engine's
environment by ``common.config.engine_settings_from_env`` (the launcher encodes it); a bad
value stops the engine with a message naming the field.

What it hooks (:data:`SEAMS`; ``tests/functional/test_sglang_seams.py`` checks that each still
exists in the pinned SGLang):

* AFTER ``Scheduler._create_generation_req`` (SGLang's documented "extension point for
  request-local state"): parse ``req.sampling_params.custom_params`` into the gateway's
  :class:`~common.wire.RequestMeta` and attach it as ``req.tandem`` (None when absent or
  malformed — a bad client dict must never kill the scheduler).
* AROUND ``TokenizerManager.sigterm_watchdog``, in the HTTP server's main process only: SIGTERM
  is noticed within 0.1 s rather than 5 s (:func:`register_prompt_shutdown`).

The main process also refuses to start an engine whose control socket another running engine
serves (:func:`refuse_taken_socket`), and, with the bicache layout, AFTER
``ServerArgs.resolve_once`` one whose arguments the layout cannot take
(:func:`refuse_unfit_layout`): both before SGLang starts a scheduler.

With ``settings.policy`` (a ``backend.policy.registry`` name; the launcher sets it unless
``engine.policy`` is ``none``) the plugin also puts that policy in charge of the scheduler: it
builds an :class:`~backend.sglang_ext.driver.EngineDriver` around the policy (latency model
fitted from ``settings.profile_path``, options from ``settings.policy_options``), installs the
co-location hooks of ``backend.sglang_ext.hooks`` and serves the control endpoint on
``settings.control_socket``. Without it the engine schedules like stock SGLang and only carries
the metadata. ``settings.kv_layout == "bicache"`` installs the bicache KV layout
(``backend.sglang_ext.kv_layout_engine``), with or without a policy.

Debug trace: with ``settings.scheduler_trace`` set, the scheduler process appends one JSON line
per request it creates::

    {"event": "request", "pid": ..., "process": "scheduler", "rid": ..., "priority": ...,
     "meta": {...every RequestMeta field, ttft_due_unix_s, deadline_due_unix_s, tpot_target_s,
              sglang_priority, received_unix_s...} | null,
     "error": null | "..."}

Other processes: the hook only fires where ``_create_generation_req`` is called, which is the
scheduler. :func:`register` also skips processes that have not imported the scheduler module, so
the plugin never pulls the scheduler (and torch kernels) into a process that does not need it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from backend.policy.bicache.records import unfit_layout
from backend.sglang_ext.request_meta import REQ_ATTR, get_meta, meta_of, trace_fields
from backend.sglang_ext.seams import (
    CREATE_REQ_SEAM,
    SEAMS,
    SERVER_ARGS_SEAM,
    SIGTERM_WATCHDOG_SEAM,
)
from common.config import EngineSettings, engine_settings_from_env
from common.sockets import control_socket_error
from common.wire import RequestMeta

logger = logging.getLogger(__name__)

__all__ = ["REQ_ATTR", "SEAMS", "get_meta", "register"]

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
DETOKENIZER_MODULE = "sglang.srt.managers.detokenizer_manager"
SIGTERM_POLL_S = 0.1
"""How often the main process looks for a SIGTERM it was sent (SGLang's own watchdog: 5 s)."""

# The trace path, set once at registration from the engine's settings. None: no trace.
_trace_path: str | None = None


def register() -> None:
    """Entry point for ``sglang.srt.plugins``: registers tandem's hooks in this process."""
    global _trace_path
    if SCHEDULER_MODULE not in sys.modules:
        # Not a process that runs the scheduler (the scheduler process always has the module:
        # load_plugins() is called from inside it); nothing to schedule, and nothing to import.
        if DETOKENIZER_MODULE not in sys.modules:
            # the HTTP server's main process: it loads plugins first, before any scheduler
            register_prompt_shutdown()
            settings = engine_settings_from_env()
            refuse_taken_socket(settings)
            if settings.kv_layout == "bicache":
                from sglang.srt.plugins.hook_registry import HookRegistry, HookType

                HookRegistry.register(SERVER_ARGS_SEAM, after_server_args, HookType.AFTER)
        logger.debug("tandem plugin: no scheduler in pid %d, no scheduler hooks", os.getpid())
        return
    if in_dp_controller():
        # With data parallelism SGLang's DP controller imports the scheduler module (to start
        # the ranks) and loads the plugins too, but schedules nothing: a driver here would take
        # the control socket DP rank 0's scheduler must serve, and rank 0 would refuse to start.
        logger.debug("tandem plugin: DP controller in pid %d, nothing registered", os.getpid())
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    settings = engine_settings_from_env()
    _trace_path = settings.scheduler_trace
    HookRegistry.register(CREATE_REQ_SEAM, after_create_generation_req, HookType.AFTER)
    try:
        _install(settings)
    except Exception as exc:
        # SGLang's plugin loader logs an Exception and runs on without the plugin: the engine
        # would schedule stock, or serve without its control endpoint, and say nothing. A
        # SystemExit passes its `except Exception`: the scheduler process ends, and so the
        # engine, with this line in its log.
        logger.error("tandem plugin: cannot start: %s", exc)
        raise SystemExit(f"tandem plugin: cannot start: {exc}") from exc
    logger.info(
        "tandem plugin registered in pid %d (policy: %s, kv layout: %s, trace: %s)",
        os.getpid(),
        settings.policy or "none",
        settings.kv_layout,
        _trace_path,
    )


def _install(settings: EngineSettings) -> None:
    """Puts the settings' policy in charge of this scheduler process and the KV layout in place
    (fails loudly: an engine asked to run a policy must not silently fall back to stock
    scheduling). The one place that wires the driver, the hooks and the layout together."""
    bicache = settings.kv_layout == "bicache"
    if settings.policy is None and not bicache:
        return
    from backend.sglang_ext import kv_layout_engine

    if settings.policy is not None:
        from backend.policy.latency import LatencyModel, load_profile
        from backend.policy.registry import make_policy
        from backend.sglang_ext import control
        from backend.sglang_ext.driver import EngineDriver
        from backend.sglang_ext.hooks import SchedulerHooks, cached_prefix_in_tree

        assert settings.profile_path is not None  # EngineSettings requires it with a policy
        profile = load_profile(settings.profile_path)
        latency = LatencyModel.fit(profile.samples)
        driver = EngineDriver(
            make_policy(settings.policy, latency, **settings.policy_options),
            profile=profile.name or str(settings.profile_path),
            profile_matches=None
            if settings.engine_key is None
            else profile.key == settings.engine_key,
            kv_unfreeable=kv_layout_engine.unfreeable_tokens,
            cached_prefix=cached_prefix_in_tree,
        )
        if driver.profile_matches is False:
            logger.warning(
                "tandem: latency profile %r (key %s) was not measured on this engine (key %s)",
                driver.profile,
                profile.key or "none: unkeyed",
                settings.engine_key,
            )
        # Both are inert without the bicache layout: no slack, and parked rows no one reads.
        SchedulerHooks(
            driver,
            prompt_slack_tokens=kv_layout_engine.prompt_slack_tokens,
            on_park=kv_layout_engine.set_parked,
        ).install()
        socket_path = control_socket_of_rank(settings.control_socket, *scheduler_ranks())
        if socket_path is not None:
            control.start(driver, socket_path)
    if bicache:
        kv_layout_engine.install()


def refuse_taken_socket(settings: EngineSettings) -> None:
    """Stops the engine at once, in its main process, when the control socket its scheduler
    would serve is another running engine's (raises SystemExit with the reason). The scheduler
    checks it again when it serves the socket (`control.start`) — the only check for DP ranks
    past 0 and for a socket taken meanwhile —, but only after SGLang has started it and loaded
    the model, some 20 s in on a CPU; here the engine fails within its start-up's first
    seconds."""
    path = settings.control_socket  # DP rank 0's, where the gateway reads the engine
    problem = None if path is None else control_socket_error(path)
    if problem is not None:
        logger.error("tandem plugin: cannot start: %s", problem)
        raise SystemExit(f"tandem plugin: cannot start: {problem}")


def after_server_args(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``ServerArgs.resolve_once`` (main process, bicache layout only): once
    SGLang has resolved the engine's arguments, stops the engine before it starts a scheduler
    when they cannot carry the layout (:func:`refuse_unfit_layout`). Returns None: SGLang keeps
    its own result."""
    refuse_unfit_layout(server_args)


def refuse_unfit_layout(server_args: Any) -> None:
    """Raises SystemExit naming the argument when the engine's *server_args* cannot carry the
    bicache KV layout (``records.unfit_layout``; a pool SGLang sizes itself is left to the
    scheduler). The scheduler checks the pool it builds the same way
    (``kv_layout_engine.after_init_running_status``), but only after SGLang has started it and
    loaded the model, some 20 s in on a CPU."""
    problem = unfit_layout(
        getattr(server_args, "max_total_tokens", None),
        getattr(server_args, "page_size", None),
        radix_cache_on=not getattr(server_args, "disable_radix_cache", False),
    )
    if problem is not None:
        logger.error("tandem plugin: cannot start: %s", problem)
        raise SystemExit(f"tandem plugin: cannot start: {problem}")


def register_prompt_shutdown() -> None:
    """Makes SIGTERM stop the engine at once rather than within 5 s.

    SGLang's HTTP process turns SIGTERM into a flag that its ``sigterm_watchdog`` task reads
    every 5 s, then drains the requests left and stops the scheduler. So an idle engine took
    5 s to stop: every `tandem serve` shutdown, every replica the supervisor replaces, every
    test engine. The hook reads the flag every :data:`SIGTERM_POLL_S` and then hands over to
    SGLang's own watchdog, which finds the flag set and drains and stops as before. Called in
    the process that loads the plugins before any of SGLang's managers (its main process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SIGTERM_WATCHDOG_SEAM, around_sigterm_watchdog, HookType.AROUND)


async def around_sigterm_watchdog(original: Any, tokenizer_manager: Any) -> None:
    """``TokenizerManager.sigterm_watchdog``, looking for the SIGTERM flag every
    :data:`SIGTERM_POLL_S`."""
    while not tokenizer_manager.gracefully_exit:
        await asyncio.sleep(SIGTERM_POLL_S)
    await original(tokenizer_manager)


DP_CONTROLLER_FUNCTION = "run_data_parallel_controller_process"
"""SGLang's entry point of the data-parallel controller process, which calls the plugin loader
first thing (sglang/srt/managers/data_parallel_controller.py)."""


def in_dp_controller() -> bool:
    """Whether this is SGLang's data-parallel controller process (its entry point's frame is on
    the stack while `register` runs): it routes requests to the DP ranks and schedules none."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == DP_CONTROLLER_FUNCTION:
            return True
        frame = frame.f_back
    return False


def scheduler_ranks() -> tuple[int, int, int | None, int]:
    """(tp_rank, pp_rank, dp_rank, TP ranks per DP rank) of this scheduler process.

    Read from the arguments of SGLang's `run_scheduler_process`, which calls the plugin loader
    first thing: its frame is on the stack while `register` runs, and nothing else holds the
    ranks yet. (0, 0, None, 1) outside it (a single scheduler, a test)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run_scheduler_process":
            local = frame.f_locals
            dp_rank = local.get("dp_rank")
            if dp_rank is None and "SGLANG_DP_RANK" in os.environ:
                dp_rank = int(os.environ["SGLANG_DP_RANK"])
            args = local.get("server_args")
            tp_size = int(getattr(args, "tp_size", 1) or 1)
            dp_size = int(getattr(args, "dp_size", 1) or 1)
            # with DP attention the TP ranks span all DP ranks; else each DP rank has its own
            per_dp = tp_size // dp_size if getattr(args, "enable_dp_attention", False) else tp_size
            return (
                int(local.get("tp_rank") or 0),
                int(local.get("pp_rank") or 0),
                None if dp_rank is None else int(dp_rank),
                max(1, per_dp),
            )
        frame = frame.f_back
    return 0, 0, None, 1


def control_socket_of_rank(
    path: str | None, tp_rank: int, pp_rank: int, dp_rank: int | None, tp_per_dp: int
) -> str | None:
    """The control endpoint this scheduler serves, or None. Every TP/PP rank runs the same
    schedule, so only the first of each data-parallel rank serves one (two would fight over
    one socket, and the second refuses to start); DP rank k > 0 serves `<path>.dp<k>`, rank 0
    `path` itself, where the gateway reads it (it sees DP rank 0's state)."""
    if path is None or pp_rank != 0 or tp_rank % tp_per_dp != 0:
        return None
    dp = dp_rank if dp_rank is not None else tp_rank // tp_per_dp
    return path if dp == 0 else f"{path}.dp{dp}"


def after_create_generation_req(req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler._create_generation_req(self, recv_req, ...)`` → ``Req``.

    Returns None so that SGLang keeps its own ``Req`` (an AFTER hook's non-None return value
    would replace it).
    """
    attach_meta(req)


def attach_meta(req: Any) -> RequestMeta | None:
    """Parses *req*'s ``custom_params`` into ``req.tandem``; never raises."""
    meta: RequestMeta | None = None
    error: str | None = None
    try:
        meta = meta_of(getattr(getattr(req, "sampling_params", None), "custom_params", None))
    except Exception as exc:  # any client input: a warning, never a dead scheduler
        error = f"{type(exc).__name__}: {exc}"
        logger.warning("tandem: ignoring malformed metadata of request %s: %s", _rid(req), error)
    setattr(req, REQ_ATTR, meta)
    if _trace_path is not None:
        _write_trace(_trace_path, req, meta, error)
    return meta


def _rid(req: Any) -> str:
    return str(getattr(req, "rid", "?"))


def _write_trace(path: str, req: Any, meta: RequestMeta | None, error: str | None) -> None:
    record = {
        "event": "request",
        "pid": os.getpid(),
        "process": "scheduler",
        "rid": _rid(req),
        "priority": getattr(req, "priority", None),
        "meta": None if meta is None else trace_fields(meta, received_unix_s=time.time()),
        "error": error,
    }
    try:
        # One write() of one line on an O_APPEND file: lines from concurrent writers never mix.
        with open(path, "a", encoding="utf-8") as trace:
            trace.write(json.dumps(record, default=str) + "\n")
    except OSError as exc:
        logger.warning("tandem: cannot write scheduler trace %s: %s", path, exc)
