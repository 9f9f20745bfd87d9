"""Bring your own trace: the JSONL trace format of API.md, its replay workload, and a converter
from the Azure LLM inference CSVs.

One request a line::

    {"t_ms": 0, "input_len": 512, "output_len": 128, "tier": "rt"|"be" (default rt),
     "prefix_hashes": [ints] (one per 512-token block; equal = shared prefix),
     "tenant": "name" (optional)}

Convert an Azure trace (one command)::

    python -m bench.trace convert-azure bench/data/azure_llm_2023_conv.csv OUT.jsonl \
        [--tier rt|be] [--limit N] [--mean-turns T [--seed S]]

A heavier trace of the same shape (K copies overlaid, each shifted in time; a fleet's load)::

    python -m bench.trace tile IN.jsonl OUT.jsonl --copies K [--until-s S] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
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


class _Line(msgspec.Struct):
    """One trace line as the fast path decodes it: the schema `_check_line` checks, but for
    the prefix hashes' count (unknown fields ignored, as there)."""

    t_ms: Annotated[float, msgspec.Meta(ge=0)]
    input_len: Annotated[int, msgspec.Meta(ge=1)]
    output_len: Annotated[int, msgspec.Meta(ge=1)]
    tier: Literal["rt", "be"] = "rt"
    prefix_hashes: list[int] = msgspec.field(default_factory=list)
    tenant: str | None = None


