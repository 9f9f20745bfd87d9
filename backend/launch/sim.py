"""The simulator as an engine process for `tandem serve` (`engine.kind: sim`): its command line.

The process itself is managed by the same handle as SGLang's (backend.launch.sglang's
EngineProcess, which imports nothing from SGLang).
"""

from __future__ import annotations

import sys

from backend.policy.profiles import resolve_profile
from common.config import EngineConfig


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
