"""Starting and stopping the SGLang server as a child process (no SGLang import here).

    argv = server_argv(cfg.engine, model_dir, cfg.model.name,
                       random_weights=cfg.model.uses_random_weights)
    with EngineProcess(argv, engine_env(cfg.engine), base_url=engine_base_url(cfg.engine)) as eng:
        eng.wait_ready_sync(cfg.engine.startup_timeout_s)
        ...                                   # the engine is stopped on exit, children included

The engine runs in its own process group (SGLang's scheduler and detokenizer are children of
its main process), so :meth:`EngineProcess.stop` can signal all of them at once. It is never left
behind: on Linux the child asks the kernel to SIGKILL it when the parent dies (``prctl
PR_SET_PDEATHSIG``; SGLang's own children do the same towards their parent), and an ``atexit``
handler stops every engine still running when the interpreter exits normally.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO
from urllib.parse import urlsplit

import msgspec

from common.config import (
    ENGINE_SETTINGS_ENV,
    EngineConfig,
    EngineSettings,
    engine_slowdown_schedule,
)

PLUGIN_NAME = "tandem"  # the entry-point name in pyproject.toml (= backend.sglang_ext.plugin)
CPU_ATTENTION_PLUGIN_NAME = "tandem_cpu_attention"
"""The entry point of ``backend.sglang_ext.cpu_attention`` (engine.torch_native_extend)."""
PACE_PLUGIN_NAME = "tandem_pace"
"""The entry point of ``backend.sglang_ext.pace`` (engine.slowdown)."""
NO_PLUGINS = "none"  # an SGLANG_PLUGINS value naming no installed plugin: load nothing
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message holds its log tail."""


def engine_base_url(engine_cfg: EngineConfig) -> str:
    """``http://host:port`` of the engine described by *engine_cfg*."""
    return f"http://{engine_cfg.host}:{engine_cfg.port}"


def has_weights(model_path: Path) -> bool:
    """True when *model_path* holds weight files."""
    return any(p.suffix in WEIGHT_SUFFIXES for p in Path(model_path).iterdir())


def missing_weights(model_path: Path) -> str | None:
    """None when *model_path* holds weight files; else one line naming the directory and what
    it lacks."""
    if has_weights(model_path):
        return None
    patterns = ", ".join(f"*{suffix}" for suffix in WEIGHT_SUFFIXES)
    return f"{model_path} holds no weight files ({patterns})"


