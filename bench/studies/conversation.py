"""Multi-turn chats on the real engine: is a conversation's next turn judged and planned by the
tokens it adds, or by its whole history?

An RT tenant's chats are conversations: each turn sends the history (every earlier message and
reply) and a new message, and the engine's prefix cache holds the history from the turn
before. This study runs the README's chat tenant (TTFT 500 ms, TPOT 100 ms, refused when the
gateway forecasts a miss) on a fresh `tandem serve` (the built-in tiny model on this CPU, the
default config, tandem's policy), through the OpenAI chat API:

1. **alone** — `--conversations` conversations of `--turns` turns, their turns interleaved
   (turn 1 of each, then turn 2 of each, …), each user message a new part of a document
   (about 200 tokens), each reply `--reply-tokens` long, nothing else running;
2. **beside a batch** — a Batch API batch of `--batch-lines` lines (`--batch-max-tokens` each)
   is created; once the engine runs its lines, new conversations as above, for as long as the
   batch runs;
3. the batch is waited for to the end and its output file checked line by line.

Reported per phase (``results.json`` and ``README.md`` under ``--out``): per turn number, the
prompt tokens, TTFT p50, turns that met the contract, turns the gateway refused (429
`slo_unattainable`); and the engine's counters over the run: prefix matches of waiting requests
and the tokens they found in the cache, the latency model's error (|predicted − measured| ÷
measured, p50 and p99 of its recent iterations).

    python -m bench.studies.conversation --out bench/results/conversation/after

Every process the study starts is stopped when it ends or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.live import engine_control_get, served
from bench.studies.new_user import (
    BATCH_TIMEOUT_S,
    DOCUMENT,
    MODEL,
    README_CONTRACT,
    Gateway,
    config_for,
    wait_for,
)
from common.wire import CONTROL_ITERATIONS_PATH, CONTROL_LOAD_PATH, CONTROL_STATS_PATH

RESENDS = 2
"""A refused turn is sent again this many times at most, each after its `Retry-After` (the
OpenAI Python client's default for a 429)."""
ENGINE_COUNTERS = ("prefix_matches", "waiting_cached_tokens", "iterations")


@dataclass(frozen=True)
class Options:
    """What one run does (the command line's flags)."""

    conversations: int = 4
    turns: int = 6
    reply_tokens: int = 24
    batch_lines: int = 50
    batch_max_tokens: int = 200


@dataclass
class Turn:
    """One turn as the client saw it."""

    conversation: int
    turn: int
    status: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """What the engine's prefix cache held of its prompt (`usage.prompt_tokens_details`)."""
    ttft_s: float | None = None
    tpot_s: float | None = None
    error_code: str | None = None
    retry_after_s: float | None = None
    """A refusal's `Retry-After`, seconds."""
    attempt: int = 0
    """0 for the first try, then each resend after a refusal."""
    sent_unix_s: float = 0.0
    """When it was sent (wall clock: the engine's iteration log's clock)."""

    def met(self, contract: dict[str, float]) -> bool:
        """Served within the contract's TTFT and TPOT."""
        return (
            self.status == 200
            and self.ttft_s is not None
            and self.ttft_s * 1000 <= contract["ttft_ms"]
            and (self.tpot_s is None or self.tpot_s * 1000 <= contract["tpot_ms"])
        )


@dataclass
class Phase:
    """The turns of one phase."""

    name: str
    turns: list[Turn] = field(default_factory=list)

    def summary(self, contract: dict[str, float]) -> dict[str, Any]:
        served_turns = [t for t in self.turns if t.status == 200]
        asked = {(t.conversation, t.turn) for t in self.turns}
        by_turn: list[dict[str, Any]] = []
        for n in sorted({t.turn for t in self.turns}):
            these = [t for t in self.turns if t.turn == n]
            turns_asked = len({t.conversation for t in these})
            ttfts = [t.ttft_s for t in these if t.ttft_s is not None]
            prompts = [t.prompt_tokens for t in these if t.prompt_tokens is not None]
            cached = [t.cached_tokens for t in these if t.cached_tokens is not None]
            by_turn.append(
                {
                    "turn": n,
                    "turns": turns_asked,
                    "requests": len(these),
                    "prompt_tokens_p50": statistics.median(prompts) if prompts else None,
                    "cached_tokens_p50": statistics.median(cached) if cached else None,
                    "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                    "met": sum(t.met(contract) for t in these),
                    "refused": sum(t.status == 429 for t in these),
                }
            )
        return {
            "turns": len(asked),
            "requests": len(self.turns),
            "served": len(served_turns),
            "refused": sum(t.status == 429 for t in self.turns),
            "turns_never_served": len(asked) - len(served_turns),
            "failed": sum(t.status not in (200, 429) for t in self.turns),
            "met": sum(t.met(contract) for t in self.turns),
            "admitted_attainment": (
                sum(t.met(contract) for t in served_turns) / len(served_turns)
                if served_turns
                else None
            ),
            "by_turn": by_turn,
        }


async def send_turn(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    messages: list[dict[str, str]],
    reply_tokens: int,
    conversation: int,
    turn: int,
) -> tuple[Turn, str]:
    """One streamed turn; its record and the reply's text (the next turn's history)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": reply_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    started = time.perf_counter()
    sent_unix_s = time.time()
    stamps: list[float] = []
    text: list[str] = []
    async with session.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        record = Turn(
            conversation=conversation, turn=turn, status=resp.status, sent_unix_s=sent_unix_s
        )
        if resp.status != 200:
            if "Retry-After" in resp.headers:
                record.retry_after_s = float(resp.headers["Retry-After"])
            try:
                record.error_code = (await resp.json())["error"]["code"]
            except (aiohttp.ContentTypeError, KeyError, TypeError, ValueError):
                record.error_code = f"HTTP {resp.status}"
            return record, ""
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
            usage = event.get("usage")
            if usage:
                record.prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    record.cached_tokens = int(details["cached_tokens"])
                if int(usage["completion_tokens"]) > len(stamps):
                    stamps += [time.perf_counter()] * (
                        int(usage["completion_tokens"]) - len(stamps)
                    )
    if stamps:
        record.ttft_s = stamps[0] - started
    if len(stamps) > 1:
        record.tpot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return record, "".join(text)


async def conversations(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    phase: Phase,
    options: Options,
    first_id: int,
    while_: Any = None,
) -> Phase:
    """`options.conversations` conversations of `options.turns` turns, turns interleaved, one
    request at a time; stops early when *while_* (checked before each turn) is false. A refused
    turn is sent again after its `Retry-After`, up to `RESENDS` times (as the OpenAI client
    libraries retry a 429); one refused every time is not part of the history."""
    histories: list[list[dict[str, str]]] = [[] for _ in range(options.conversations)]
    for turn in range(options.turns):
        for c, history in enumerate(histories):
            if while_ is not None and not await while_():
                return phase
            conversation = first_id + c
            ask = {
                "role": "user",
                "content": f"Conversation {conversation}, part {turn}: " + DOCUMENT * 3,
            }
            for attempt in range(RESENDS + 1):
                record, reply = await send_turn(
                    session,
                    base_url,
                    key,
                    [*history, ask],
                    options.reply_tokens,
                    conversation,
                    turn,
                )
                record.attempt = attempt
                phase.turns.append(record)
                if record.status != 429 or attempt == RESENDS:
                    break
                await asyncio.sleep(record.retry_after_s or 1.0)
            if record.status == 200:
                history += [ask, {"role": "assistant", "content": reply}]
    return phase


async def engine_stats(engine_port: int) -> dict[str, Any]:
    """The engine's `/stats` (the control endpoint)."""
    status, stats = await asyncio.to_thread(
        engine_control_get, engine_port, CONTROL_STATS_PATH, 10.0
    )
    if status != 200 or not isinstance(stats, dict):
        raise RuntimeError(f"the engine's /stats answered {status}: {stats}")
    return stats


def counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The engine's counters over a phase, and its latency model's recent error."""
    out: dict[str, Any] = {k: after.get(k, 0) - before.get(k, 0) for k in ENGINE_COUNTERS}
    for k in ("latency_corrected_error_p50", "latency_corrected_error_p99"):
        out[k] = after.get(k)
    return out


async def scenario(base_url: str, token: str, engine_port: int, options: Options) -> dict[str, Any]:
    contract: dict[str, float] = dict(README_CONTRACT)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        gw = Gateway(base_url, token, session)
        chat_key = await gw.tenant("chat", "rt", contract)
        docs_key = await gw.tenant("docs", "be", {})
        warm = Options(conversations=1, turns=2, reply_tokens=4)
        await conversations(session, base_url, chat_key, Phase("warm-up"), warm, 900)

        start = await engine_stats(engine_port)
        alone = await conversations(session, base_url, chat_key, Phase("alone"), options, 0)
        after_alone = await engine_stats(engine_port)
        print(f"alone: {alone.summary(contract)}", file=sys.stderr)

        batch_id = await gw.create_batch(docs_key, options.batch_lines, options.batch_max_tokens)

        async def be_running() -> bool:
            status, load = await asyncio.to_thread(
                engine_control_get, engine_port, CONTROL_LOAD_PATH, 5.0
            )
            return status == 200 and isinstance(load, dict) and bool(load.get("num_be_running"))

        async def batch_runs() -> bool:
            batch = await gw.batch(docs_key, batch_id)
            return bool(batch["status"] in ("validating", "in_progress"))

        await wait_for(be_running, 300, "the batch's lines to run on the engine")
        before_beside = await engine_stats(engine_port)
        beside = await conversations(
            session, base_url, chat_key, Phase("beside_batch"), options, 100, batch_runs
        )
        after_beside = await engine_stats(engine_port)
        print(f"beside the batch: {beside.summary(contract)}", file=sys.stderr)
        # the engine's last iterations (measured, predicted, token mix): where a slow turn went
        status, log = await asyncio.to_thread(
            engine_control_get, engine_port, CONTROL_ITERATIONS_PATH, 10.0
        )
        iterations = log.get("iterations", []) if status == 200 and isinstance(log, dict) else []

        async def batch_done() -> dict[str, Any] | None:
            b = await gw.batch(docs_key, batch_id)
            return b if b["status"] in ("completed", "failed", "expired", "cancelled") else None

        final = await wait_for(batch_done, BATCH_TIMEOUT_S, "the batch to end", every_s=2.0)
        lines = await gw.output_lines(docs_key, final.get("output_file_id"))
        full = sum(
            1
            for line in lines
            if line.get("response", {}).get("status_code") == 200
            and line["response"]["body"]["usage"]["completion_tokens"] == options.batch_max_tokens
        )
    return {
        "contract": contract,
        "options": asdict(options),
        "alone": {**alone.summary(contract), "engine": counters(start, after_alone)},
        "beside_batch": {
            **beside.summary(contract),
            "engine": counters(before_beside, after_beside),
        },
        "batch": {
            "status": final["status"],
            "request_counts": final["request_counts"],
            "lines_with_full_output": full,
        },
        "iterations_beside_batch": iterations,
        "turns": {
            "alone": [asdict(t) for t in alone.turns],
            "beside_batch": [asdict(t) for t in beside.turns],
        },
    }


def report(result: dict[str, Any], command: str) -> str:
    """README.md of one run."""
    out = [
        "# Multi-turn chats on the real engine",
        "",
        f"`{command}`",
        "",
        f"Contract: TTFT {result['contract']['ttft_ms']} ms, TPOT {result['contract']['tpot_ms']}"
        " ms (refused when the gateway forecasts a miss).",
        "",
    ]
    for name in ("alone", "beside_batch"):
        phase = result[name]
        engine = phase["engine"]
        out += [
            f"## {name}",
            "",
            f"{phase['met']} of {phase['turns']} turns met the contract; {phase['requests']} "
            f"requests, {phase['refused']} of them refused (a refused turn is sent again "
            f"after its Retry-After, twice at most), {phase['turns_never_served']} turns "
            f"never served, {phase['failed']} failed; admitted attainment "
            f"{phase['admitted_attainment']}. Engine: {engine['prefix_matches']} prefix matches "
            f"found {engine['waiting_cached_tokens']} cached tokens; latency model error "
            f"p50 {engine['latency_corrected_error_p50']}, "
            f"p99 {engine['latency_corrected_error_p99']}.",
            "",
            "| turn | turns | requests | prompt tokens p50 | cached p50 | TTFT p50 s | met | "
            "refused |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in phase["by_turn"]:
            ttft = row["ttft_p50_s"]
            out.append(
                f"| {row['turn']} | {row['turns']} | {row['requests']} | "
                f"{row['prompt_tokens_p50']} | {row['cached_tokens_p50']} | "
                f"{'–' if ttft is None else f'{ttft:.3f}'} | {row['met']} | {row['refused']} |"
            )
        out.append("")
    batch = result["batch"]
    out.append(
        f"Batch: {batch['status']}, {batch['request_counts']}, "
        f"{batch['lines_with_full_output']} lines with their full output."
    )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.conversation", description=__doc__.split("\n\n")[0]
    )
    d = Options()
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    parser.add_argument("--batch-lines", type=int, default=d.batch_lines)
    parser.add_argument("--batch-max-tokens", type=int, default=d.batch_max_tokens)
    parser.add_argument(
        "--torch-native-extend",
        choices=("new-rows", "stock"),
        default="new-rows",
        help="the engine's prompt attention (engine.torch_native_extend)",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.reply_tokens, args.batch_lines) < 1:
        parser.error("--conversations, --turns, --reply-tokens and --batch-lines must be ≥ 1")
    options = Options(
        conversations=args.conversations,
        turns=args.turns,
        reply_tokens=args.reply_tokens,
        batch_lines=args.batch_lines,
        batch_max_tokens=args.batch_max_tokens,
    )
    command = "python -m bench.studies.conversation " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "tandem.db").unlink(missing_ok=True)
    cfg, port = config_for("tandem", out, _new_user_options())
    cfg["engine"]["torch_native_extend"] = args.torch_native_extend
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_hex(16)
    with served(config_path, token, out / "gateway.log", port) as base_url:
        result = asyncio.run(scenario(base_url, token, int(cfg["engine"]["port"]), options))
    result["command"] = command
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "README.md").write_text(report(result, command))
    print(report(result, command))
    return 0


def _new_user_options() -> Any:
    """The new-user study's options for `config_for` (its defaults: the engine's profile
    measured on first start, as `tandem serve` does)."""
    from bench.studies.new_user import Options as NewUserOptions

    return NewUserOptions()


if __name__ == "__main__":
    raise SystemExit(main())
