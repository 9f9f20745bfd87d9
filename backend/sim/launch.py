"""The simulator as an engine process for `tandem serve` (`engine.kind: sim`): its command line.

The process itself is managed by the same handle as SGLang's (backend.sglang_ext.launcher's
EngineProcess, which imports nothing from SGLang).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gateway.config import EngineConfig

PROFILES_DIR = Path(__file__).resolve().parents[2] / "bench" / "profiles"


def resolve_profile(name_or_path: str) -> Path:
    """A profile file: a path as given, or NAME → bench/profiles/NAME.json."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" or path.parent != Path("."):
        candidate = path
    else:
        candidate = PROFILES_DIR / f"{name_or_path}.json"
    if not candidate.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"no latency profile {name_or_path!r} (known: {', '.join(known)})")
    return candidate


def sim_argv(engine_cfg: EngineConfig, model_name: str) -> list[str]:
    """`python -m backend.sim.server …` for this engine config."""
    argv = [
        sys.executable,
        "-m",
        "backend.sim.server",
        "--profile",
        str(resolve_profile(engine_cfg.sim_profile)),
        "--host",
        engine_cfg.host,
        "--port",
        str(engine_cfg.port),
        "--policy",
        engine_cfg.sim_policy,
        "--model-name",
        model_name,
    ]
    if engine_cfg.sim_kv_tokens is not None:
        argv += ["--kv-tokens", str(engine_cfg.sim_kv_tokens)]
    return argv + list(engine_cfg.extra_args)