def server_argv(
    engine_cfg: EngineConfig, model_path: Path, model_name: str, *, random_weights: bool = False
) -> list[str]:
    """The command line that runs SGLang's HTTP server for *engine_cfg* and *model_path*.

    *random_weights*: serve random weights (``--load-format dummy``), as for the built-in tiny
    model, which has none; else the directory's weights are loaded, and a directory without
    weight files is a ValueError (SGLang would silently serve random weights). On CPU the
    attention backend is torch-native, CUDA graphs are off and the idle scheduler sleeps.
    ``engine_cfg.extra_args`` come last.
    """
    missing = None if random_weights else missing_weights(model_path)
    if missing is not None:
        raise ValueError(f"{missing}; random weights must be asked for (model.random_weights)")
    if engine_cfg.api_key and "--config" in engine_cfg.extra_args:
        raise ValueError(
            "engine.extra_args: --config cannot be combined with engine.api_key (the key "
            "reaches the engine in a config file of its own)"
        )
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--served-model-name", model_name,
        "--host", engine_cfg.host,
        "--port", str(engine_cfg.port),
        "--device", engine_cfg.device,
        "--dtype", engine_cfg.dtype,
        "--max-total-tokens", str(engine_cfg.max_total_tokens),
        "--max-running-requests", str(engine_cfg.max_running_requests),
        "--chunked-prefill-size", str(engine_cfg.chunked_prefill_size),
        "--log-level", "warning",
        # Decodes ride along with prefill chunks instead of waiting for the whole prefill
        # (verified on the CPU engine: long prompts during concurrent decodes, no errors).
        "--enable-mixed-chunk",
        # Puts queue_time, request_received_ts, first_token_latency, ... into each response's
        # meta_info (the gateway's usage records need the queue time), and serves /metrics.
        "--enable-metrics",
        # A response_format answer is compact JSON: with whitespace allowed anywhere, the
        # grammar lets a weak (or random-weight) model pad with blanks until max_tokens and
        # never close the object.
        "--constrained-json-disable-any-whitespace",
    ]  # fmt: skip
    if random_weights:
        argv += ["--load-format", "dummy"]
    if engine_cfg.device == "cpu":
        argv += ["--attention-backend", "torch_native"]
        # --disable-cuda-graph is deprecated in 0.5.23 in favour of these two.
        argv += ["--cuda-graph-backend-decode", "disabled"]
        argv += ["--cuda-graph-backend-prefill", "disabled"]
        # Without it the idle scheduler busy-polls its sockets and burns a whole core, which
        # on a small CPU machine is a core taken from the gateway and the forward passes.
        argv.append("--sleep-on-idle")
    if engine_cfg.context_length is not None:
        argv += ["--context-length", str(engine_cfg.context_length)]
    if engine_cfg.enable_priority_scheduling:
        argv.append("--enable-priority-scheduling")
    if engine_cfg.policy_in_charge:
        # The policy's plan is carried out within one scheduler iteration; with overlap
        # scheduling a batch would still be in flight while the next is planned (SGLang already
        # turns overlap off on CPU; this makes GPUs behave the same).
        argv.append("--disable-overlap-schedule")
    if engine_cfg.kv_layout == "bicache":
        # The bicache layout frees whole requests; slots the radix tree kept would outlive them.
        argv.append("--disable-radix-cache")
    if engine_cfg.api_key:
        argv += api_key_args(engine_cfg.api_key)
    return argv + list(engine_cfg.extra_args)


KEY_DIR_PREFIX = "tandem-engine-key-"
"""Temporary directories holding an engine's API key file: ``<prefix><pid>-<random>``, the pid
of the process that wrote it."""


def api_key_args(api_key: str) -> list[str]:
    """``--config FILE``: the engine's API key (SGLang's ``--api-key``) in a file only this user
    can read (0600, in a 0700 directory removed at exit), so that it never shows on the engine's
    command line, which every user of the host can read (``ps``). A process killed before its
    exit handlers ran (SIGKILL) leaves its directory behind: the next call removes those of
    processes that no longer run (`remove_orphaned_key_dirs`)."""
    remove_orphaned_key_dirs()
    directory = Path(tempfile.mkdtemp(prefix=f"{KEY_DIR_PREFIX}{os.getpid()}-"))
    atexit.register(shutil.rmtree, directory, True)
    path = directory / "api-key.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML scalar
    return ["--config", str(path)]


def remove_orphaned_key_dirs(tmp_dir: str | Path | None = None) -> list[Path]:
    """Removes this user's API-key directories whose writing process no longer runs (a
    `tandem serve` that was SIGKILLed: its engines' key stayed on disk); the ones removed.
    Directories of live processes, of other users, or without a pid in their name are kept."""
    removed = []
    for path in Path(tmp_dir or tempfile.gettempdir()).glob(f"{KEY_DIR_PREFIX}*"):
        pid_text = path.name[len(KEY_DIR_PREFIX) :].split("-", 1)[0]
        try:
            if not pid_text.isdigit() or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:  # the writer is gone
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:  # not ours to signal (alive), or gone meanwhile
            continue
    return removed


