"""`tandem bench` argument errors are one line (exit 2); trace files are validated line by line
with errors that name the line and the field; the Azure converter writes valid traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.trace
from bench.defaults import DEFAULT_DATA_DIR
from bench.trace import (
    TILE_HASH_STRIDE,
    TraceError,
    convert_azure,
    read_trace,
    tile_trace,
    trace_requests,
)
from bench.workloads.base import WorkloadParams
from tandem.cli import main


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc_info:
        code = main(argv)
        raise SystemExit(code)
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem: error: "), err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "W9"], "unknown workload 'W9'"),
        (["bench", "W1", "--load", "0.5", "--rt-rate", "3"], "not allowed with"),
        (["bench", "W1", "--load", "-1"], "--load must be > 0"),
        (["bench", "W1", "--load", "abc"], "invalid float value"),
        (["bench", "W1", "--kv-scale", "0.5"], "--kv-scale must be > 1"),
        (["bench", "W2", "--engine", "sglang"], "--engine sglang runs W1, W5 and W6"),
        (["bench", "W1", "--engine", "sglang", "--policies", "rr"], "not rr"),
        (["bench", "W1", "--engine", "vllm"], "invalid choice"),
        (["bench", "W1", "--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "W1", "--policies", "fcfs,nope"], "unknown policy 'nope'"),
        (["bench", "W1", "--policies", "fcfs,fcfs"], "twice"),
        (["bench", "W1", "--policies", "tandem:latency_budget_s"], "expected KEY=VALUE"),
        (["bench", "W1", "--policies", "nope:x=1"], "unknown policy 'nope'"),
        (["bench", "W1", "--policies", "tandem:eps_min=0.1:eps_min=0.2"], "given twice"),
        (
            ["bench", "W1", "--policies", "tandem:no_such_knob=1", "--rt-rate", "1"],
            "bad options for policy 'tandem'",
        ),
        (
            ["bench", "W1", "--policies", "tandem:latency_budget_s=-1", "--rt-rate", "1"],
            "latency_budget_s must be > 0",
        ),
        (["bench", "W4", "--policies", "blend:x=1"], "takes no options"),
        (["bench", "W1", "--rate-scale", "2"], "only for `bench trace`"),
        (["bench", "W1", "extra.jsonl"], "only `bench trace` takes a file"),
        (["bench", "trace"], "needs a FILE.jsonl"),
        (["bench", "W1", "--seed", "-3"], "--seed must be ≥ 0"),
        (["bench", "W1", "--profile", "no-such-profile", "--rt-rate", "1"], "unknown profile"),
        (["bench", "W1", "--replicas", "0"], "--replicas must be ≥ 1"),
        (["bench", "W1", "--replicas", "2", "--routers", "fastest"], "unknown router 'fastest'"),
        (["bench", "W1", "--routers", "slo,slo"], "names a router twice"),
        (["bench", "W1", "--routers", " , "], "--routers is empty"),
        (
            ["bench", "W1", "--routers", "slo", "--policies", "fcfs,tandem", "--rt-rate", "1"],
            "--routers compares placement on one engine policy",
        ),
    ],
)
def test_bad_arguments_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert needle in one_line_error(capsys, argv)


def test_missing_trace_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = one_line_error(capsys, ["bench", "trace", str(tmp_path / "none.jsonl")])
    assert "cannot read trace" in err and "none.jsonl" in err


def write_trace(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"t_ms": 0, "input_len": 512, "output_len": 8}'


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ('{"t_ms": 5, "input_len": 512', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_len": 5, "output_len": 3}', "field 't_ms'"),
        ('{"t_ms": -1, "input_len": 5, "output_len": 3}', "field 't_ms'"),
        ('{"t_ms": 1, "input_len": "5", "output_len": 3}', "field 'input_len'"),
        ('{"t_ms": 1, "input_len": 5, "output_len": 0}', "field 'output_len'"),
        ('{"t_ms": 1, "input_len": 5, "output_len": 3, "tier": "gold"}', "field 'tier'"),
        (
            '{"t_ms": 1, "input_len": 5, "output_len": 3, "prefix_hashes": [1, "x"]}',
            "field 'prefix_hashes'",
        ),
        (
            '{"t_ms": 1, "input_len": 600, "output_len": 3, "prefix_hashes": [1, 2, 3]}',
            "more than the 2 blocks",
        ),
        ('{"t_ms": 1, "input_len": 5, "output_len": 3, "tenant": 7}', "field 'tenant'"),
        ('{"t_ms": NaN, "input_len": 5, "output_len": 3}', "field 't_ms'"),
        ('{"t_ms": true, "input_len": 5, "output_len": 3}', "field 't_ms'"),
        ('{"t_ms": 1, "input_len": true, "output_len": 3}', "field 'input_len'"),
        ('{"t_ms": 1, "input_len": 5, "output_len": 3, "tier": null}', "field 'tier'"),
        ('{"t_ms": 1, "input_len": 5, "output_len": 3, "prefix_hashes": null}', "prefix_hashes"),
    ],
)
def test_trace_errors_name_the_line_and_field(tmp_path: Path, bad: str, needle: str) -> None:
    path = write_trace(tmp_path, [GOOD, "", bad])
    with pytest.raises(TraceError) as exc_info:
        read_trace(path)
    assert f"{path}:3: " in str(exc_info.value) and needle in str(exc_info.value)


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"t_ms": 1, "tenant": "\xff", "input_len": 5}\n')
    with pytest.raises(TraceError, match=f"{path}:2: invalid JSON"):
        read_trace(path)


def test_every_line_reads_as_the_field_by_field_check_reads_it(tmp_path: Path) -> None:
    # the fast path (msgspec) and the checked one (json, `_check_line`) give the same rows,
    # also for what only one of them takes as is: ints as t_ms, defaults, unknown fields, an
    # integer past 64 bits
    lines = [
        '{"t_ms": 0, "input_len": 512, "output_len": 8}',
        '{"t_ms": 12.5, "input_len": 1024, "output_len": 3, "tier": "be", "tenant": "acme"}',
        '{"t_ms": 7, "input_len": 600, "output_len": 1, "prefix_hashes": [3, 4], "x": [1]}',
        '{"t_ms": 8, "input_len": 600, "output_len": 1, "prefix_hashes": [123456789012345678901]}',
        '{"t_ms": 9, "input_len": 20, "output_len": 2, "tenant": null, "tier": "rt"}',
    ]
    path = write_trace(tmp_path, lines)
    checked = [
        bench.trace._check_line(json.loads(line), "") | {"line": n}
        for n, line in enumerate(lines, start=1)
    ]
    rows = read_trace(path)
    assert rows == checked
    assert [type(row["t_ms"]) for row in rows] == [float] * len(lines)


def test_trace_replay_scales_time_and_keeps_fields(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path,
        [
            '{"t_ms": 1000, "input_len": 1024, "output_len": 8, "prefix_hashes": [7, 9]}',
            '{"t_ms": 3000, "input_len": 20, "output_len": 2, "tier": "be", "tenant": "acme"}',
        ],
    )
    specs = trace_requests(read_trace(path), WorkloadParams(), rate_scale=2.0)
    assert [s.arrival_s for s in specs] == [0.0, 1.0]
    assert specs[0].prefix_hashes == (7, 9) and specs[0].ttft_target_s == 0.4
    assert (
        specs[1].tier == "be" and specs[1].ttft_target_s is None and specs[1].length_key == "acme"
    )
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write_trace(tmp_path, ["", "  "]))


def test_convert_azure_writes_a_valid_trace(tmp_path: Path) -> None:
    out = tmp_path / "azure.jsonl"
    assert convert_azure(DEFAULT_DATA_DIR / "azure_llm_2023_conv.csv", out, tier="be", limit=5) == 5
    rows = read_trace(out)
    assert len(rows) == 5 and rows[0]["t_ms"] == 0.0 and {r["tier"] for r in rows} == {"be"}
    first = json.loads(out.read_text().splitlines()[0])
    assert first["input_len"] == 374 and first["output_len"] == 44


def test_convert_azure_can_start_every_prompt_with_one_system_prompt(tmp_path: Path) -> None:
    csv = tmp_path / "svc.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0,1600,10\n"  # 3 full blocks of 512
        "2023-11-16 18:15:47.0,300,10\n"  # no full block: nothing to share
        "2023-11-16 18:15:48.0,1100,10\n"
    )
    out = tmp_path / "svc.jsonl"
    convert_azure(csv, out, mean_turns=1, system_prompt_blocks=2)
    hashes = [row["prefix_hashes"] for row in read_trace(out)]
    assert hashes[0][:2] == hashes[2][:2] and len(hashes[0]) == 3 and len(hashes[2]) == 2
    assert hashes[1] == () and hashes[0][2] not in hashes[2]  # then each conversation's own
    convert_azure(csv, out, system_prompt_blocks=1)  # without conversations: the shared block
    assert [row["prefix_hashes"] for row in read_trace(out)] == [hashes[0][:1], (), hashes[0][:1]]


def test_policy_spec_reads_numbers_booleans_null_and_strings() -> None:
    from bench.policy_spec import base_name, parse_policy_spec

    spec = (
        "tandem:max_long_prefills=2:latency_budget_s=0.035:use_aimd=false:kv_layout=bicache"
        ":rt_stretch=null"
    )
    assert parse_policy_spec(spec) == (
        "tandem",
        {
            "max_long_prefills": 2,
            "latency_budget_s": 0.035,
            "use_aimd": False,
            "kv_layout": "bicache",
            "rt_stretch": None,
        },
    )
    assert parse_policy_spec("fcfs") == ("fcfs", {})
    assert base_name(spec) == "tandem"


def test_tile_overlays_shifted_copies_within_the_span(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    lines = [
        {"t_ms": 1000 * i, "input_len": 600, "output_len": 5, "prefix_hashes": [7 * i]}
        for i in range(11)
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "fleet.jsonl"
    assert tile_trace(src, out, copies=3, seed=1) == 33
    rows = read_trace(out)
    times = [r["t_ms"] for r in rows]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 10_000  # one span, wrapped
    hashes = [r["prefix_hashes"][0] for r in rows]
    assert len(set(hashes)) == 33  # copies share no prefix
    assert {h // TILE_HASH_STRIDE for h in hashes} == {0, 1, 2}
    # a slice: only the lines before --until-s
    assert tile_trace(src, out, copies=3, seed=1, until_s=5.0) == sum(t < 5000 for t in times)
    with pytest.raises(ValueError, match="--copies"):
        tile_trace(src, out, copies=0)
