"""The latency profile of the engine `tandem serve` runs: found by its key, else measured.

A profile only describes the engine it was measured on, so profiles are keyed by what
determines speed (``backend.policy.profile_key``: model shape, dtype, device, parallelism, KV
pool, chunk size, attention backend, SGLang version, extra flags). With ``engine.profile: auto``
(the default) `tandem serve` looks for ``<profile_cache_dir>/<key>.json``; when there is none it
measures one before the gateway takes traffic:

1. start the engine exactly as configured but with SGLang's own scheduling (policy none: the
   probes shape each iteration themselves, as `tandem profile --launch` does),
2. run the profiler's quick grid over HTTP (``bench.profiler``; progress lines on stderr),
3. store the profile under its key (written whole, then renamed: a crash leaves no half file),
4. stop that engine; `tandem serve` then starts the served one with the profile.

Why a second engine start rather than handing the profile to the running engine: the policy is
built from its profile when SGLang's scheduler starts (``backend.sglang_ext.plugin``), and the
probes must not run under that policy (it would cut chunks and park decodes). A restart costs one
engine start (about 30 s on CPU) once per engine key, and keeps one code path for building the
policy. Later starts find the stored profile and measure nothing.

``engine.skip_profile`` (``--skip-profile``) never measures: the stored profile when there is
one, else the device's bundled profile. A profile that was not measured on the served engine
(another key, or none) is still used, but never silently: one warning names both keys and what
differs, and the engine's ``/stats`` reports ``profile_matches: false``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from backend.launch.identity import engine_identity
from backend.launch.sglang import (
    EngineProcess,
    EngineStartError,
    engine_base_url,
    engine_env,
    server_argv,
)
from backend.policy.latency import Profile, load_profile, save_profile
from backend.policy.profile_key import EngineIdentity, identity_differences, profile_key
from backend.policy.profiles import AUTO, bundled_profile_for, resolve_profile
from common.config import Config, ConfigError, new_engine_api_key
from tandem.errors import CliError

log = logging.getLogger("tandem")

MIN_SAMPLES = 3
"""Fewest measured points a latency model can be fitted from (LatencyModel.fit)."""
MAX_DIFFERENCES_SHOWN = 4
"""Identity differences named in a mismatch warning (the rest are counted)."""


@dataclass(frozen=True)
class ChosenProfile:
    """The profile the served engine's policy plans with."""

    path: Path
    """The profile file."""
    name: str
    """The profile's name."""
    engine_key: str
    """The served engine's profile key."""
    matches: bool
    """True when the profile was measured on the served engine (same key)."""
    measured: bool
    """True when it was measured by this start."""


def profile_cache_dir(config: Config) -> Path:
    """Where measured profiles are stored: ``engine.profile_cache_dir``, else ``profiles/``
    under ``model.cache_dir``."""
    if config.engine.profile_cache_dir:
        return Path(config.engine.profile_cache_dir).expanduser()
    return Path(config.model.cache_dir).expanduser() / "profiles"


def needs_profile(config: Config) -> bool:
    """True when `tandem serve` starts an engine whose policy plans with a profile."""
    launches = config.engine.launch and not config.engine.endpoints
    return launches and config.engine.policy_in_charge


