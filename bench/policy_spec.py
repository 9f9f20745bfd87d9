"""Policy specs on the bench command line: a registry name with constructor options.

    NAME[:KEY=VALUE[:KEY=VALUE …]]     e.g.  tandem:latency_budget_s=0.035:first_token_be_frac=0.5
                                              static-chunk:chunk_tokens=960

The whole spec is the policy's label in the report, so one run can compare settings of one
policy side by side. VALUE is read as an integer, a float, true/false, null (None: an option
that can be off, e.g. rt_stretch=null), or else a string; the policy's constructor validates
names and values (`backend.policy.registry.make_policy`).
"""

from __future__ import annotations

from typing import Any

SEPARATOR = ":"


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """(registry name, options) of `spec`; ValueError naming the spec when it is malformed."""
    name, *pairs = spec.split(SEPARATOR)
    if not name:
        raise ValueError(f"policy spec {spec!r}: no policy name before {SEPARATOR!r}")
    options: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key or not text:
            raise ValueError(
                f"policy spec {spec!r}: expected KEY=VALUE after {SEPARATOR!r}, got {pair!r}"
            )
        if key in options:
            raise ValueError(f"policy spec {spec!r}: option {key!r} given twice")
        options[key] = _value(text)
    return name, options


def base_name(spec: str) -> str:
    """The registry name of `spec` (everything before the first separator)."""
    return spec.split(SEPARATOR, 1)[0]


def _value(text: str) -> Any:
    if text == "null":
        return None
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
