"""Were the SLO admission's refusals needed? Each refused RT request against the ones admitted
beside it, in a live bench's run.

A refused request never runs, so whether it would have met its contract cannot be measured; the
requests admitted within a few seconds of its arrival (`--window-s`, both sides) ran on the same
engine in about the state it was judged on. Their worst first token is the best evidence there
is: when every one of them met its TTFT target, with room to spare, the refused one — queued at
about the same moment, so about last among them — most likely would have too. This reads the
per-policy `requests.json` a live bench writes (`tandem bench … --engine sglang`:
`OUT/live/<policy>/requests.json`) and reports, per policy: the RT requests offered and shed,
the admitted ones that missed their TTFT target, and for the shed ones the median and worst of
their neighbours' worst first token and how many shed requests had every neighbour within the
target (refusals the run shows no need for; how close the neighbours came is the worst first
token's median and maximum).

    python -m bench.studies.refusals /tmp/w1-run/live           # every policy in it
    python -m bench.studies.refusals /tmp/w1-run/live --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import msgspec


class RefusalSummary(msgspec.Struct, frozen=True):
    """One policy's refusals against its admitted neighbours (the module doc)."""

    policy: str
    rt_offered: int
    """RT requests sent (with a TTFT target)."""
    rt_shed: int
    """Of them, refused by the SLO admission (never run)."""
    rt_admitted_late: int
    """Admitted RT requests whose first token came after their TTFT target."""
    shed_with_neighbours: int
    """Shed requests with at least one admitted RT neighbour within the window."""
    shed_neighbours_all_met: int
    """Of those, the ones whose every admitted neighbour met its TTFT target."""
    neighbour_worst_ttft_p50_s: float | None
    """Median over the shed requests of their neighbours' worst first token, seconds."""
    neighbour_worst_ttft_max_s: float | None
    """The largest of them, seconds."""
    ttft_target_s: float | None
    """The shed requests' TTFT target (the smallest, when they differ), seconds."""


def summarise(policy: str, requests: list[dict[str, Any]], window_s: float) -> RefusalSummary:
    """The summary of one policy's *requests* (a live bench's `requests.json` rows), neighbours
    taken within *window_s* of each shed request's arrival."""
    rt = [r for r in requests if r.get("ttft_target_s") is not None]
    shed = sorted((r for r in rt if r["admission"] == "shed"), key=lambda r: r["arrival_s"])
    admitted = [
        (r["arrival_s"], r["first_token_s"] - r["arrival_s"], r["ttft_target_s"])
        for r in rt
        if r["admission"] != "shed" and r["first_token_s"] is not None
    ]
    late = sum(
        1
        for r in rt
        if r["admission"] != "shed"
        and (r["first_token_s"] is None or r["first_token_s"] - r["arrival_s"] > r["ttft_target_s"])
    )
    worst: list[float] = []
    all_met = 0
    for s in shed:
        near = [
            (ttft, target) for at, ttft, target in admitted if abs(at - s["arrival_s"]) <= window_s
        ]
        if not near:
            continue
        worst.append(max(ttft for ttft, _ in near))
        all_met += all(ttft <= target for ttft, target in near)
    return RefusalSummary(
        policy=policy,
        rt_offered=len(rt),
        rt_shed=len(shed),
        rt_admitted_late=late,
        shed_with_neighbours=len(worst),
        shed_neighbours_all_met=all_met,
        neighbour_worst_ttft_p50_s=statistics.median(worst) if worst else None,
        neighbour_worst_ttft_max_s=max(worst) if worst else None,
        ttft_target_s=min((r["ttft_target_s"] for r in shed), default=None),
    )


def read_run(live_dir: Path, window_s: float) -> list[RefusalSummary]:
    """A summary per policy directory of *live_dir* holding a `requests.json`, by name. Raises
    ValueError naming the directory when it holds none."""
    found = sorted(p for p in live_dir.glob("*/requests.json"))
    if not found:
        raise ValueError(f"{live_dir}: no <policy>/requests.json in it (a live bench's live/ dir)")
    out = []
    for path in found:
        rows = json.loads(path.read_text())["requests"]
        out.append(summarise(path.parent.name, rows, window_s))
    return out


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def table(summaries: list[RefusalSummary], window_s: float) -> str:
    """The summaries as a Markdown table."""
    lines = [
        "| policy | RT offered | shed | admitted late | shed with every neighbour "
        f"(±{window_s:g} s) in time | neighbours' worst TTFT p50 s | max s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s.policy} | {s.rt_offered} | {s.rt_shed} | {s.rt_admitted_late} | "
            f"{s.shed_neighbours_all_met} of {s.shed_with_neighbours} | "
            f"{_seconds(s.neighbour_worst_ttft_p50_s)} | {_seconds(s.neighbour_worst_ttft_max_s)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("live_dir", type=Path, help="a live bench's OUT/live directory")
    parser.add_argument("--window-s", type=float, default=1.0, help="neighbours' arrival window")
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args(argv)
    if not args.window_s > 0.0:
        parser.error(f"--window-s must be > 0, got {args.window_s}")
    try:
        summaries = read_run(args.live_dir, args.window_s)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))
    print(table(summaries, args.window_s))
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(summaries), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
