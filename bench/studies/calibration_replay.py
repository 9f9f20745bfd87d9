"""Replays a real engine's logged iterations through the latency calibration as it is in this
tree: an A/B of calibration changes on the same real iterations, without the engine.

Two logs carry what it needs (each iteration's measured time, the calibrated prediction it was
planned with, and its token mix):

* a live bench run's `live/<policy>/iterations.json` (`tandem bench … --engine sglang`): the
  whole run, from the engine's first iteration;
* a new-user run's `results.json` (bench/studies/new_user.py, since 2026-11-29): the CPU-burner
  phase, with the burner's start — the replay then also says how soon the prediction error
  came back within the study's band.

With the profile the engine planned with (its `/stats` `profile`; a measured one lies under the
profile cache, `<model.cache_dir>/profiles/<key>.json`), the mix gives the model's own
prediction. The replay feeds it and the measured time to a fresh `LatencyCalibration` (options
as `key=value`) and predicts each iteration with the factors in force before it, as the engine
did: on a whole run with the tree's code, "replayed" is the run's own prediction again. Open
loop: the plans stay the run's, so this compares estimators on one sequence, not the policies
they would have made. To compare two versions of the calibration, run it at both commits.

    python -m bench.studies.calibration_replay LOG PROFILE.json [--policy tandem]
        [--calibration tau_fast_s=0.5 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from backend.policy.calibration import REGIMES, LatencyCalibration, regime_of
from backend.policy.latency import BatchShape, LatencyModel, load_profile
from bench.studies.new_user import (
    ERROR_BAND,
    ERROR_WINDOW_S,
    error_timeline,
    ratio_timeline,
    recovery_s,
)
from common.wire import IterationRecord

MIX_FIELDS = tuple(BatchShape.__struct_fields__)
"""The order of a logged mix's numbers (`common.wire.IterationMix` is BatchShape field for
field)."""
LATE_RATIO = 1.25
"""An iteration that took more than this × its prediction counts as late (the prediction was
optimistic: what makes RT late)."""


@dataclass(frozen=True)
class Sample:
    """One logged iteration."""

    at_unix_s: float
    measured_s: float
    predicted_s: float
    """The calibrated prediction it was planned with (the run's), or the replay's."""
    shape: BatchShape | None
    """Its token mix (None: no plan of tandem's ran)."""

    @property
    def regime(self) -> int | None:
        """Its batch regime (`backend.policy.calibration`), None without a mix."""
        shape = self.shape
        return None if shape is None else regime_of(shape.num_prefill, shape.num_decode)


@dataclass(frozen=True)
class Fit:
    """How one prediction fared on a set of iterations."""

    iterations: int
    error_p50: float
    """Median |predicted − measured| / measured."""
    late_share: float
    """Share of iterations that took more than LATE_RATIO × their prediction."""
    pace_p50: float
    """Median measured ÷ predicted (1: unbiased; above 1: optimistic)."""


@dataclass(frozen=True)
class Recovery:
    """How soon the prediction came back after the burner started (new-user runs)."""

    back_within_band_s: float | None
    """Seconds until the windowed median |predicted ÷ measured − 1| is back within the band
    (the study's `error_back_within_band_s`); None: never."""
    ratio_back_within_band_s: float | None
    """The same for |median of predicted ÷ measured − 1|."""


def fit(samples: list[Sample]) -> Fit | None:
    """The fit of *samples*' predictions (None when there is none)."""
    pairs = [(s.predicted_s, s.measured_s) for s in samples if s.predicted_s > 0]
    if not pairs:
        return None
    errors = sorted(abs(p - m) / m for p, m in pairs)
    return Fit(
        iterations=len(pairs),
        error_p50=errors[len(errors) // 2],
        late_share=sum(1 for p, m in pairs if m > LATE_RATIO * p) / len(pairs),
        pace_p50=math.exp(statistics.median(math.log(m / p) for p, m in pairs)),
    )


def recovery(samples: list[Sample], burn_start_unix_s: float) -> Recovery:
    """The new-user study's recovery measures of *samples* after *burn_start_unix_s*."""
    rows = [
        {"at_unix_s": s.at_unix_s, "measured_s": s.measured_s, "predicted_s": s.predicted_s}
        for s in samples
    ]
    return Recovery(
        back_within_band_s=recovery_s(
            error_timeline(rows, ERROR_WINDOW_S), burn_start_unix_s, ERROR_BAND
        ),
        ratio_back_within_band_s=recovery_s(
            ratio_timeline(rows, ERROR_WINDOW_S), burn_start_unix_s, ERROR_BAND
        ),
    )


def replay(
    samples: list[Sample], model: LatencyModel, calibration: LatencyCalibration
) -> list[Sample]:
    """*samples* predicted again: each iteration with a mix gets the calibration's factor for
    its regime times the model's prediction, then teaches the calibration its measured time.
    Iterations without a mix are left out."""
    out: list[Sample] = []
    for s in samples:
        if s.shape is None:
            continue
        raw_s = model.predict(s.shape)
        regime = regime_of(s.shape.num_prefill, s.shape.num_decode)
        predicted_s = calibration.factor(regime) * raw_s
        calibration.observe(raw_s, s.measured_s, regime)
        out.append(Sample(s.at_unix_s, s.measured_s, predicted_s, s.shape))
    return out


def _shape(mix: list[float] | None) -> BatchShape | None:
    return None if not mix else BatchShape(**dict(zip(MIX_FIELDS, mix, strict=True)))


def load_log(path: Path, policy: str) -> tuple[list[Sample], float | None]:
    """The iterations of a live run's iterations.json or of a new-user results.json (the row
    of *policy*), and the burner's start (None for a live run); ValueError naming what is
    wrong."""
    raw = path.read_bytes()
    data = json.loads(raw)
    if isinstance(data, list) and data and isinstance(data[0], list):
        records = msgspec.json.decode(raw, type=list[IterationRecord])
        samples = [
            Sample(
                r.at_unix_s,
                r.iteration_s,
                r.predicted_iteration_s,
                None if r.mix is None else BatchShape(**msgspec.structs.asdict(r.mix)),
            )
            for r in records
            if r.iteration_s > 0
        ]
        if not any(s.shape for s in samples):
            raise ValueError(f"{path}: no iteration carries a token mix (no plan of tandem's)")
        return samples, None
    if not isinstance(data, list):
        raise ValueError(
            f"{path}: neither a live run's iterations.json nor a new-user results.json"
        )
    rows = [r for r in data if isinstance(r, dict) and r.get("policy") == policy]
    if not rows:
        raise ValueError(
            f"{path}: no row of policy {policy!r} "
            f"(rows: {[r.get('policy') for r in data if isinstance(r, dict)]})"
        )
    burn = rows[0].get("burn")
    if not burn or not burn.get("samples"):
        raise ValueError(f"{path}: policy {policy!r} has no burner phase with iterations")
    if not any(s.get("mix") for s in burn["samples"]):
        raise ValueError(
            f"{path}: its iterations carry no token mix (the study logs it since 2026-11-29: "
            "run it again)"
        )
    start = burn.get("burn_start_unix_s")
    if start is None:  # the first runs with the mix kept only the timeline relative to it
        start = error_timeline(burn["samples"], ERROR_WINDOW_S)[0][0] - burn["timeline"][0]["t_s"]
    samples = [
        Sample(s["at_unix_s"], s["measured_s"], s["predicted_s"], _shape(s.get("mix")))
        for s in burn["samples"]
        if s["measured_s"] > 0
    ]
    return samples, float(start)


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


def report(samples: list[Sample], replayed: list[Sample], burn_start_unix_s: float | None) -> str:
    """The table: per prediction (the run's, the replay's) and batch regime, the fit; with a
    burner, the recovery."""
    with_mix = [s for s in samples if s.shape is not None]
    lines = [
        "| prediction | batches | iterations | error p50 | late (> 1.25×) "
        "| measured ÷ predicted p50 |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in (("as run", with_mix), ("replayed", replayed)):
        groups = [("all", run)] + [
            (regime, [s for s in run if s.regime == r]) for r, regime in enumerate(REGIMES)
        ]
        for group, part in groups:
            f = fit(part)
            if f is not None:
                lines.append(
                    f"| {name} | {group} | {f.iterations} | {f.error_p50:.3f} | "
                    f"{f.late_share:.3f} | {f.pace_p50:.3f} |"
                )
    if burn_start_unix_s is not None:
        lines += [
            "",
            "| prediction | back within band after the burner, s | median ratio back, s |",
            "|---|---|---|",
        ]
        for name, run in (("as run", with_mix), ("replayed", replayed)):
            r = recovery(run, burn_start_unix_s)
            cells = [r.back_within_band_s, r.ratio_back_within_band_s]
            lines.append(
                f"| {name} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.calibration_replay",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "log", type=Path, help="a live run's iterations.json or a new-user results.json"
    )
    parser.add_argument("profile", type=Path, help="the latency profile the engine planned with")
    parser.add_argument(
        "--policy", default="tandem", help="the new-user row to replay (default tandem)"
    )
    parser.add_argument(
        "--calibration",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="LatencyCalibration options, e.g. tau_fast_s=0.25",
    )
    args = parser.parse_args(argv)
    try:
        samples, burn_start = load_log(args.log, args.policy)
        calibration = LatencyCalibration(**parse_options(args.calibration))  # type: ignore[arg-type]
        model = LatencyModel.fit(load_profile(args.profile).samples)
    except (OSError, ValueError, TypeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"calibration_replay: {exc}", file=sys.stderr)
        return 2
    print(report(samples, replay(samples, model, calibration), burn_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
