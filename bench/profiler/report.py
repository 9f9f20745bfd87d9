"""Fit error of latency profiles: held-out MAPE and the fitted weights.

    python -m bench.profiler.report [FILE ...]    # default: every backend/policy/profiles/*.json

Each profile is split once at random (seed 0): the model is fitted on 80 % of its samples and
its mean absolute percentage error measured on the other 20 %. Both the model `LatencyModel.fit`
chooses and the plain linear (HyGen) form are reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from backend.policy.latency import FEATURES, holdout_mape, load_profile
from backend.policy.profiles import PROFILES_DIR

HOLDOUT_FRACTION = 0.2
SEED = 0
UNITS = (
    "ms",
    "ms/Ktok",
    "ms/Ktok",
    "ms/Ktok²",
    "ms/Ktok²",
    "ms/req",
    "ms/req",
    "ms/Ktok²",
    "ms/Ktok²",
)


def report_lines(path: str | Path) -> list[str]:
    """A summary line for the profile at *path*, then one line per fitted piece."""
    profile = load_profile(path)
    model, error = holdout_mape(profile, HOLDOUT_FRACTION, SEED)
    _, linear_error = holdout_mape(profile, HOLDOUT_FRACTION, SEED, max_pieces=1)
    n_test = max(1, int(len(profile.samples) * HOLDOUT_FRACTION))
    form = "max of 2 linear pieces" if len(model.pieces) == 2 else "linear"
    lines = [
        f"{profile.name}: {len(profile.samples)} samples, held-out MAPE {error:.1%} on "
        f"{n_test} points ({form}; linear form alone {linear_error:.1%})"
    ]
    for i, piece in enumerate(model.pieces, 1):
        terms = ", ".join(
            f"{name}={w * 1e3:.4g} {unit}"
            for name, w, unit in zip(FEATURES, piece, UNITS, strict=True)
            if w
        )
        lines.append(f"  piece {i}: {terms}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the report for the given profiles (all committed ones by default)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.profiler.report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("files", nargs="*", type=Path, help="profile files")
    args = parser.parse_args(argv)
    for path in args.files or sorted(PROFILES_DIR.glob("*.json")):
        print("\n".join(report_lines(path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