def engine_settings(
    engine_cfg: EngineConfig,
    *,
    scheduler_trace: str | Path | None = None,
    profile_path: str | Path | None = None,
    engine_key: str | None = None,
) -> EngineSettings:
    """tandem's settings for the engine process that *engine_cfg* describes (the policy only
    when it is in charge: patch on and a policy named). *scheduler_trace*: a debug trace file
    (see ``EngineSettings.scheduler_trace``).

    The policy's profile is *profile_path* when given (`tandem serve` passes the one it chose
    for this engine, ``tandem.engine_profile``), else ``engine.profile`` resolved; "auto" there
    resolves to the device's bundled profile (an engine launched by a test or a study, which
    knows no measured one). *engine_key*: the engine's profile key, for its statistics.
    Raises ValueError for an unknown policy or profile, before any process starts."""
    trace = None if scheduler_trace is None else str(scheduler_trace)
    slowdown = engine_slowdown_schedule(engine_cfg)
    if not engine_cfg.policy_in_charge:
        return EngineSettings(
            kv_layout=engine_cfg.kv_layout,
            scheduler_trace=trace,
            slowdown=slowdown,
            slowdown_start_file=engine_cfg.slowdown_start_file,
        )
    from backend.policy.profiles import AUTO, bundled_profile_for, resolve_profile
    from backend.policy.registry import POLICY_NAMES

    if engine_cfg.policy not in POLICY_NAMES:
        raise ValueError(
            f"engine.policy {engine_cfg.policy!r} is not a policy; valid: "
            f"none, {', '.join(POLICY_NAMES)}"
        )
    if profile_path is None:
        name = engine_cfg.profile
        profile_path = resolve_profile(
            bundled_profile_for(engine_cfg.device, engine_cfg.torch_native_extend)
            if name == AUTO
            else name
        )
    return EngineSettings(
        policy=engine_cfg.policy,
        profile_path=str(profile_path),
        policy_options=dict(engine_cfg.policy_options),
        control_socket=engine_cfg.control_socket_path,
        engine_key=engine_key,
        kv_layout=engine_cfg.kv_layout,
        scheduler_trace=trace,
        slowdown=slowdown,
        slowdown_start_file=engine_cfg.slowdown_start_file,
    )


CPU_THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
"""SGLang's CPU cores per rank ("0,1|2,3": rank i gets the i-th group). Without it SGLang
allows one rank per NUMA node, so an engine with data or tensor parallelism on an ordinary
one-node CPU host dies at start; `engine_env` sets it unless the operator did."""
TP_SIZE_FLAGS = ("--tp-size", "--tp", "--tensor-parallel-size")
"""SGLang's spellings of its tensor-parallel size flag."""


def tp_size_of(args: Sequence[str]) -> int:
    """The tensor-parallel size *args* give SGLang (its last flag), 1 without one (SGLang
    itself refuses a bad value)."""
    size = 1
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in TP_SIZE_FLAGS:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            size = int(value) if value.isdigit() and int(value) > 0 else size
    return size