def choose_profile(config: Config, model_dir: Path) -> ChosenProfile:
    """The profile for the engine *config* launches on *model_dir* (measured here when the
    module docstring says so). Raises ConfigError for a profile that cannot be read and
    CliError when measuring fails."""
    try:
        identity = engine_identity(config.engine, model_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    key = profile_key(identity)
    if config.engine.profile != AUTO:
        return _use(_named(config.engine.profile), key, identity)
    cached = profile_cache_dir(config) / f"{key}.json"
    if cached.is_file():
        try:
            profile = load_profile(cached)
        except ValueError as exc:
            profile = None
            log.warning("the stored profile is unreadable (%s); measuring it again", exc)
        if profile is not None and profile.key == key:
            log.info("latency profile: the one measured for this engine (key %s): %s", key, cached)
            return ChosenProfile(cached, profile.name, key, matches=True, measured=False)
        if profile is not None:
            log.warning(
                "the stored profile %s holds key %s; measuring it again", cached, profile.key
            )
    if config.engine.skip_profile:
        name = bundled_profile_for(config.engine.device, config.engine.torch_native_extend)
        log.info("latency profile: none stored for this engine (key %s), not measuring "
                 "(skip_profile); using the bundled %s", key, name)  # fmt: skip
        return _use(_named(name), key, identity)
    measure_profile(config, model_dir, identity, cached)
    return ChosenProfile(cached, load_profile(cached).name, key, matches=True, measured=True)


def _named(name: str) -> Path:
    try:
        return resolve_profile(name)
    except ValueError as exc:
        raise ConfigError(f"engine.profile: {exc}") from None


def _use(path: Path, key: str, identity: EngineIdentity) -> ChosenProfile:
    """*path* as the served engine's profile, with a warning when it was measured elsewhere."""
    try:
        profile = load_profile(path)
    except ValueError as exc:
        raise ConfigError(f"engine.profile: {exc}") from None
    matches = profile.key == key
    if not matches:
        log.warning("%s", mismatch_warning(profile, key, identity))
    else:
        log.info("latency profile: %s (measured on this engine, key %s)", path, key)
    return ChosenProfile(path, profile.name, key, matches=matches, measured=False)


def mismatch_warning(profile: Profile, key: str, identity: EngineIdentity) -> str:
    """One line: *profile* was not measured on the engine whose key and identity are given."""
    served = msgspec.to_builtins(identity)
    if profile.key is None:
        what = "it has no engine key (unkeyed)"
    else:
        diffs = identity_differences(profile.engine or {}, served)
        shown = "; ".join(diffs[:MAX_DIFFERENCES_SHOWN])
        more = (
            f" and {len(diffs) - MAX_DIFFERENCES_SHOWN} more"
            if len(diffs) > MAX_DIFFERENCES_SHOWN
            else ""
        )
        what = f"it was measured on key {profile.key} ({shown or 'unknown differences'}{more})"
    return (
        f"latency profile {profile.name!r} does not match the served engine (key {key}): "
        f"{what}; the policy's timings may be off (engine.profile auto measures this engine)"
    )


def measure_profile(config: Config, model_dir: Path, identity: EngineIdentity, out: Path) -> None:
    """Measures the quick grid on the configured engine run with SGLang's own scheduling, and
    stores the profile at *out* with the engine's key. Raises CliError when it fails."""
    from bench.profiler.measure import ProfileGrid, profile_engine
    from bench.profiler.probe import ProfilerError

    key = profile_key(identity)
    # policy none: SGLang's own scheduling is measured. The engine requires a key like the
    # served one (the configured key, else a fresh one): while it is measured nothing but this
    # process may talk to it, whoever else is on the host
    engine_cfg = msgspec.structs.replace(
        config.engine, policy="none", api_key=config.engine.api_key or new_engine_api_key()
    )
    log.info("latency profile: none stored for engine key %s; measuring one (quick grid) "
             "before serving, stored in %s", key, out.parent)  # fmt: skip
    engine = EngineProcess(
        server_argv(
            engine_cfg,
            model_dir,
            config.model.name,
            random_weights=config.model.uses_random_weights,
        ),
        engine_env(engine_cfg),
        base_url=engine_base_url(engine_cfg),
        log_path=engine_cfg.log_file,
    )
    started = time.monotonic()
    try:
        engine.start()
        engine.wait_ready_sync(engine_cfg.startup_timeout_s)
        log.info("latency profile: engine up for measuring; probing ...")
        probe_started = time.monotonic()
        profile = asyncio.run(
            profile_engine(
                engine.base_url,
                grid=ProfileGrid.quick(),
                name=f"auto-{key}",
                command="tandem serve (engine.profile auto)",
                progress=lambda line: log.info("latency profile: %s", line),
                headers=engine_cfg.auth_headers,
            )
        )
        probe_s = time.monotonic() - probe_started
    except (EngineStartError, ProfilerError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(
            f"measuring the engine's latency profile failed: {first} "
            "(rerun, or serve without measuring: --skip-profile)"
        ) from None
    finally:
        engine.stop()
    if len(profile.samples) < MIN_SAMPLES:
        raise CliError(
            f"measuring the engine's latency profile gave {len(profile.samples)} points, "
            f"fewer than {MIN_SAMPLES}: the engine's KV pool or chunk size is too small for "
            "the quick grid (measure one with `tandem profile` and name it in engine.profile)"
        )
    profile.key = key
    profile.engine = msgspec.to_builtins(identity)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.partial")
    save_profile(profile, partial)
    os.replace(partial, out)
    log.info(
        "latency profile: measured %d points in %.0f s (probes %.0f s); stored %s "
        "(delete it to measure again)",
        len(profile.samples),
        time.monotonic() - started,
        probe_s,
        out,
    )
