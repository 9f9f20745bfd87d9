"""tandem's SGLang plugin: the entry point SGLang's ``load_plugins()`` calls in each process.

Declared in pyproject.toml (entry-point group ``sglang.srt.plugins``, name ``tandem``) and enabled
by ``SGLANG_PLUGINS=tandem`` (``backend.launch.sglang.engine_env`` sets it). SGLang calls
:func:`register` once in every one of its processes — the HTTP/tokenizer main process, the
scheduler and the detokenizer — before the scheduler object is built, so hooks registered here
are in place before ``Scheduler.__init__`` captures any bound method.

What it hooks (:data:`SEAMS`; ``tests/unit/test_sglang_seams.py`` checks that each still exists
in the pinned SGLang):

* AFTER ``Scheduler._create_generation_req`` (SGLang's documented "extension point for
  request-local state"): parse ``req.sampling_params.custom_params`` into a
  :class:`~backend.sglang_ext.request_meta.SchedReqMeta` and attach it as ``req.tandem``
  (None when absent or malformed — a bad client dict must never kill the scheduler).

With ``TANDEM_ENGINE_POLICY=<name>`` (a ``backend.policy.registry`` name; the launcher sets it
unless ``engine.policy`` is ``none``) the plugin also puts that policy in charge of the
scheduler: it builds an :class:`~backend.sglang_ext.driver.EngineDriver` around the policy (latency
model fitted from ``TANDEM_ENGINE_PROFILE``, options from ``TANDEM_ENGINE_POLICY_OPTIONS``, a JSON
object), registers the co-location hooks of ``backend.sglang_ext.hooks`` and serves the control
endpoint on ``TANDEM_CONTROL_SOCKET``. Without it the engine schedules like stock SGLang and only
carries the metadata.

Debug trace: with ``TANDEM_SCHEDULER_TRACE=<path>`` in the engine's environment, the scheduler
process appends one JSON line per request it creates::

    {"event": "request", "pid": ..., "process": "scheduler", "rid": ..., "priority": ...,
     "meta": {...every SchedReqMeta field...} | null, "error": null | "..."}

Other processes: the hook only fires where ``_create_generation_req`` is called, which is the
scheduler. :func:`register` also skips processes that have not imported the scheduler module, so
the plugin never pulls the scheduler (and torch kernels) into a process that does not need it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from backend.sglang_ext.request_meta import (
    REQ_ATTR,
    SchedReqMeta,
    get_meta,
    sched_meta_from_custom_params,
    sched_meta_to_dict,
)
from backend.sglang_ext.seams import CREATE_REQ_SEAM, SEAMS

logger = logging.getLogger(__name__)

PLUGIN_NAME = "tandem"
"""The entry-point name (pyproject.toml) that ``SGLANG_PLUGINS`` must list."""
TRACE_ENV = "TANDEM_SCHEDULER_TRACE"
"""Environment variable naming the scheduler's debug trace file (JSON lines)."""
POLICY_ENV = "TANDEM_ENGINE_POLICY"
"""Policy that schedules the engine (a registry name); unset, empty or "none": stock SGLang."""
PROFILE_ENV = "TANDEM_ENGINE_PROFILE"
"""Latency profile file the in-engine policy's latency model is fitted from."""
OPTIONS_ENV = "TANDEM_ENGINE_POLICY_OPTIONS"
"""JSON object of options for the policy's constructor (e.g. {"latency_budget_s": 0.1})."""
CONTROL_ENV = "TANDEM_CONTROL_SOCKET"
"""Unix socket path of the control endpoint (length-history pushes, statistics)."""
__all__ = ["REQ_ATTR", "SEAMS", "get_meta", "register"]

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"

# The trace path is read once, at registration (this module is the backend's one place that
# reads it). None: no trace.
_trace_path: str | None = None


def register() -> None:
    """Entry point for ``sglang.srt.plugins``: registers tandem's hooks in this process."""
    global _trace_path
    if SCHEDULER_MODULE not in sys.modules:
        # Not a process that runs the scheduler (the scheduler process always has the module:
        # load_plugins() is called from inside it); nothing to do, and nothing to import.
        logger.debug("tandem plugin: no scheduler in pid %d, nothing registered", os.getpid())
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _trace_path = os.environ.get(TRACE_ENV) or None
    HookRegistry.register(CREATE_REQ_SEAM, after_create_generation_req, HookType.AFTER)
    policy_name = os.environ.get(POLICY_ENV, "").strip()
    if policy_name and policy_name != "none":
        _install_policy(policy_name)
    if os.environ.get("TANDEM_KV_LAYOUT", "").strip() == "bicache":  # engine.kv_layout
        from backend.sglang_ext import kv_layout_engine

        kv_layout_engine.install()
    logger.info(
        "tandem plugin registered in pid %d (policy: %s, trace: %s)",
        os.getpid(),
        policy_name or "none",
        _trace_path,
    )


def _install_policy(policy_name: str) -> None:
    """Puts *policy_name* in charge of this scheduler process (fails loudly: an engine asked
    to run a policy must not silently fall back to stock scheduling)."""
    from backend.policy.latency import LatencyModel, load_profile
    from backend.policy.registry import make_policy
    from backend.sglang_ext import control, hooks
    from backend.sglang_ext.driver import EngineDriver

    profile_path = os.environ.get(PROFILE_ENV)
    if not profile_path:
        raise RuntimeError(f"tandem: {POLICY_ENV}={policy_name} needs {PROFILE_ENV}")
    options = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
    if not isinstance(options, dict):
        raise RuntimeError(f"tandem: {OPTIONS_ENV} must be a JSON object")
    latency = LatencyModel.fit(load_profile(profile_path).samples)
    driver = EngineDriver(make_policy(policy_name, latency, **options))
    hooks.install(driver)
    socket_path = os.environ.get(CONTROL_ENV)
    if socket_path:
        control.start(driver, socket_path)


def after_create_generation_req(req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler._create_generation_req(self, recv_req, ...)`` → ``Req``.

    Returns None so that SGLang keeps its own ``Req`` (an AFTER hook's non-None return value
    would replace it).
    """
    attach_meta(req)


def attach_meta(req: Any) -> SchedReqMeta | None:
    """Parses *req*'s ``custom_params`` into ``req.tandem``; never raises."""
    meta: SchedReqMeta | None = None
    error: str | None = None
    try:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        meta = sched_meta_from_custom_params(params)
    except Exception as exc:  # any client input: a warning, never a dead scheduler
        error = f"{type(exc).__name__}: {exc}"
        logger.warning("tandem: ignoring malformed metadata of request %s: %s", _rid(req), error)
    setattr(req, REQ_ATTR, meta)
    if _trace_path is not None:
        _write_trace(_trace_path, req, meta, error)
    return meta


def _rid(req: Any) -> str:
    return str(getattr(req, "rid", "?"))


def _write_trace(path: str, req: Any, meta: SchedReqMeta | None, error: str | None) -> None:
    record = {
        "event": "request",
        "pid": os.getpid(),
        "process": "scheduler",
        "rid": _rid(req),
        "priority": getattr(req, "priority", None),
        "meta": None if meta is None else sched_meta_to_dict(meta),
        "error": error,
    }
    try:
        # One write() of one line on an O_APPEND file: lines from concurrent writers never mix.
        with open(path, "a", encoding="utf-8") as trace:
            trace.write(json.dumps(record, default=str) + "\n")
    except OSError as exc:
        logger.warning("tandem: cannot write scheduler trace %s: %s", path, exc)