def cpu_threads_bind(ranks: int, cpus: Sequence[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND splitting *cpus* into *ranks* groups of consecutive cores,
    as even as they come (with fewer cores than ranks, ranks share them round-robin)."""
    if len(cpus) < ranks:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))
    groups = []
    for i in range(ranks):
        lo, hi = i * len(cpus) // ranks, (i + 1) * len(cpus) // ranks
        groups.append(",".join(str(c) for c in cpus[lo:hi]))
    return "|".join(groups)


def engine_env(
    engine_cfg: EngineConfig,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
    *,
    scheduler_trace: str | Path | None = None,
    profile_path: str | Path | None = None,
    engine_key: str | None = None,
) -> dict[str, str]:
    """The engine's environment: *base* (default ``os.environ``) with tandem's settings, then
    *extra*.

    * ``SGLANG_USE_CPU_ENGINE=1`` on CPU: without it SGLang's ``is_cpu()`` is False and rotary
      embeddings fall back to vLLM's CUDA ops.
    * ``SGLANG_CPU_OMP_THREADS_BIND`` on CPU with data or tensor parallelism, unless given: the
      allowed cores split among the ranks (:func:`cpu_threads_bind`).
    * ``OMP_NUM_THREADS`` = ``engine.cpu_threads`` on CPU when set (torch's threads per engine
      process; it overrides one in *base*, since the config says so).
    * ``SGLANG_PLUGINS``: SGLang loads *every* installed plugin when the variable is empty, so
      "patch off" must name a list without tandem (``none`` when nothing else is left) for the
      engine to be stock SGLang; "patch on" adds ``tandem`` to whatever list is given, and
      ``engine.torch_native_extend: new-rows`` adds ``tandem_cpu_attention`` and
      ``engine.slowdown`` adds ``tandem_pace``, patch on or off.
    * ``TANDEM_ENGINE_SETTINGS``: :func:`engine_settings` as JSON (*scheduler_trace*,
      *profile_path* and *engine_key* as there), all the plugin reads (decoded by
      ``common.config.engine_settings_from_env`` in the scheduler process).
    """
    env = dict(os.environ if base is None else base)
    if engine_cfg.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if engine_cfg.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(engine_cfg.cpu_threads)
        ranks = engine_cfg.dp_size * tp_size_of(engine_cfg.extra_args)
        if ranks > 1 and not env.get(CPU_THREADS_BIND_ENV):
            env[CPU_THREADS_BIND_ENV] = cpu_threads_bind(ranks, sorted(os.sched_getaffinity(0)))
    plugins = [p.strip() for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    ours = (PLUGIN_NAME, CPU_ATTENTION_PLUGIN_NAME, PACE_PLUGIN_NAME, NO_PLUGINS)
    plugins = [p for p in plugins if p not in ours]
    if engine_cfg.patch:
        plugins.append(PLUGIN_NAME)
    if engine_cfg.torch_native_extend == "new-rows":
        plugins.append(CPU_ATTENTION_PLUGIN_NAME)
    if engine_cfg.slowdown is not None:
        plugins.append(PACE_PLUGIN_NAME)
    env["SGLANG_PLUGINS"] = ",".join(plugins) or NO_PLUGINS
    settings = engine_settings(
        engine_cfg,
        scheduler_trace=scheduler_trace,
        profile_path=profile_path,
        engine_key=engine_key,
    )
    env[ENGINE_SETTINGS_ENV] = msgspec.json.encode(settings).decode()
    env.update(extra or {})
    return env


class EngineProcess:
    """One SGLang server process group: start, wait until healthy, stop (idempotent)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        base_url: str,
        log_path: str | Path | None = None,
    ) -> None:
        """*log_path*: where stdout and stderr go (appended); None: inherited from the parent."""
        self.argv = list(argv)
        self.env = dict(env)
        self.base_url = base_url.rstrip("/")
        self.log_path = None if log_path is None else Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The engine's main process id (also its process group id), None before start."""
        return None if self._proc is None else self._proc.pid

    @property
    def is_running(self) -> bool:
        """True between start() and the main process's exit."""
        return self._proc is not None and _exit_status(self._proc) is None

    @property
    def returncode(self) -> int | None:
        """The main process's exit status once it has exited (negative: the signal that killed
        it), else None."""
        return None if self._proc is None else _exit_status(self._proc)

    def start(self) -> None:
        """Launches the server in a new session (so its own process group); returns at once.

        An engine whose previous process has exited may be started again (a supervisor's
        restart): what is left of the old one is stopped and reaped first."""
        if self.is_running:
            raise RuntimeError("engine already started")
        if self._proc is not None:
            self.stop()  # reaps it, if that is not done yet
            self._proc = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so it is armed only when
        # starting from the main thread; other starts rely on the atexit handler and stop().
        on_main_thread = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()) if on_main_thread else None,
        )
        _live.add(self)

    def wait_ready_sync(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Blocks until ``GET /health`` answers 200; raises EngineStartError on exit/timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            if _health_sync(self.base_url) == 200:
                return
            if time.monotonic() > deadline:
                raise EngineStartError(self._failure(f"not healthy after {timeout_s:.0f} s"))
            time.sleep(poll_s)

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Async :meth:`wait_ready_sync` (polls without blocking the event loop)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            if await health_status(self.base_url) == 200:
                return
            if time.monotonic() > deadline:
                raise EngineStartError(self._failure(f"not healthy after {timeout_s:.0f} s"))
            await asyncio.sleep(poll_s)

    async def wait_exit(self, poll_s: float = 0.5) -> int:
        """Waits (without blocking the event loop) until the main process exits, reaps it and
        returns its exit status. On Linux a pidfd wakes the loop the moment it exits; elsewhere
        its status is polled every *poll_s*."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("engine not started")
        if _exit_status(proc) is not None:
            return _reap(proc)
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # not Linux ≥ 5.3
            pidfd = None
        if pidfd is None:
            while _exit_status(proc) is None:
                await asyncio.sleep(poll_s)
            return _reap(proc)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return _reap(proc)  # no zombie is left behind, nor anything of its group

    def kill(self) -> int | None:
        """SIGKILL to the whole group at once (an engine that no longer answers gets no chance
        to drain), reaping the main process; its exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:  # not reaped: its pid still names its group
            _signal_group(proc.pid, signal.SIGKILL)
        return self.stop(timeout_s=5.0)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to *timeout_s*, then SIGKILL to the whole group; the exit code.

        SIGTERM goes to the main process only: SGLang then drains and stops its scheduler and
        detokenizer itself (1–2 s on CPU with tandem's plugin, which has SGLang look for the
        signal every 0.1 s rather than every 5 s; up to 5 s more on a stock engine). Signalling
        the group instead kills the scheduler first, and the main process, taking that for a
        crash, spends 5 s more on crash diagnostics.
        Idempotent: an engine already stopped (its process reaped) is not signalled again.
        """
        proc = self._proc
        if proc is None:
            return None
        if _exit_status(proc) is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _exit_status(proc) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        # Past the deadline the main process goes too; stragglers (a scheduler that ignored
        # SIGTERM) share the group: make sure of them.
        _reap(proc)
        if self._log is not None:
            self._log.close()
            self._log = None
        _live.discard(self)
        return proc.returncode

    def log_tail(self, max_bytes: int = 8000) -> str:
        """The end of the engine's log file ("" when its output is not captured)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
            return log.read().decode("utf-8", "replace")

    def __enter__(self) -> EngineProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _check_alive(self) -> None:
        if self._proc is None:
            raise RuntimeError("engine not started")
        code = _exit_status(self._proc)
        if code is not None:
            self.stop()  # reap whatever the main process left in its group
            raise EngineStartError(self._failure(f"exited with code {code}"))

    def _failure(self, what: str) -> str:
        tail = self.log_tail()
        where = f" (log: {self.log_path})" if self.log_path else ""
        return f"engine {what}{where}" + (f"\n--- log tail ---\n{tail}" if tail else "")


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn: on Linux, the kernel SIGKILLs the child when the parent dies."""
    # Resolved here, in the parent: after fork() only async-signal-safe work is wise (no dlopen).
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    pr_set_pdeathsig = 1

    def arm() -> None:
        if prctl is not None:
            prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return arm


def _exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status of *proc* once it has exited (negative: killed by that signal), else
    None — without reaping it: until `_reap`, its pid (and so the id of its process group) is
    still its own, so signalling the group cannot reach another process that reused the id."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (AttributeError, ChildProcessError, OSError):  # no waitid, or reaped elsewhere
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _reap(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILLs what is left of *proc*'s group, then reaps *proc* (waiting for it if it still
    runs); its exit status. Once reaped, the group is never signalled again: its id may name
    another process's group by then (pids are reused)."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, sig)


def _health_sync(base_url: str, timeout_s: float = 5.0) -> int | None:
    """The status of ``GET /health``; None when nothing answers.

    SGLang's /health runs a one-token generation and answers after at least 1 s.
    """
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


async def health_status(base_url: str, timeout_s: float = 5.0) -> int | None:
    """:func:`_health_sync` over asyncio streams (no HTTP client library needed)."""
    url = urlsplit(base_url)
    host = url.hostname or "127.0.0.1"
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, url.port)
            writer.write(f"GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()  # b"HTTP/1.1 200 OK\r\n"
        return int(status_line.split()[1])
    except (OSError, TimeoutError, ValueError, IndexError):
        return None
    finally:
        if writer is not None:
            writer.close()


# Engines started by this process and not yet stopped (strong references: an engine object that
# is dropped without stop() must still be stopped at interpreter exit).
_live: set[EngineProcess] = set()


@atexit.register
def _stop_all() -> None:
    for engine in list(_live):
        engine.stop(timeout_s=5.0)
