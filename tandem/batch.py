"""`tandem batch …`: a BE tenant's command line for the Batch API (talks HTTP to a gateway).

    tandem batch create FILE.jsonl [--endpoint /v1/chat/completions] [--window 24h] [--watch]
    tandem batch watch ID [--max-outage-s 600]   progress bar with ETA until the batch ends
    tandem batch get ID | list | cancel ID
    tandem batch results ID [--output FILE] [--errors FILE]

The gateway is `--url` (default: $TANDEM_URL, else this config's gateway address); the tenant
key is `--api-key` (default: $TANDEM_API_KEY). Every failure is one line, `tandem: error: …`
(exit 2 for bad input, 1 when the gateway refuses or cannot be reached).

A watch outlives a gateway restart: while the gateway cannot be reached or answers 429, 502,
503 or 504 (a deploy, a database outage, an overload), the progress line says so and the watch
asks again, backing off to `RETRY_MAX_S`; it gives up after `--max-outage-s` without an answer.
The batch itself never depends on the watch: it runs on in the gateway either way.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

API_KEY_ENV = "TANDEM_API_KEY"
URL_ENV = "TANDEM_URL"
"""The gateway's base URL when `--url` is not given (as for `tandem admin`)."""
FINAL = ("completed", "failed", "expired", "cancelled")
_BAR_WIDTH = 30
MAX_OUTAGE_S = 600.0
"""How long a watch goes on asking a gateway that does not answer, by default, seconds: long
enough for a restart that drains for a minute and starts an engine."""
RETRY_MAX_S = 10.0
"""Longest pause between two questions of a watch to a gateway that does not answer, seconds."""
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
"""HTTP statuses a watch waits out: the gateway (or a proxy before it) asks to come back."""


