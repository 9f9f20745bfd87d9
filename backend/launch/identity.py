"""The identity of the engine a config launches: the facts its latency profile depends on.

Gathered without starting the engine or importing torch or SGLang: the model's config.json,
the engine settings, the machine (``/proc/cpuinfo``; ``nvidia-smi`` for GPUs) and the installed
SGLang's version. ``backend.policy.profile_key`` digests them into the profile key.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from backend.policy.profile_key import EngineIdentity
from common.config import EngineConfig

MODEL_SPEED_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "torch_dtype",
    "quantization_config",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "kv_lora_rank",
    "sliding_window",
)
"""The config.json keys that change how long an iteration takes (names, paths and tokenizer
settings do not)."""

_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
_PP_FLAGS = ("--pp-size", "--pipeline-parallel-size", "--pp")


def engine_identity(engine_cfg: EngineConfig, model_dir: Path) -> EngineIdentity:
    """The identity of the SGLang engine *engine_cfg* runs on *model_dir* on this machine.

    Raises ValueError when the model's config.json cannot be read or a parallelism flag in
    ``engine.extra_args`` is not a positive integer."""
    tp = _int_flag(engine_cfg.extra_args, _TP_FLAGS, 1)
    pp = _int_flag(engine_cfg.extra_args, _PP_FLAGS, 1)
    default_backend = "torch_native" if engine_cfg.device == "cpu" else "default"
    if engine_cfg.device == "cpu":
        device_name, device_count = _cpu_name(), _cpu_count()
    else:
        device_name, device_count = _gpu_name(), tp * pp
    return EngineIdentity(
        model=model_speed_config(model_dir),
        dtype=engine_cfg.dtype,
        device=engine_cfg.device,
        device_name=device_name,
        device_count=device_count,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        kv_pool_tokens=engine_cfg.max_total_tokens,
        chunked_prefill_tokens=engine_cfg.chunked_prefill_size,
        attention_backend=_attention(engine_cfg, default_backend),
        kv_layout=engine_cfg.kv_layout,
        sglang_version=_version("sglang"),
        extra_args=list(engine_cfg.extra_args),
        cpu_threads=engine_cfg.cpu_threads if engine_cfg.device == "cpu" else None,
    )


def _attention(engine_cfg: EngineConfig, default_backend: str) -> str:
    """The attention backend's name, "+new-rows" after torch_native when tandem's prompt
    attention replaces SGLang's there (a different speed: ``backend.sglang_ext.cpu_attention``)."""
    backend = _flag(engine_cfg.extra_args, ("--attention-backend",)) or default_backend
    if backend == "torch_native" and engine_cfg.torch_native_extend == "new-rows":
        return f"{backend}+new-rows"
    return backend


def model_speed_config(model_dir: Path) -> dict[str, Any]:
    """The :data:`MODEL_SPEED_KEYS` of *model_dir*'s config.json (those it has)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"the model config {path} is not a JSON object")
    return {k: config[k] for k in MODEL_SPEED_KEYS if k in config}


def _flag(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of *names* in *argv* (``--flag V`` or ``--flag=V``), if any."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def _int_flag(argv: Sequence[str], names: Sequence[str], default: int) -> int:
    text = _flag(argv, names)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"engine.extra_args: {names[0]} must be a positive integer, got {text!r}")
    return value


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_count() -> int:
    # The cores this process may run on (a container's or taskset's share), which the engine
    # inherits; os.cpu_count() would count the host's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gpu_name() -> str:
    """The first visible GPU's name (nvidia-smi), "unknown" when it cannot be asked."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    argv = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    if visible:
        argv += ["-i", visible]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if lines else "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""
