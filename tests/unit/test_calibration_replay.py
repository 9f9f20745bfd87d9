"""The calibration replay study (bench/studies/calibration_replay.py) on hand-built logs: an
engine that turns 3× slower than its profile halfway through, as a new-user burner phase and as
a live run's iterations.json."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from backend.policy.latency import BatchShape, LatencyModel, load_profile
from bench.studies import calibration_replay
from bench.studies.calibration_replay import MIX_FIELDS, load_log, parse_options
from common.wire import IterationMix, IterationRecord

PROFILE = Path("backend/policy/profiles/cpu-tiny.json")
START = 1_000.0


def iterations() -> list[tuple[float, float, float, BatchShape]]:
    """(end time, measured, predicted, shape): a decode-only iteration three times in four and
    a prompt-only one, at the profile's pace for 5 s, then 3× slower for 10 s; predicted as by
    an engine that never corrects its profile."""
    model = LatencyModel.fit(load_profile(PROFILE).samples)
    decode = BatchShape().with_decode(200)
    prompt = BatchShape().with_prefill(64)
    out = []
    t = START - 5.0
    i = 0
    while t < START + 10.0:
        shape = decode if i % 4 else prompt
        raw_s = model.predict(shape)
        measured_s = raw_s * (3.0 if t >= START else 1.0)
        t += measured_s
        i += 1
        out.append((t, measured_s, raw_s, shape))
    return out


def new_user_results(with_mix: bool = True) -> list[dict[str, object]]:
    samples = [
        {"at_unix_s": t, "measured_s": m, "predicted_s": p}
        | ({"mix": list(msgspec.structs.astuple(shape))} if with_mix else {})
        for t, m, p, shape in iterations()
    ]
    burn = {"samples": samples, "burn_start_unix_s": START, "timeline": []}
    return [{"policy": "tandem", "burn": burn}]


def table(out: str) -> dict[tuple[str, str], list[str]]:
    """The report's rows keyed by their first two cells."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) >= 2 and not cells[0].startswith(("prediction", "---")):
            rows[(cells[0], cells[1] if len(cells) > 3 else "")] = cells[1:]
    return rows


def test_a_new_user_burner_phase_replayed_comes_back_where_the_uncorrected_run_never_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "results.json"
    log.write_text(json.dumps(new_user_results()))
    assert calibration_replay.main([str(log), str(PROFILE)]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    as_run, replayed = rows[("as run", "all")], rows[("replayed", "all")]
    # the uncorrected run: every iteration after the slowdown 3× late (2 in 5 of them); the
    # replay only while it learns the pace
    assert float(as_run[3]) == pytest.approx(0.4, abs=0.02)
    assert float(replayed[3]) < float(as_run[3]) / 3
    assert rows[("replayed", "decode")] and rows[("replayed", "prefill")]
    recovery = {
        c[0]: c[1:] for c in (row.split("|")[1:-1] for row in out.split("\n\n")[1].splitlines()[2:])
    }
    assert recovery[" as run "][0].strip() == "–"
    assert 0.0 < float(recovery[" replayed "][0]) < 10.0  # the bound on the real engine
    # an option of the calibration is honoured: slower means learn the new pace later
    assert (
        calibration_replay.main(
            [
                str(log),
                str(PROFILE),
                "--calibration",
                "tau_fast_s=2.0",
                "tau_slow_s=8.0",
                "window=500",
            ]
        )
        == 0
    )
    slow = table(capsys.readouterr().out)[("replayed", "all")]
    assert float(slow[3]) > float(replayed[3])


def test_a_live_runs_iteration_log_is_replayed_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [
        IterationRecord(i, t, m, p, IterationMix(*msgspec.structs.astuple(shape)))
        for i, (t, m, p, shape) in enumerate(iterations())
    ]
    log = tmp_path / "iterations.json"
    log.write_bytes(msgspec.json.encode(records))
    samples, burn_start = load_log(log, "tandem")
    assert burn_start is None and len(samples) == len(records)
    assert calibration_replay.main([str(log), str(PROFILE)]) == 0
    out = capsys.readouterr().out
    assert "back within band" not in out  # no burner in a live run
    rows = table(out)
    assert int(rows[("replayed", "all")][1]) == len(records)
    assert float(rows[("replayed", "all")][3]) < float(rows[("as run", "all")][3])


def test_bad_inputs_are_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "results.json"
    log.write_text(json.dumps(new_user_results(with_mix=False)))
    with pytest.raises(ValueError, match="no token mix"):
        load_log(log, "tandem")
    log.write_text(json.dumps(new_user_results()))
    with pytest.raises(ValueError, match="no row of policy 'fcfs'"):
        load_log(log, "fcfs")
    log.write_text(json.dumps({"policies": {}}))
    with pytest.raises(ValueError, match="neither a live run"):
        load_log(log, "tandem")
    with pytest.raises(ValueError, match="not key=value"):
        parse_options(["tau_fast_s"])
    assert parse_options(["window=10", "tau_fast_s=0.25"]) == {"window": 10, "tau_fast_s": 0.25}
    log.write_text(json.dumps(new_user_results()))
    assert calibration_replay.main([str(log), str(PROFILE), "--calibration", "tau=1"]) == 2
    assert "tau" in capsys.readouterr().err
    assert calibration_replay.main([str(tmp_path / "missing.json"), str(PROFILE)]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert tuple(IterationMix.__struct_fields__) == MIX_FIELDS
