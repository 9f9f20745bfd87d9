"""The calibration replay study (bench/studies/calibration_replay.py) on a hand-built burner
phase: an engine that turns 3× slower than its profile halfway through."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from backend.policy.latency import BatchShape, LatencyModel, load_profile
from bench.studies import calibration_replay
from bench.studies.calibration_replay import MIX_FIELDS, burn_phase, parse_options

PROFILE = Path("backend/policy/profiles/cpu-tiny.json")
START = 1_000.0


def burner_run(with_mix: bool = True) -> list[dict[str, object]]:
    """A new-user results.json: a decode-only and a prompt-only iteration alternating, at the
    profile's pace for 5 s, then 3× slower for 10 s; predicted as by an engine that never
    corrects its profile."""
    model = LatencyModel.fit(load_profile(PROFILE).samples)
    decode = BatchShape().with_decode(200)
    prompt = BatchShape().with_prefill(64)
    samples = []
    t = START - 5.0
    i = 0
    while t < START + 10.0:
        shape = decode if i % 4 else prompt
        raw_s = model.predict(shape)
        measured_s = raw_s * (3.0 if t >= START else 1.0)
        t += measured_s
        i += 1
        sample: dict[str, object] = {"at_unix_s": t, "measured_s": measured_s, "predicted_s": raw_s}
        if with_mix:
            sample["mix"] = list(msgspec.structs.astuple(shape))
        samples.append(sample)
    burn = {"samples": samples, "burn_start_unix_s": START, "timeline": []}
    return [{"policy": "tandem", "burn": burn}]


def test_the_replayed_calibration_comes_back_where_the_uncorrected_run_never_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(burner_run()))
    assert calibration_replay.main([str(results), str(PROFILE)]) == 0
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in capsys.readouterr().out.splitlines()[2:]
    }
    assert rows["as run"][0] == "–"  # off by 2/3 to the end
    assert 0.0 < float(rows["replayed"][0]) < 10.0  # the bound on the real engine
    assert float(rows["replayed"][3]) < float(rows["as run"][3])
    # an option of the calibration is honoured: a 10× slower fast mean takes longer to recover
    assert (
        calibration_replay.main(
            [
                str(results),
                str(PROFILE),
                "--calibration",
                "tau_fast_s=2.0",
                "tau_slow_s=8.0",
                "window=500",
            ]
        )
        == 0
    )
    slow = capsys.readouterr().out.splitlines()[3].split("|")[2].strip()
    assert slow == "–" or float(slow) > float(rows["replayed"][0])


def test_bad_inputs_are_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="no token mix"):
        burn_phase(burner_run(with_mix=False), "tandem")
    with pytest.raises(ValueError, match="no row of policy 'fcfs'"):
        burn_phase(burner_run(), "fcfs")
    with pytest.raises(ValueError, match="not key=value"):
        parse_options(["tau_fast_s"])
    assert parse_options(["window=10", "tau_fast_s=0.25"]) == {"window": 10, "tau_fast_s": 0.25}
    results = tmp_path / "results.json"
    results.write_text(json.dumps(burner_run()))
    assert calibration_replay.main([str(results), str(PROFILE), "--calibration", "tau=1"]) == 2
    assert "tau" in capsys.readouterr().err
    assert MIX_FIELDS[0] == "prefill_tokens" and len(MIX_FIELDS) == 7
