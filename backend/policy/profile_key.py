"""What a latency profile was measured on, and a digest of it: the profile key.

A profile describes one engine's speed, and it only holds for an engine that runs the same
work on the same hardware the same way. :class:`EngineIdentity` lists what determines that
speed; :func:`profile_key` is a stable digest of it (the same facts always give the same key,
on any machine and Python version). `tandem serve` stores profiles it measures under their
key and looks them up by the served engine's key; a profile whose key differs from the served
engine's was measured on something else, and :func:`identity_differences` says what.

Pure: the facts are gathered elsewhere (``backend.launch.identity``); this module only compares
and digests them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import msgspec

KEY_HEX_CHARS = 16
"""Length of a profile key, hex digits (64 bits: no two engines of one cache collide)."""

KEY_VERSION = 1
"""Bumped when the identity's fields or their meaning change, so old keys stop matching."""


class EngineIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What determines one engine's iteration speed (every field is part of the key)."""

    model: dict[str, Any] = msgspec.field(default_factory=dict)
    """The model's shape from its config.json: architecture, hidden size, layers, heads,
    vocabulary, dtype, quantization, experts (only the keys the config has)."""
    dtype: str = ""
    """Dtype the engine runs the model in (SGLang's --dtype)."""
    device: str = ""
    """Torch device kind: "cpu" or "cuda"."""
    device_name: str = ""
    """The CPU model or the GPU name."""
    device_count: int = 0
    """CPU cores the engine may use, or GPUs it runs on (tensor × pipeline parallel)."""
    tensor_parallel: int = 1
    """Tensor-parallel degree, GPUs."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree, stages."""
    kv_pool_tokens: int = 0
    """Size of the KV pool, tokens (engine.max_total_tokens)."""
    chunked_prefill_tokens: int = 0
    """Largest prefill chunk per iteration, tokens (bounds the profile's prefill points)."""
    attention_backend: str = ""
    """SGLang's attention backend ("torch_native" on CPU; "default": SGLang chooses)."""
    kv_layout: str = "token"
    """tandem's KV slot layout ("token" or "bicache": the latter turns the radix cache off)."""
    sglang_version: str = ""
    """Installed SGLang version ("" when unknown)."""
    extra_args: list[str] = msgspec.field(default_factory=list)
    """Further SGLang flags (engine.extra_args): any of them may change the speed."""
    cpu_threads: int | None = None
    """Torch threads per engine process on CPU (engine.cpu_threads; None: torch's default).
    Left out of the key when None, so the keys of engines measured before the field existed
    still match."""


def profile_key(identity: EngineIdentity) -> str:
    """The identity's digest: :data:`KEY_HEX_CHARS` hex digits of SHA-256 over its canonical
    JSON (sorted keys, no whitespace) and :data:`KEY_VERSION`."""
    fields = msgspec.to_builtins(identity)
    if fields.get("cpu_threads") is None:
        fields.pop("cpu_threads", None)
    canonical = json.dumps(
        {"v": KEY_VERSION, **fields},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_HEX_CHARS]


def identity_differences(measured: Mapping[str, Any], served: Mapping[str, Any]) -> list[str]:
    """Each field in which two identities (as JSON objects) differ, as ``name: a → b``
    (``model.<key>`` for the model's shape), sorted by name."""
    out: list[str] = []
    for name in sorted(set(measured) | set(served)):
        a, b = measured.get(name), served.get(name)
        if name == "model" and isinstance(a, Mapping) and isinstance(b, Mapping):
            out += [
                f"model.{k}: {a.get(k)!r} → {b.get(k)!r}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            out.append(f"{name}: {a!r} → {b!r}")
    return out
