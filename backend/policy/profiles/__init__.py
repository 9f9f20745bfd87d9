"""The latency profiles shipped with tandem (NAME.json beside this file), read by the latency
model (backend/policy/latency.py). Pure: pathlib only, so the command line can name them cheaply.
"""

from __future__ import annotations

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent
"""Where named latency profiles live (NAME.json)."""

AUTO = "auto"
"""The `engine.profile` value that asks for the profile measured for the served engine."""

BUNDLED_BY_DEVICE = {"cpu": "cpu-tiny", "cuda": "h100-llama8b-analytic"}
"""The shipped profile that stands in for an engine on each device when none was measured
for it (it matches no engine but the one it came from)."""


BUNDLED_CPU_STOCK_ATTENTION = "cpu-tiny-stock"
"""The CPU stand-in for an engine on SGLang's own prompt attention (`engine.torch_native_extend:
stock`): every chunk computed over the whole sequence, so a chunk's time grows with its prefix
squared, which cpu-tiny (tandem's new-rows kernel) does not show."""


def bundled_profile_for(device: str, torch_native_extend: str = "new-rows") -> str:
    """The name of the bundled stand-in profile for *device* (cpu-tiny for any unknown one) and
    the CPU engine's prompt attention (`engine.torch_native_extend`)."""
    name = BUNDLED_BY_DEVICE.get(device, BUNDLED_BY_DEVICE["cpu"])
    if name == BUNDLED_BY_DEVICE["cpu"] and torch_native_extend == "stock":
        return BUNDLED_CPU_STOCK_ATTENTION
    return name


def resolve_profile(name_or_path: str) -> Path:
    """A profile file: a path as given, or NAME → backend/policy/profiles/NAME.json.

    Raises ValueError naming the known profiles when there is no such file."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" or path.parent != Path(".") or path.is_file():
        if not path.is_file():
            raise ValueError(f"profile file not found: {name_or_path}")
        return path
    named = PROFILES_DIR / f"{name_or_path}.json"
    if not named.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ValueError(
            f"unknown profile {name_or_path!r} (known: {', '.join(known) or 'none'}; "
            "or give a .json file)"
        )
    return named
