"""Replays the iterations a new-user run logged under the CPU burner through the latency
calibration as it is in this tree, and says how soon its prediction error came back within the
study's band: an A/B of calibration changes on the same real iterations, without the engine.

The run's `results.json` (bench/studies/new_user.py, since session 36) keeps every iteration of
the burner phase with its measured time, the calibrated prediction it was planned with, and its
token mix. With the profile the engine planned with (its `/stats` `profile`: a measured one
lies under the profile cache, `<model.cache_dir>/profiles/<key>.json`), the mix gives the
model's own prediction; the replay feeds it and the measured time to a fresh
`LatencyCalibration` (options as `key=value`) and predicts each iteration with the factors in
force before it, as the engine did. Open loop: the engine's plans stay the run's own, so this
compares estimators on one sequence, not the policies they would have made.

    python -m bench.studies.calibration_replay RESULTS.json PROFILE.json [--policy tandem]
        [--calibration tau_fast_s=0.5 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from backend.policy.calibration import LatencyCalibration, regime_of
from backend.policy.latency import BatchShape, LatencyModel, load_profile
from bench.studies.new_user import (
    ERROR_BAND,
    ERROR_WINDOW_S,
    error_timeline,
    ratio_timeline,
    recovery_s,
)

MIX_FIELDS = tuple(BatchShape.__struct_fields__)
"""The order of a logged mix's numbers (`common.wire.IterationMix` is BatchShape field for
field)."""


@dataclass(frozen=True)
class Recovery:
    """How one prediction of the burner phase's iterations fared."""

    back_within_band_s: float | None
    """Seconds from the burner's start until the windowed median |predicted ÷ measured − 1|
    is back within the band (the study's `error_back_within_band_s`); None: never."""
    ratio_back_within_band_s: float | None
    """The same for |median of predicted ÷ measured − 1|."""
    error_p50_before: float | None
    """Median windowed error before the burner."""
    error_p50_after: float | None
    """Median windowed error from the burner's start on."""


def recovery(samples: list[dict[str, float]], burn_start_unix_s: float) -> Recovery:
    """The study's recovery measures of *samples* (at_unix_s, measured_s, predicted_s)."""
    errors = error_timeline(samples, ERROR_WINDOW_S)
    ratios = ratio_timeline(samples, ERROR_WINDOW_S)
    before = [e for t, e in errors if t < burn_start_unix_s]
    after = [e for t, e in errors if t >= burn_start_unix_s]
    return Recovery(
        back_within_band_s=recovery_s(errors, burn_start_unix_s, ERROR_BAND),
        ratio_back_within_band_s=recovery_s(ratios, burn_start_unix_s, ERROR_BAND),
        error_p50_before=statistics.median(before) if before else None,
        error_p50_after=statistics.median(after) if after else None,
    )


def replay(
    samples: list[dict[str, Any]], model: LatencyModel, calibration: LatencyCalibration
) -> list[dict[str, float]]:
    """*samples* predicted again: each iteration with a mix gets the calibration's factor for
    its regime times the model's prediction, then teaches the calibration its measured time.
    Iterations without a mix (no plan of tandem's ran) are left out."""
    out: list[dict[str, float]] = []
    for s in samples:
        if not s.get("mix"):
            continue
        shape = BatchShape(**dict(zip(MIX_FIELDS, s["mix"], strict=True)))
        raw_s = model.predict(shape)
        regime = regime_of(shape.num_prefill, shape.num_decode)
        predicted_s = calibration.factor(regime) * raw_s
        calibration.observe(raw_s, s["measured_s"], regime)
        out.append(
            {"at_unix_s": s["at_unix_s"], "measured_s": s["measured_s"], "predicted_s": predicted_s}
        )
    return out


def burn_phase(results: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    """The burner phase of *policy*'s row; ValueError naming what is missing."""
    rows = [r for r in results if r.get("policy") == policy]
    if not rows:
        raise ValueError(
            f"no row of policy {policy!r} (rows: {[r.get('policy') for r in results]})"
        )
    burn = rows[0].get("burn")
    if not burn or not burn.get("samples"):
        raise ValueError(f"policy {policy!r} has no burner phase with iterations")
    if not any(s.get("mix") for s in burn["samples"]):
        raise ValueError("its iterations carry no token mix (a run from before session 36)")
    if burn.get("burn_start_unix_s") is None:
        # runs of session 36's first version kept only the timeline relative to the start
        first = error_timeline(burn["samples"], ERROR_WINDOW_S)[0][0]
        burn = {**burn, "burn_start_unix_s": first - burn["timeline"][0]["t_s"]}
    return burn


def parse_options(pairs: list[str]) -> dict[str, float | int]:
    """`key=value` pairs as LatencyCalibration keyword arguments (numbers; integers stay
    integers, as `window` needs)."""
    options: dict[str, float | int] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"calibration option {pair!r} is not key=value")
        try:
            options[key] = int(value) if value.strip().lstrip("+-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"calibration option {key}: {value!r} is not a number") from None
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.calibration_replay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("results", type=Path, help="a new-user run's results.json")
    parser.add_argument("profile", type=Path, help="the latency profile the engine planned with")
    parser.add_argument("--policy", default="tandem", help="the row to replay (default tandem)")
    parser.add_argument(
        "--calibration",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="LatencyCalibration options, e.g. tau_fast_s=0.25",
    )
    args = parser.parse_args(argv)
    try:
        burn = burn_phase(json.loads(args.results.read_text()), args.policy)
        options = parse_options(args.calibration)
        calibration = LatencyCalibration(**options)  # type: ignore[arg-type]
        model = LatencyModel.fit(load_profile(args.profile).samples)
    except (OSError, ValueError, TypeError, msgspec.DecodeError) as exc:
        print(f"calibration_replay: {exc}", file=sys.stderr)
        return 2
    start = burn["burn_start_unix_s"]
    rows = {
        "as run": recovery(burn["samples"], start),
        "replayed": recovery(replay(burn["samples"], model, calibration), start),
    }
    print("| prediction | back within band, s | median ratio back, s | error p50 before | after |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [
            r.back_within_band_s,
            r.ratio_back_within_band_s,
            r.error_p50_before,
            r.error_p50_after,
        ]
        print(f"| {name} | " + " | ".join("–" if c is None else f"{c:.3f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
