"""Bring your own trace: the JSONL trace format of API.md, its replay workload, and a converter
from the Azure LLM inference CSVs.

One request a line::

    {"t_ms": 0, "input_len": 512, "output_len": 128, "tier": "rt"|"be" (default rt),
     "prefix_hashes": [ints] (one per 512-token block; equal = shared prefix),
     "tenant": "name" (optional)}

Convert an Azure trace (one command)::

    python -m bench.trace convert-azure ../shared/data/azure_llm_2023_conv.csv OUT.jsonl \
        [--tier rt|be] [--limit N] [--mean-turns T [--seed S]]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.workloads.azure import load_trace
from bench.workloads.base import (
    RequestSpec,
    SpecSource,
    TenantSpec,
    Workload,
    WorkloadParams,
    max_new_for,
)
from bench.workloads.sampling import BLOCK_TOKENS
from bench.workloads.sources import TimedSource
from common.wire import Tier

DEFAULT_TTFT_S, DEFAULT_TPOT_S = 0.4, 0.2
OUTPUT_CAP = 2048


class TraceError(ValueError):
    """A trace file that does not follow the schema (the message names file, line and field)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_line(obj: Any, where: str) -> dict[str, Any]:
    """The validated fields of one parsed line; TraceError naming the line and field."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    t_ms = obj.get("t_ms")
    if (
        not isinstance(t_ms, int | float)
        or isinstance(t_ms, bool)
        or not math.isfinite(t_ms)
        or t_ms < 0
    ):
        raise TraceError(f"{where}: field 't_ms' must be a number ≥ 0, got {t_ms!r}")
    for name in ("input_len", "output_len"):
        if not _is_int(obj.get(name)) or obj[name] < 1:
            raise TraceError(
                f"{where}: field {name!r} must be an integer ≥ 1, got {obj.get(name)!r}"
            )
    tier = obj.get("tier", "rt")
    if tier not in ("rt", "be"):
        raise TraceError(f'{where}: field \'tier\' must be "rt" or "be", got {tier!r}')
    hashes = obj.get("prefix_hashes", [])
    if not isinstance(hashes, list) or not all(_is_int(h) for h in hashes):
        raise TraceError(f"{where}: field 'prefix_hashes' must be a list of integers")
    if len(hashes) > math.ceil(obj["input_len"] / BLOCK_TOKENS):
        raise TraceError(
            f"{where}: field 'prefix_hashes' has {len(hashes)} hashes, more than "
            f"the {math.ceil(obj['input_len'] / BLOCK_TOKENS)} blocks of "
            f"{BLOCK_TOKENS} tokens in input_len {obj['input_len']}"
        )
    tenant = obj.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise TraceError(f"{where}: field 'tenant' must be a string, got {tenant!r}")
    return {
        "t_ms": float(t_ms),
        "input_len": obj["input_len"],
        "output_len": obj["output_len"],
        "tier": tier,
        "prefix_hashes": tuple(hashes),
        "tenant": tenant,
    }


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every request of a JSONL trace, validated (blank lines skipped), in file order."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
        rows.append(_check_line(obj, where) | {"line": lineno})
    if not rows:
        raise TraceError(f"{path}: no requests")
    return rows


def trace_requests(
    rows: Sequence[dict[str, Any]],
    params: WorkloadParams,
    *,
    rate_scale: float = 1.0,
    ttft_target_s: float = DEFAULT_TTFT_S,
    tpot_target_s: float = DEFAULT_TPOT_S,
) -> list[RequestSpec]:
    """The trace's requests; arrival = t_ms / 1000 / rate_scale (rate_scale 2 = twice as fast),
    relative to the earliest line. RT requests get the given TTFT/TPOT targets."""
    if rate_scale <= 0:
        raise TraceError(f"--rate-scale must be > 0, got {rate_scale}")
    t0 = min(row["t_ms"] for row in rows)
    specs = []
    for row in rows:
        rt = row["tier"] == "rt"
        specs.append(
            RequestSpec(
                rid=f"{row['tier']}-{row['line']:06d}",
                tier=row["tier"],
                arrival_s=(row["t_ms"] - t0) / 1000.0 / rate_scale,
                prompt_len=row["input_len"],
                output_len=row["output_len"],
                max_new_tokens=max_new_for(params, row["output_len"], OUTPUT_CAP),
                ttft_target_s=ttft_target_s if rt else None,
                tpot_target_s=tpot_target_s if rt else None,
                length_key=row["tenant"] or row["tier"],
                tenant_id=row["tenant"] or "",
                order_key=float(row["line"]),
                prefix_hashes=row["prefix_hashes"],
            )
        )
    return specs


def build_trace_workload(
    path: str | Path,
    params: WorkloadParams,
    *,
    rate_scale: float = 1.0,
    ttft_target_s: float = DEFAULT_TTFT_S,
    tpot_target_s: float = DEFAULT_TPOT_S,
) -> Workload:
    """A replay of the trace file as a Workload (no λ*: the trace sets the rate)."""
    rows = read_trace(path)
    specs = trace_requests(
        rows,
        params,
        rate_scale=rate_scale,
        ttft_target_s=ttft_target_s,
        tpot_target_s=tpot_target_s,
    )
    span = max(s.arrival_s for s in specs)
    tiers: dict[str, Tier] = {}
    for row in rows:  # a tenant's tier is that of its first line
        if row["tenant"] is not None:
            tiers.setdefault(row["tenant"], row["tier"])
    rt_count = sum(s.tier == "rt" for s in specs)

    def make_source(rate: float | None, include_be: bool) -> SpecSource:
        return TimedSource(s for s in specs if include_be or s.tier == "rt")

    return Workload(
        name="trace",
        description=f"trace replay of {Path(path).name} ({len(specs)} requests, "
        f"rate × {rate_scale:g})",
        make_source=make_source,
        longest_prompt=max(s.prompt_len for s in specs),
        window_s=span if span > 0 else None,
        rt_poisson=None,
        has_rt=rt_count > 0,
        has_be=rt_count < len(specs),
        tenants=tuple(TenantSpec(name, tier, 1.0) for name, tier in tiers.items()),
        params={
            "trace_file": str(path),
            "requests": len(specs),
            "rt_requests": rt_count,
            "rate_scale": rate_scale,
            "span_s": span,
            "rt_mean_rate_req_s": rt_count / span if span > 0 else None,
            "rt_ttft_s": ttft_target_s,
            "rt_tpot_s": tpot_target_s,
        },
    )


def convert_azure(
    csv_path: str | Path,
    out_path: str | Path,
    *,
    tier: str = "rt",
    limit: int | None = None,
    mean_turns: float | None = None,
    seed: int = 0,
) -> int:
    """Writes an Azure trace CSV as trace JSONL (tenant = the file's stem); returns the number
    of lines written.

    The CSVs carry token counts only, no conversation. *mean_turns* (≥ 1) makes conversations
    up, seeded: in time order each request starts a new conversation with probability
    1 / mean_turns, else it is the next turn of one of the 256 most recent ones (at random); a
    turn's prompt blocks are its conversation's history, so block j of every turn of one
    conversation is the same block — `prefix_hashes` shared across its turns, as a chat
    service's prompts (earlier turns resent) share a prefix."""
    trace = load_trace(Path(csv_path))
    count = len(trace) if limit is None else min(limit, len(trace))
    tenant = Path(csv_path).stem
    rng = np.random.default_rng(seed)
    recent: list[int] = []  # open conversations, oldest first
    conversations = 0
    with open(out_path, "w") as fh:
        for i in range(count):
            prompt = int(trace.prompt_lens[i])
            line: dict[str, Any] = {
                "t_ms": round(float(trace.times_s[i]) * 1000.0, 3),
                "input_len": prompt,
                "output_len": int(trace.output_lens[i]),
                "tier": tier,
                "tenant": tenant,
            }
            if mean_turns is not None:
                if not recent or rng.random() < 1.0 / mean_turns:
                    conversation = conversations
                    conversations += 1
                    recent.append(conversation)
                    del recent[:-256]
                else:
                    conversation = recent[int(rng.integers(len(recent)))]
                blocks = prompt // BLOCK_TOKENS
                line["prefix_hashes"] = [conversation * 4096 + j for j in range(blocks)]
            fh.write(json.dumps(line) + "\n")
    return count


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.trace convert-azure CSV OUT.jsonl [--tier rt|be] [--limit N]`."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert-azure", help="Azure LLM trace CSV → trace JSONL")
    conv.add_argument("csv", help="e.g. ../shared/data/azure_llm_2023_conv.csv")
    conv.add_argument("out", help="the JSONL file to write")
    conv.add_argument("--tier", choices=["rt", "be"], default="rt", help="tier of every line")
    conv.add_argument("--limit", type=int, default=None, help="only the first N requests")
    conv.add_argument(
        "--mean-turns",
        type=float,
        default=None,
        help="make up conversations of this many turns on average, sharing prompt prefixes",
    )
    conv.add_argument("--seed", type=int, default=0, help="seed of the conversations")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        print("bench.trace: error: --limit must be ≥ 1", file=sys.stderr)
        return 2
    if args.mean_turns is not None and not args.mean_turns >= 1:
        print("bench.trace: error: --mean-turns must be ≥ 1", file=sys.stderr)
        return 2
    try:
        count = convert_azure(
            args.csv,
            args.out,
            tier=args.tier,
            limit=args.limit,
            mean_turns=args.mean_turns,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"bench.trace: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} requests to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