class BatchCliError(Exception):
    """A one-line failure; `status` is the exit status; `transient`: the gateway could not be
    reached or asked to come back later (a watch asks again)."""

    def __init__(self, message: str, status: int = 1, *, transient: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.transient = transient


def add_batch_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Adds `batch` and its actions to the `tandem` command line."""
    batch = subparsers.add_parser("batch", help="BE batches: create, watch, results")
    actions = batch.add_subparsers(metavar="ACTION")
    conn = argparse.ArgumentParser(add_help=False, parents=[common])
    conn.add_argument("--url", help=f"gateway base URL (default: ${URL_ENV}, else from the config)")
    conn.add_argument("--api-key", help=f"tenant API key (default: ${API_KEY_ENV})")

    create = actions.add_parser(
        "create", parents=[conn], help="upload a JSONL file and start a batch"
    )
    create.add_argument("file", type=Path, help="JSONL input (custom_id, method, url, body)")
    create.add_argument(
        "--endpoint",
        default="/v1/chat/completions",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    create.add_argument(
        "--window",
        default="24h",
        help="completion window: 24h, or shorter (e.g. 1h) to make it a deadline",
    )
    create.add_argument("--watch", action="store_true", help="then show progress until done")
    _add_outage_argument(create)
    create.set_defaults(func=_entry, batch_action=_create)
    for name, helptext, func in (
        ("get", "show a batch", _get),
        ("cancel", "cancel a batch", _cancel),
        ("watch", "progress bar with ETA until the batch ends", _watch_cmd),
    ):
        p = actions.add_parser(name, parents=[conn], help=helptext)
        p.add_argument("batch_id", metavar="ID")
        if name == "watch":
            _add_outage_argument(p)
        p.set_defaults(func=_entry, batch_action=func)
    listing = actions.add_parser("list", parents=[conn], help="your batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(func=_entry, batch_action=_list)
    results = actions.add_parser("results", parents=[conn], help="download output and errors")
    results.add_argument("batch_id", metavar="ID")
    results.add_argument("--output", type=Path, help="write the output file here (default: stdout)")
    results.add_argument("--errors", type=Path, help="write the error file here")
    results.set_defaults(func=_entry, batch_action=_results)


def _add_outage_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-outage-s",
        type=_outage_s,
        default=None,
        help="how long the watch waits for a gateway that does not answer (a restart) before "
        f"it gives up, seconds (default {MAX_OUTAGE_S:g})",
    )


def _outage_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def _entry(args: argparse.Namespace) -> int:
    """Runs a `tandem batch` action; one-line errors."""
    from tandem.admin import gateway_url  # --url, $TANDEM_URL or the config's, checked

    try:
        return int(args.batch_action(_Client(gateway_url(args), _key(args)), args) or 0)
    except BatchCliError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return exc.status


def _key(args: argparse.Namespace) -> str:
    key = args.api_key or os.environ.get(API_KEY_ENV)
    if not key:
        raise BatchCliError(f"no API key: pass --api-key or set {API_KEY_ENV}", 2)
    return str(key)


class _Client:
    def __init__(self, base_url: str, key: str) -> None:
        self.base = base_url.rstrip("/")
        self.key = key

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
    ) -> bytes:
        req = urllib.request.Request(
            f"{self.base}{path}",
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return bytes(resp.read())
        except urllib.error.HTTPError as exc:
            transient = exc.code in TRANSIENT_STATUSES
            raise BatchCliError(_error_message(exc), transient=transient) from None
        except OSError as exc:
            message = f"cannot reach the gateway at {self.base}: {exc}"
            raise BatchCliError(message, transient=True) from None
        except ValueError as exc:  # a URL urllib cannot use (http.client.InvalidURL)
            raise BatchCliError(f"bad gateway URL {self.base}: {exc}", 2) from None

    def json(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        raw = self.request(method, path, body)
        try:
            return json.loads(raw)
        except ValueError:
            raise BatchCliError(
                f"{self.base} answered {method} {path} with something that is not JSON "
                "(is it a tandem gateway?)"
            ) from None

    def upload(self, path: Path) -> dict[str, Any]:
        try:
            content = path.read_bytes()
        except OSError as exc:
            raise BatchCliError(f"cannot read {path}: {exc.strerror}", 2) from None
        boundary = f"tandem-{secrets.token_hex(8)}"
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            f"batch\r\n".encode(),
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{path.name}"\r\nContent-Type: application/jsonl\r\n\r\n'.encode(),
            content,
            f"\r\n--{boundary}--\r\n".encode(),
        ]
        raw = self.request(
            "POST", "/v1/files", b"".join(parts), f"multipart/form-data; boundary={boundary}"
        )
        return dict(json.loads(raw))


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return f"{exc.code}: {body['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"the gateway answered {exc.code} {exc.reason}"


def _print(payload: Any) -> None:
    print(json.dumps(payload, indent=2))


def _create(client: _Client, args: argparse.Namespace) -> int:
    if args.max_outage_s is not None and not args.watch:
        raise BatchCliError("--max-outage-s applies to --watch only", 2)
    uploaded = client.upload(args.file)
    batch = client.json(
        "POST",
        "/v1/batches",
        {
            "input_file_id": uploaded["id"],
            "endpoint": args.endpoint,
            "completion_window": args.window,
        },
    )
    if not args.watch:
        _print(batch)
        return 0
    print(
        f"batch {batch['id']} ({uploaded['bytes']} bytes uploaded as {uploaded['id']})",
        file=sys.stderr,
    )
    return _watch(client, batch["id"], max_outage_s=_max_outage_s(args))


def _max_outage_s(args: argparse.Namespace) -> float:
    return MAX_OUTAGE_S if args.max_outage_s is None else float(args.max_outage_s)


def _get(client: _Client, args: argparse.Namespace) -> int:
    _print(client.json("GET", f"/v1/batches/{args.batch_id}"))
    return 0


def _cancel(client: _Client, args: argparse.Namespace) -> int:
    _print(client.json("POST", f"/v1/batches/{args.batch_id}/cancel"))
    return 0


def _list(client: _Client, args: argparse.Namespace) -> int:
    page = client.json("GET", f"/v1/batches?limit={args.limit}")
    for b in page["data"]:
        counts = b["request_counts"]
        print(
            f"{b['id']}  {b['status']:<11} {counts['completed']}/{counts['total']} done, "
            f"{counts['failed']} failed"
        )
    return 0


def _results(client: _Client, args: argparse.Namespace) -> int:
    batch = client.json("GET", f"/v1/batches/{args.batch_id}")
    if batch["status"] not in FINAL:
        raise BatchCliError(
            f"batch {args.batch_id} is still {batch['status']}; results come "
            f"when it ends (tandem batch watch {args.batch_id})"
        )
    if batch["output_file_id"]:
        data = client.request("GET", f"/v1/files/{batch['output_file_id']}/content")
        if args.output:
            _write(args.output, data)
        else:
            sys.stdout.write(data.decode())
    if batch["error_file_id"]:
        data = client.request("GET", f"/v1/files/{batch['error_file_id']}/content")
        if args.errors:
            _write(args.errors, data)
        else:
            print(
                f"{batch['request_counts']['failed']} failed lines: tandem batch results "
                f"{args.batch_id} --errors FILE",
                file=sys.stderr,
            )
    return 0


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise BatchCliError(f"cannot write {path}: {exc.strerror or exc}", 2) from None


def _watch_cmd(client: _Client, args: argparse.Namespace) -> int:
    return _watch(client, args.batch_id, max_outage_s=_max_outage_s(args))


def _watch(
    client: _Client,
    batch_id: str,
    interval_s: float = 1.0,
    out: TextIO = sys.stderr,
    *,
    max_outage_s: float = MAX_OUTAGE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraws one progress line until the batch ends; 0 when it completed. Waits out a gateway
    that does not answer for up to *max_outage_s* (module doc)."""
    started = clock()
    first_done: int | None = None
    line = _Line(out)
    outage_since: float | None = None
    pause_s = interval_s
    while True:
        try:
            batch = client.json("GET", f"/v1/batches/{batch_id}")
        except BatchCliError as exc:
            if not exc.transient:
                line.end()
                raise
            now = clock()
            outage_since = now if outage_since is None else outage_since
            waited_s = now - outage_since
            if waited_s >= max_outage_s:
                line.end()
                raise BatchCliError(
                    f"gave up watching batch {batch_id} after {waited_s:.0f} s without an "
                    f"answer ({exc}); the batch runs on in the gateway: "
                    f"tandem batch watch {batch_id}"
                ) from None
            line.show(f"waiting for the gateway for {_clock(waited_s)}: {exc}")
            sleep(pause_s)
            pause_s = min(pause_s * 2, RETRY_MAX_S)
            continue
        outage_since, pause_s = None, interval_s
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        first_done = done if first_done is None else first_done
        line.show(
            progress_line(
                batch["status"],
                done,
                counts["failed"],
                counts["total"],
                done - first_done,
                clock() - started,
            )
        )
        if batch["status"] in FINAL:
            line.end()
            _print(batch)
            return 0 if batch["status"] == "completed" else 1
        sleep(interval_s)


class _Line:
    """One status line redrawn in place (a carriage return, then blanks over what the last
    one left)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._width = 0

    def show(self, text: str) -> None:
        self._out.write("\r" + text.ljust(self._width))
        self._out.flush()
        self._width = len(text)

    def end(self) -> None:
        if self._width:
            self._out.write("\n")
            self._out.flush()
            self._width = 0


def progress_line(
    status: str, done: int, failed: int, total: int, done_since_start: int, elapsed_s: float
) -> str:
    """`[#####-----] 12/40 lines (1 failed) 2.0/s ETA 0:00:14 in_progress`."""
    share = done / total if total else 0.0
    filled = round(share * _BAR_WIDTH)
    bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
    rate = done_since_start / elapsed_s if elapsed_s > 0 else 0.0
    if status in FINAL:
        eta = "done"
    elif rate > 0 and total:
        eta = "ETA " + _clock((total - done) / rate)
    else:
        eta = "ETA --:--:--"
    failed_text = f" ({failed} failed)" if failed else ""
    return f"[{bar}] {done}/{total} lines{failed_text} {rate:.1f}/s {eta} {status:<11}"


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