_LINE_DECODER = msgspec.json.Decoder(_Line)


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every request of a JSONL trace, validated (blank lines skipped), in file order.

    A line is decoded by msgspec against the schema (a one-hour fleet trace has millions of
    lines: the standard library's parser and the checks in Python took most of two minutes of
    a plan's CPU); a line it refuses goes through `json` and `_check_line`, whose message
    names the field."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    rows = []
    decode = _LINE_DECODER.decode
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = decode(line)
        except (msgspec.DecodeError, UnicodeDecodeError):  # ValidationError is a DecodeError
            rows.append(_slow_line(line, f"{path}:{lineno}") | {"line": lineno})
            continue
        hashes = obj.prefix_hashes
        if len(hashes) > math.ceil(obj.input_len / BLOCK_TOKENS):
            rows.append(_slow_line(line, f"{path}:{lineno}") | {"line": lineno})
            continue
        rows.append(
            {
                "t_ms": obj.t_ms,
                "input_len": obj.input_len,
                "output_len": obj.output_len,
                "tier": obj.tier,
                "prefix_hashes": tuple(hashes),
                "tenant": obj.tenant,
                "line": lineno,
            }
        )
    if not rows:
        raise TraceError(f"{path}: no requests")
    return rows


def _slow_line(line: bytes, where: str) -> dict[str, Any]:
    """A line the fast path refused, checked field by field: TraceError naming the field (or,
    for what only msgspec refuses, the line as `_check_line` accepts it)."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise TraceError(f"{where}: invalid JSON ({msg})") from None
    return _check_line(obj, where)


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
    system_prompt_blocks: int = 0,
    seed: int = 0,
) -> int:
    """Writes an Azure trace CSV as trace JSONL (tenant = the file's stem); returns the number
    of lines written.

    The CSVs carry token counts only, no conversation. *mean_turns* (≥ 1) makes conversations
    up, seeded: in time order each request starts a new conversation with probability
    1 / mean_turns, else it is the next turn of one of the 256 most recent ones (at random); a
    turn's prompt blocks are its conversation's history, so block j of every turn of one
    conversation is the same block — `prefix_hashes` shared across its turns, as a chat
    service's prompts (earlier turns resent) share a prefix.

    *system_prompt_blocks*: every prompt starts with the same this many blocks (a system prompt
    or a chat template every request of the service carries), up to its own length; the
    conversation's blocks follow."""
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
            blocks = prompt // BLOCK_TOKENS
            shared = [SYSTEM_PROMPT_HASH + j for j in range(min(system_prompt_blocks, blocks))]
            if shared:
                line["prefix_hashes"] = shared
            if mean_turns is not None:
                if not recent or rng.random() < 1.0 / mean_turns:
                    conversation = conversations
                    conversations += 1
                    recent.append(conversation)
                    del recent[:-256]
                else:
                    conversation = recent[int(rng.integers(len(recent)))]
                line["prefix_hashes"] = shared + [
                    conversation * 4096 + j for j in range(len(shared), blocks)
                ]
            fh.write(json.dumps(line) + "\n")
    return count


SYSTEM_PROMPT_HASH = 1 << 39
"""Prefix hash of block 0 of the shared system prompt (`convert_azure`), past any
conversation's."""
TILE_HASH_STRIDE = 1 << 40
"""Copy c of a tiled trace adds c × this to its prefix hashes (copies share no prefix)."""


def tile_trace(
    in_path: str | Path,
    out_path: str | Path,
    *,
    copies: int,
    until_s: float | None = None,
    seed: int = 0,
) -> int:
    """Writes *copies* of a trace overlaid as one trace of the same span: copy c is shifted
    by a seeded offset in [0, span) and wrapped around the span (so every copy covers the
    whole span and the rate is *copies* × the original's throughout), its prefix hashes
    moved to their own range (conversations stay within a copy). Lines at or after
    *until_s* (seconds from the start) are left out: a slice of the heavier trace. Returns
    the number of lines written."""
    if copies < 1:
        raise ValueError(f"--copies must be ≥ 1, got {copies}")
    rows = read_trace(in_path)
    t0 = min(row["t_ms"] for row in rows)
    span_ms = max(row["t_ms"] for row in rows) - t0 or 1.0
    limit_ms = math.inf if until_s is None else until_s * 1000.0
    rng = np.random.default_rng(seed)
    lines: list[tuple[float, int, int, dict[str, Any]]] = []
    for c in range(copies):
        offset_ms = 0.0 if c == 0 else float(rng.uniform(0.0, span_ms))
        for i, row in enumerate(rows):
            t_ms = (row["t_ms"] - t0 + offset_ms) % span_ms
            if t_ms >= limit_ms:
                continue
            line = {k: row[k] for k in ("input_len", "output_len", "tier", "tenant")}
            line["prefix_hashes"] = [h + c * TILE_HASH_STRIDE for h in row["prefix_hashes"]]
            lines.append((t_ms, c, i, line))
    lines.sort(key=lambda x: (x[0], x[1], x[2]))
    with open(out_path, "w") as fh:
        for t_ms, _, _, line in lines:
            fh.write(json.dumps({"t_ms": round(t_ms, 3)} | line) + "\n")
    return len(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.trace convert-azure CSV OUT.jsonl [--tier rt|be] [--limit N]`, or
    `python -m bench.trace tile IN.jsonl OUT.jsonl --copies K [--until-s S] [--seed S]`."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert-azure", help="Azure LLM trace CSV → trace JSONL")
    conv.add_argument("csv", help="e.g. bench/data/azure_llm_2023_conv.csv")
    conv.add_argument("out", help="the JSONL file to write")
    conv.add_argument("--tier", choices=["rt", "be"], default="rt", help="tier of every line")
    conv.add_argument("--limit", type=int, default=None, help="only the first N requests")
    conv.add_argument(
        "--mean-turns",
        type=float,
        default=None,
        help="make up conversations of this many turns on average, sharing prompt prefixes",
    )
    conv.add_argument(
        "--system-prompt-blocks",
        type=int,
        default=0,
        help="every prompt starts with the same this many 512-token blocks (a system prompt)",
    )
    conv.add_argument("--seed", type=int, default=0, help="seed of the conversations")
    tile = sub.add_parser("tile", help="K copies of a trace overlaid, shifted (a fleet's load)")
    tile.add_argument("trace", help="a trace JSONL (e.g. one convert-azure wrote)")
    tile.add_argument("out", help="the JSONL file to write")
    tile.add_argument("--copies", type=int, required=True, help="copies overlaid (≥ 1)")
    tile.add_argument("--until-s", type=float, default=None, help="only the first S seconds")
    tile.add_argument("--seed", type=int, default=0, help="seed of the copies' offsets")
    args = parser.parse_args(argv)
    if args.command == "tile":
        try:
            count = tile_trace(
                args.trace, args.out, copies=args.copies, until_s=args.until_s, seed=args.seed
            )
        except ValueError as exc:
            print(f"bench.trace: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {count} requests to {args.out}")
        return 0
    if args.limit is not None and args.limit < 1:
        print("bench.trace: error: --limit must be ≥ 1", file=sys.stderr)
        return 2
    if args.mean_turns is not None and not args.mean_turns >= 1:
        print("bench.trace: error: --mean-turns must be ≥ 1", file=sys.stderr)
        return 2
    if args.system_prompt_blocks < 0:
        print("bench.trace: error: --system-prompt-blocks must be ≥ 0", file=sys.stderr)
        return 2
    try:
        count = convert_azure(
            args.csv,
            args.out,
            tier=args.tier,
            limit=args.limit,
            mean_turns=args.mean_turns,
            system_prompt_blocks=args.system_prompt_blocks,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"bench.trace: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} requests to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
