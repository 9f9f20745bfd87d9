"""`tandem serve`: migrate the database, choose (or measure) the engine's latency profile
(``tandem.engine_profile``), start the engine, then the gateway; stop both cleanly.

Each engine (``engine.replicas`` of them, on consecutive ports; none with ``engine.endpoints``)
runs in its own process group and is stopped (the whole group) however the gateway exits:
Ctrl-C, SIGTERM, or an error. While the gateway serves, each engine is supervised on its own
(``engine.supervise``): when it dies it is reaped, taken out of placement and restarted with a
back-off, and `/readyz` answers 503 only while no engine serves
(``backend/launch/supervisor.py``, ``gateway/engine/pool.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
from aiohttp import web

from backend.launch.sglang import (
    EngineProcess,
    EngineStartError,
    engine_base_url,
    engine_env,
    missing_weights,
    server_argv,
)
from backend.launch.sim import sim_argv
from backend.launch.supervisor import EngineStatus, EngineSupervisor, RestartPolicy
from backend.launch.tiny_model import ensure_tiny_model
from common.config import (
    Config,
    ConfigError,
    EngineConfig,
    ModelConfig,
    admin_token,
    new_engine_api_key,
    pool_engines,
)
from common.sockets import control_socket_error, port_error, remove_stale_socket
from gateway.app import create_app
from gateway.server import GuardedSite, runner_options
from gateway.shutdown import CUT_GRACE_S
from gateway.state import DRAIN, POOL
from tandem.database import migrate_database
from tandem.engine_profile import ChosenProfile, choose_profile, needs_profile
from tandem.errors import CliError

log = logging.getLogger("tandem")


def resolve_model_dir(model: ModelConfig, *, needs_weights: bool = True) -> Path:
    """The model directory: the configured one, or the built-in tiny model (created if needed).
    A configured one must hold weights unless `model.random_weights` asks for random ones, or
    *needs_weights* is false (no engine is launched from it: a gateway attached to engines
    started elsewhere reads only its tokenizer)."""
    if model.path is not None:
        path = Path(model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {path} is not a model directory (no config.json)")
        missing = None if model.random_weights or not needs_weights else missing_weights(path)
        if missing is not None:
            raise ConfigError(
                f"model.path: {missing}; set model.random_weights: true to serve it with "
                "random weights"
            )
        return path
    return ensure_tiny_model(Path(model.cache_dir).expanduser())


def _engine_argv(
    engine: EngineConfig, model_name: str, model_dir: Path, random_weights: bool
) -> list[str]:
    if engine.kind == "sim":
        try:
            return sim_argv(engine, model_name)
        except ValueError as exc:
            raise ConfigError(f"engine.sim_profile: {exc}") from None
    return server_argv(engine, model_dir, model_name, random_weights=random_weights)


def preflight(config: Config) -> None:
    """Raises CliError (status 1) naming the first port or control socket that `tandem serve`
    cannot have, before anything starts: the gateway's port, and for each engine it launches
    that engine's port and (patched engine) its control socket when another engine serves it."""
    problems = [port_error("gateway.port", config.gateway.host, config.gateway.port)]
    for replica in _launched_configs(config):
        problems.append(port_error("engine.port", replica.host, replica.port))
        if replica.policy_in_charge:
            problems.extend(
                control_socket_error(replica.control_socket_of_rank(rank))
                for rank in range(replica.dp_size)
            )
    for problem in problems:
        if problem is not None:
            raise CliError(problem, status=1)


def with_engine_api_key(config: Config) -> Config:
    """*config* with the key the engines it launches require (`engine.api_key`): the configured
    one, else a new random one (SGLang's engine only: the simulator takes no key)."""
    if config.engine.kind != "sglang" or config.engine.api_key:
        return config
    engine = msgspec.structs.replace(config.engine, api_key=new_engine_api_key())
    return msgspec.structs.replace(config, engine=engine)


def _launched_configs(config: Config) -> list[EngineConfig]:
    """The configs of the engines `tandem serve` launches: one per replica of
    `engine.replicas`, none when it attaches to engines started elsewhere."""
    if not config.engine.launch or config.engine.endpoints:
        return []
    return pool_engines(config.engine)


def _launched_engines(
    config: Config, model_dir: Path, chosen: ChosenProfile | None
) -> list[EngineProcess]:
    """The engine processes `tandem serve` starts (not started yet), one per launched config."""
    return [
        EngineProcess(
            _engine_argv(replica, config.model.name, model_dir, config.model.uses_random_weights),
            engine_env(
                replica,
                profile_path=None if chosen is None else chosen.path,
                engine_key=None if chosen is None else chosen.engine_key,
            ),
            base_url=engine_base_url(replica),
            log_path=replica.log_file,
        )
        for replica in _launched_configs(config)
    ]


