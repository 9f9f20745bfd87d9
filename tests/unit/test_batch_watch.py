"""`tandem batch watch` through a gateway restart: it waits out a gateway that cannot be reached
or asks to come back (429, 502, 503, 504), saying so on its line, and carries on when it answers
again; it gives up after `--max-outage-s` without an answer, saying that the batch runs on; any
other refusal ends it at once. (A fake gateway and clock: no waiting.)"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.batch import RETRY_MAX_S, BatchCliError, _watch
from tandem.cli import main

BATCH = "batch_1"


def batch(status: str, done: int, total: int = 4) -> dict[str, Any]:
    return {
        "id": BATCH,
        "status": status,
        "request_counts": {"completed": done, "failed": 0, "total": total},
    }


class Gateway:
    """Answers `GET /v1/batches/ID` from a script: a dict, or a BatchCliError to raise."""

    def __init__(self, script: list[dict[str, Any] | BatchCliError]) -> None:
        self._script: Iterator[dict[str, Any] | BatchCliError] = iter(script)

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        assert (method, path) == ("GET", f"/v1/batches/{BATCH}")
        answer = next(self._script)
        if isinstance(answer, BatchCliError):
            raise answer
        return answer


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now_s += seconds


def down() -> BatchCliError:
    return BatchCliError(
        "cannot reach the gateway at http://gw: [Errno 111] Connection refused", transient=True
    )


def watch(script: list[dict[str, Any] | BatchCliError], **kwargs: Any) -> tuple[int, str, Clock]:
    clock, out = Clock(), io.StringIO()
    status = _watch(
        Gateway(script),  # type: ignore[arg-type]
        BATCH,
        out=out,
        clock=clock,
        sleep=clock.sleep,
        **kwargs,
    )
    return status, out.getvalue(), clock


def test_a_gateway_restart_is_waited_out_and_the_watch_carries_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    draining = BatchCliError("503: the gateway is shutting down; retry", transient=True)
    script = [batch("in_progress", 1), draining, down(), down(), down(), down(), down()]
    script += [batch("in_progress", 3), batch("completed", 4)]
    status, line, clock = watch(script)
    assert status == 0
    assert "waiting for the gateway for 0:00:" in line and "Connection refused" in line
    assert "4/4 lines" in line.rsplit("\r", 1)[-1]  # the last line drawn: the batch done
    assert json_printed(capsys)["status"] == "completed"
    # asked again at once at first, then backing off, never waiting longer than RETRY_MAX_S
    assert clock.pauses[:6] == [1.0, 1.0, 2.0, 4.0, 8.0, RETRY_MAX_S]


def test_it_gives_up_after_the_longest_outage_and_says_the_batch_runs_on() -> None:
    with pytest.raises(BatchCliError) as gave_up:
        watch([batch("in_progress", 1)] + [down()] * 100, max_outage_s=30.0)
    message = str(gave_up.value)
    assert message.startswith(f"gave up watching batch {BATCH} after 3")
    assert "Connection refused" in message and f"tandem batch watch {BATCH}" in message
    assert gave_up.value.status == 1


def test_a_refusal_that_waiting_cannot_fix_ends_the_watch_at_once() -> None:
    refused = BatchCliError("401: invalid API key")
    with pytest.raises(BatchCliError) as ended:
        watch([batch("in_progress", 1), refused, batch("completed", 4)])
    assert ended.value is refused


def json_printed(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return dict(json.loads(capsys.readouterr().out))


def test_the_outage_bound_is_refused_where_it_cannot_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "lines.jsonl"
    source.write_text("{}\n")
    common = ["--url", "http://127.0.0.1:9", "--api-key", "tdm_x"]  # never reached
    assert main(["batch", "create", str(source), "--max-outage-s", "5", *common]) == 2
    assert "--max-outage-s applies to --watch only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["batch", "watch", BATCH, "--max-outage-s", "-1", *common])
    assert refused.value.code == 2
    assert "must be 0 or more seconds, got -1" in capsys.readouterr().err