def serve(config: Config) -> int:
    """Runs until interrupted; returns the exit status."""
    preflight(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # /readyz reads the revision often
    token = admin_token()
    migrate_database(config.database.url)
    launches_sglang = config.engine.kind == "sglang" and bool(_launched_configs(config))
    model_dir = resolve_model_dir(config.model, needs_weights=launches_sglang)
    log.info("model %s from %s", config.model.name, model_dir)
    try:
        chosen = choose_profile(config, model_dir) if needs_profile(config) else None
    except CliError as exc:  # measuring failed: a runtime failure, status 1
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    if config.engine.launch and not config.engine.endpoints:
        config = with_engine_api_key(config)
    engines = _launched_engines(config, model_dir, chosen)
    if config.engine.endpoints:
        log.info(
            "engine.endpoints: attaching to %d engines started elsewhere, launching none: %s",
            len(config.engine.endpoints),
            ", ".join(config.engine.endpoints),
        )
    for engine in engines:  # all at once: they start in parallel
        engine.start()
    try:
        for engine in engines:
            log.info("waiting for the engine at %s ...", engine.base_url)
            try:
                engine.wait_ready_sync(config.engine.startup_timeout_s)
            except EngineStartError as exc:
                print(f"tandem: error: the engine did not start: {exc}", file=sys.stderr)
                return 1
            log.info("engine %s ready", engine.base_url)
        if chosen is not None:  # the gateway's SLO admission forecasts on the engine's profile
            config = msgspec.structs.replace(
                config, engine=msgspec.structs.replace(config.engine, profile=str(chosen.path))
            )
        app = create_app(config, token, model_dir)
        if engines and config.engine.supervise:
            launched = _launched_configs(config)
            for index, engine in enumerate(engines):
                _supervise(app, index, engine, RestartPolicy.of(config.engine), launched[index])
        _run(run_gateway(app, config.gateway.host, config.gateway.port))
    finally:
        for engine in engines:
            engine.stop()
        for replica in _launched_configs(config):
            if replica.policy_in_charge:  # a killed scheduler leaves its socket file
                for rank in range(replica.dp_size):
                    remove_stale_socket(replica.control_socket_of_rank(rank))
    return 0


def _supervise(
    app: web.Application,
    index: int,
    engine: EngineProcess,
    policy: RestartPolicy,
    engine_cfg: EngineConfig,
) -> None:
    """While the gateway serves, replica *index*'s supervisor restarts it whenever it dies,
    and its view is the replica's health in the gateway's pool (what placement, /readyz and
    /metrics read) instead of a probe of the gateway's own."""
    # one health for the engine and all its data-parallel ranks (one process group)
    ranks = app[POOL].of_engine(index)
    health = ranks[0].take_supervision()
    for rank in ranks[1:]:
        rank.take_supervision()

    def show(status: EngineStatus) -> None:
        health.update(
            is_up=status.is_serving,
            state=status.phase,
            detail=status.detail,
            restarts=status.restarts,
        )

    async def supervising(app: web.Application) -> AsyncIterator[None]:
        # Appended after the app's own contexts, so it stops first: no restart while the
        # gateway shuts down (`serve` stops the engine once the gateway is gone).
        sockets = (
            [engine_cfg.control_socket_of_rank(rank) for rank in range(engine_cfg.dp_size)]
            if engine_cfg.policy_in_charge
            else []
        )
        supervisor = EngineSupervisor(engine, policy, on_status=show, scheduler_sockets=sockets)
        task = asyncio.create_task(supervisor.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(supervising)


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        asyncio.run(coro)  # type: ignore[arg-type]


async def run_gateway(app: web.Application, host: str, port: int) -> None:
    """Serves *app* until SIGINT or SIGTERM."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # engine request so its KV is freed at once
    # the requests in flight are drained by the app's on_shutdown (gateway/shutdown.py);
    # aiohttp's own wait after it only lets the ended ones write their last bytes
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=CUT_GRACE_S,
        **runner_options(app),
    )
    await runner.setup()
    try:
        site = GuardedSite(runner, host, port)  # with the connection cap (gateway/server.py)
        try:
            await site.start()
        except OSError as exc:  # taken since `preflight` looked
            why = port_error("gateway.port", host, port) or exc.strerror or str(exc)
            raise CliError(f"the gateway cannot listen: {why}", status=1) from None
        # Everything loaded so far (the tokenizer, SQLAlchemy's metadata, the app) lives as long
        # as the process: out of the collector's way, a full collection no longer walks it on
        # the event loop — the gateway's latency tail at 500 req/s.
        gc.collect()
        gc.freeze()
        log.info("gateway listening on http://%s:%d", host, port)
        print(f"tandem: serving on http://{host}:{port}", file=sys.stderr, flush=True)
        stop = asyncio.Event()

        def on_signal() -> None:
            if stop.is_set():  # a second one: what is still in flight ends now
                app[DRAIN].end_now()
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()
