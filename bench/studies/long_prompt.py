"""RT chats beside BE prompts of 8K tokens on the real CPU engine: does RT wait for BE's prompt?

Issue 15 asks that RT never wait for what BE holds, "including long-prompt mixes where BE prompts
of 8K+ tokens fill the pool". The built-in tiny model's context is 4,096 tokens, so this study
runs a copy of it whose context is ``--context`` tokens (its weights are random either way; RoPE
takes the longer positions), in one patched SGLang engine with tandem's policy, config.yaml's
engine settings and the bundled profile for its prompt attention (``cpu-tiny``, or
``cpu-tiny-stock`` with ``--torch-native-extend stock``; the calibration learns the rest), on a KV
pool of ``--pool-tokens``. The client talks to the engine directly, with the gateway's request
metadata (tier, targets), so what is measured is the engine alone.

Three phases, one after the other on the one engine:

* **alone**: ``--chats`` RT chats (``--rt-prompt`` tokens, 16 out), one after the other;
* **short RT beside long BE**: ``--be-prompts`` BE prompts of ``--be-prompt`` tokens (8 out)
  sent at once (two of 8K fill a 16K pool), and an RT chat as above every second until they end;
* **long RT beside long BE**: one more BE prompt, and RT prompts of ``--rt-long-prompt`` tokens
  (longer than the engine's 512-token chunk, so SGLang must cut them: it cuts one prompt at a
  time) every two seconds until it ends.

Per phase: each RT chat's TTFT (p50, p90, max), how long the BE prompts took, and the engine's
counters over the phase (chunked prompts parked and released, prefills refused); and, from the
engine's iteration log, the time of the iterations that computed an RT prompt from its start
beside those that computed a chunk deep into a BE prompt (prefix ≥ 2,048 tokens).

With ``--gateway`` the study runs instead one phase through `tandem serve` (the gateway and
its SLO admission in front of the same engine, config.yaml's settings but for the model, the
pool, the bundled profile): the BE prompts as a BE tenant's completions, and an RT tenant's
chats (contract TTFT ``--ttft-ms``, TPOT 200 ms, refused when the gateway forecasts a miss)
every second while they run. Reported: the chats the gateway refused (429
`slo_unattainable`), those it admitted that met the contract and those that missed it, and
the admitted chats' TTFT.

    python -m bench.studies.long_prompt --out bench/results/long_prompt/run.json
    python -m bench.studies.long_prompt --gateway --out bench/results/long_prompt/gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from backend.launch.sglang import EngineProcess, engine_base_url, engine_env, server_argv
from backend.launch.tiny_model import ensure_tiny_model
from backend.policy.profiles import bundled_profile_for
from bench.live import engine_control_get
from common.config import load_config
from common.sockets import free_port
from common.wire import (
    CONTROL_ITERATIONS_PATH,
    CONTROL_STATS_PATH,
    IterationRecord,
    RecentIterations,
    RequestMeta,
    meta_to_custom_params,
)

MODEL_NAME = "tandem-tiny-long"
REPO = Path(__file__).resolve().parents[2]
COUNTERS = ("parked_chunks", "released_chunks", "refused_prefills", "evictions", "iterations")
DEEP_PREFIX_TOKENS = 2048
"""A BE chunk after this many tokens of its prompt counts as deep (its prefix dominates)."""


@dataclass(frozen=True)
class Options:
    """What one run does (the command line's flags)."""

    context_tokens: int = 32768
    pool_tokens: int = 16384
    be_prompt_tokens: int = 8192
    be_prompts: int = 2
    rt_prompt_tokens: int = 50
    rt_long_prompt_tokens: int = 1500
    chats: int = 10
    ttft_ms: float = 1000.0
    tpot_ms: float = 200.0
    torch_native_extend: str = "new-rows"
    """The engine's prompt attention (`engine.torch_native_extend`); its bundled profile follows."""


@dataclass
class Phase:
    """One phase's measurements."""

    name: str
    rt_ttft_s: list[float] = field(default_factory=list)
    be_s: list[float] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    rt_prompt_iteration_s: list[float] = field(default_factory=list)
    deep_be_chunk_iteration_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.rt_ttft_s)

        def pct(q: float) -> float | None:
            return ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else None

        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "phase": self.name,
            "rt_chats": len(ttft),
            "rt_ttft_p50_s": pct(0.5),
            "rt_ttft_p90_s": pct(0.9),
            "rt_ttft_max_s": ttft[-1] if ttft else None,
            "be_prompt_s": self.be_s,
            "counters": self.counters,
            "rt_prompt_iterations": len(self.rt_prompt_iteration_s),
            "rt_prompt_iteration_p50_s": med(self.rt_prompt_iteration_s),
            "rt_prompt_iteration_max_s": max(self.rt_prompt_iteration_s, default=None),
            "deep_be_chunk_iterations": len(self.deep_be_chunk_iteration_s),
            "deep_be_chunk_iteration_p50_s": med(self.deep_be_chunk_iteration_s),
        }


def long_context_model(cache_dir: Path, context_tokens: int) -> Path:
    """The built-in tiny model with its context raised to *context_tokens* (a copy)."""
    base = ensure_tiny_model(cache_dir)
    out = cache_dir / f"{base.name}-ctx{context_tokens}"
    if not out.exists():
        tmp = cache_dir / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        for name, key in (
            ("config.json", "max_position_embeddings"),
            ("tokenizer_config.json", "model_max_length"),
        ):
            data = json.loads((tmp / name).read_text())
            data[key] = context_tokens
            (tmp / name).write_text(json.dumps(data, indent=2) + "\n")
        tmp.rename(out)
    return out


class Client:
    """Requests straight to the engine, with the gateway's metadata."""

    def __init__(self, base_url: str, options: Options) -> None:
        self.base_url = base_url
        self.options = options

    def generate(self, ids: list[int], max_new: int, tier: str) -> tuple[float, float]:
        """Streams one greedy generation; (seconds to its first token, seconds to its end)."""
        o = self.options
        meta = RequestMeta(
            tier=tier,  # type: ignore[arg-type]
            tenant_id=f"{tier}-tenant",
            length_key=f"{tier}-tenant",
            arrival_unix_s=time.time(),
            ttft_target_ms=o.ttft_ms if tier == "rt" else None,
            tpot_target_ms=o.tpot_ms if tier == "rt" else None,
            max_tokens=max_new,
        )
        body = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": max_new,
                "temperature": 0,
                "ignore_eos": True,
                "custom_params": meta_to_custom_params(meta),
            },
        }
        request = urllib.request.Request(
            self.base_url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        first: float | None = None
        with urllib.request.urlopen(request, timeout=1800) as resp:
            for line in resp:
                if line.startswith(b"data:") and first is None:
                    first = time.perf_counter() - start
        end = time.perf_counter() - start
        return (first if first is not None else end), end


def prompt(seed: int, tokens: int) -> list[int]:
    """*tokens* token ids, distinct per seed (no prefix shared with another prompt)."""
    return [10 + (seed * 7919 + i * 31) % 4000 for i in range(tokens)]


def control(port: int, path: str) -> Any:
    """The engine's control endpoint's answer to `GET path` (it must answer)."""
    status, body = engine_control_get(port, path, 10.0)
    if status != 200:
        raise RuntimeError(f"the engine's control endpoint answered {path} with {status}: {body}")
    return body


def run_phase(
    name: str,
    client: Client,
    port: int,
    *,
    be_prompts: list[list[int]],
    rt_tokens: int,
    rt_every_s: float,
    chats: int,
    seed: int,
) -> Phase:
    """RT chats every *rt_every_s* while the BE prompts run (or *chats* of them alone)."""
    phase = Phase(name)
    before = control(port, CONTROL_STATS_PATH)
    after = max((r[0] for r in control(port, CONTROL_ITERATIONS_PATH)["iterations"]), default=-1)
    runs: list[IterationRecord] = []
    done = threading.Event()

    def follow() -> None:  # the log keeps the last 1,024 iterations: read it as it grows
        last = after
        while True:
            stopping = done.is_set()
            log = control(port, f"{CONTROL_ITERATIONS_PATH}?after={last}&wait_s=0.5")
            runs.extend(msgspec.convert(log, RecentIterations).iterations)
            last = runs[-1].iteration if runs else last
            if stopping:
                return

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    threads = []
    for ids in be_prompts:

        def be(ids: list[int] = ids) -> None:
            phase.be_s.append(client.generate(ids, 8, "be")[1])

        threads.append(threading.Thread(target=be, daemon=True))
        threads[-1].start()
    n = 0
    while (threads and any(t.is_alive() for t in threads)) or (not threads and n < chats):
        if threads:
            time.sleep(rt_every_s)
        phase.rt_ttft_s.append(client.generate(prompt(seed + n, rt_tokens), 16, "rt")[0])
        n += 1
    for t in threads:
        t.join()
    done.set()
    follower.join()
    stats = control(port, CONTROL_STATS_PATH)
    phase.counters = {k: stats.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    for r in runs:
        mix = r.mix
        if mix is None or mix.num_prefill != 1 or mix.num_decode != 0:
            continue
        prefix = round(mix.prefill_attn_full**0.5) - mix.prefill_tokens
        if prefix == 0 and mix.prefill_tokens <= rt_tokens:
            phase.rt_prompt_iteration_s.append(r.iteration_s)
        elif prefix >= DEEP_PREFIX_TOKENS:
            phase.deep_be_chunk_iteration_s.append(r.iteration_s)
    return phase


def run(options: Options, workdir: Path) -> list[Phase]:
    """One engine, the three phases; the engine is stopped whatever happens."""
    cfg = load_config(REPO / "config.yaml").engine
    engine_cfg = msgspec.structs.replace(
        cfg,
        port=free_port(),
        max_total_tokens=options.pool_tokens,
        max_running_requests=16,
        profile=bundled_profile_for("cpu", options.torch_native_extend),
        control_socket=None,
        torch_native_extend=options.torch_native_extend,
    )
    model = long_context_model(workdir / "model-cache", options.context_tokens)
    engine = EngineProcess(
        server_argv(engine_cfg, model, MODEL_NAME, random_weights=True),
        engine_env(engine_cfg),
        base_url=engine_base_url(engine_cfg),
        log_path=workdir / "engine.log",
    )
    engine.start()
    try:
        engine.wait_ready_sync(600)
        client = Client(engine.base_url, options)
        port = engine_cfg.port
        client.generate(prompt(0, options.rt_prompt_tokens), 4, "rt")  # warm up
        alone = run_phase(
            "alone",
            client,
            port,
            be_prompts=[],
            rt_tokens=options.rt_prompt_tokens,
            rt_every_s=0.0,
            chats=options.chats,
            seed=100,
        )
        beside = run_phase(
            "short RT beside long BE",
            client,
            port,
            be_prompts=[
                prompt(1000 + b, options.be_prompt_tokens) for b in range(options.be_prompts)
            ],
            rt_tokens=options.rt_prompt_tokens,
            rt_every_s=1.0,
            chats=0,
            seed=200,
        )
        cut = run_phase(
            "long RT beside long BE",
            client,
            port,
            be_prompts=[prompt(2000, options.be_prompt_tokens)],
            rt_tokens=options.rt_long_prompt_tokens,
            rt_every_s=2.0,
            chats=0,
            seed=300,
        )
        return [alone, beside, cut]
    finally:
        engine.stop()


@dataclass
class GatewayChat:
    """One RT chat through the gateway."""

    status: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    error_code: str | None = None

    def met(self, options: Options) -> bool:
        return (
            self.status == 200
            and self.ttft_s is not None
            and self.ttft_s * 1000 <= options.ttft_ms
            and (self.tpot_s is None or self.tpot_s * 1000 <= options.tpot_ms)
        )


async def _completion(
    session: Any, base_url: str, key: str, ids: list[int], max_tokens: int
) -> GatewayChat:
    """One streamed greedy completion of token ids through the gateway, timed by token."""
    body = {
        "model": MODEL_NAME,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    started = time.perf_counter()
    stamps: list[float] = []
    async with session.post(
        f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        chat = GatewayChat(status=resp.status)
        if resp.status != 200:
            try:
                chat.error_code = (await resp.json())["error"]["code"]
            except (KeyError, TypeError, ValueError):
                chat.error_code = f"HTTP {resp.status}"
            return chat
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            usage = json.loads(line[5:]).get("usage")
            new = int(usage["completion_tokens"]) - len(stamps) if usage else 0
            if new > 0:
                stamps += [time.perf_counter()] * new
    if stamps:
        chat.ttft_s = stamps[0] - started
    if len(stamps) > 1:
        chat.tpot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return chat


async def _gateway_phase(base_url: str, admin_token: str, options: Options) -> dict[str, Any]:
    import aiohttp

    from bench.live_client import create_tenant_key

    admin = {"Authorization": f"Bearer {admin_token}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        contract = {"ttft_ms": options.ttft_ms, "tpot_ms": options.tpot_ms}
        rt_key = await create_tenant_key(session, base_url, admin, "chat", "rt", contract)
        be_key = await create_tenant_key(session, base_url, admin, "docs", "be", {})
        await _completion(session, base_url, rt_key, prompt(0, options.rt_prompt_tokens), 4)
        be_s: list[float] = []

        async def be(ids: list[int]) -> None:
            started = time.perf_counter()
            done = await _completion(session, base_url, be_key, ids, 8)
            if done.status != 200:
                raise RuntimeError(f"a BE prompt failed: {done}")
            be_s.append(time.perf_counter() - started)

        tasks = [
            asyncio.create_task(be(prompt(1000 + b, options.be_prompt_tokens)))
            for b in range(options.be_prompts)
        ]
        chats: list[GatewayChat] = []
        n = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            ids = prompt(200 + n, options.rt_prompt_tokens)
            chats.append(await _completion(session, base_url, rt_key, ids, 16))
            n += 1
        await asyncio.gather(*tasks)
    admitted = [c for c in chats if c.status == 200]
    ttft = sorted(c.ttft_s for c in admitted if c.ttft_s is not None)
    return {
        "phase": "RT chats beside long BE prompts, through the gateway",
        "rt_chats": len(chats),
        "rt_refused": sum(c.error_code == "slo_unattainable" for c in chats),
        "rt_failed": sum(c.status not in (200, 429) for c in chats),
        "rt_admitted_met": sum(c.met(options) for c in admitted),
        "rt_admitted_missed": sum(not c.met(options) for c in admitted),
        "rt_admitted_ttft_p50_s": statistics.median(ttft) if ttft else None,
        "rt_admitted_ttft_max_s": ttft[-1] if ttft else None,
        "be_prompt_s": be_s,
        "chats": [asdict(c) for c in chats],
    }


def run_gateway(options: Options, workdir: Path) -> dict[str, Any]:
    """The gateway phase on a fresh `tandem serve`; stopped whatever happens."""
    import secrets

    import yaml

    from bench.live import READY_TIMEOUT_S, served
    from common.config import DEFAULT_CONFIG_PATH

    cfg: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    port = free_port()
    (workdir / "tandem.db").unlink(missing_ok=True)
    cfg["gateway"]["port"] = port
    cfg["database"]["url"] = f"sqlite+aiosqlite:///{workdir / 'tandem.db'}"
    cfg["model"].update(
        name=MODEL_NAME,
        path=str(long_context_model(workdir / "model-cache", options.context_tokens)),
        random_weights=True,
    )
    cfg["engine"].update(
        port=free_port(),
        log_file=str(workdir / "engine.log"),
        startup_timeout_s=READY_TIMEOUT_S,
        profile=bundled_profile_for("cpu", options.torch_native_extend),
        torch_native_extend=options.torch_native_extend,
        max_total_tokens=options.pool_tokens,
        max_running_requests=16,
    )
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_hex(16)
    with served(config_path, token, workdir / "gateway.log", port) as base_url:
        return asyncio.run(_gateway_phase(base_url, token, options))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.long_prompt", description=__doc__.split("\n\n")[0]
    )
    d = Options()
    parser.add_argument("--context", type=int, default=d.context_tokens)
    parser.add_argument("--pool-tokens", type=int, default=d.pool_tokens)
    parser.add_argument("--be-prompt", type=int, default=d.be_prompt_tokens)
    parser.add_argument("--be-prompts", type=int, default=d.be_prompts)
    parser.add_argument("--rt-prompt", type=int, default=d.rt_prompt_tokens)
    parser.add_argument("--rt-long-prompt", type=int, default=d.rt_long_prompt_tokens)
    parser.add_argument("--chats", type=int, default=d.chats)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-long-prompt"))
    parser.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="RT TTFT target")
    parser.add_argument(
        "--gateway", action="store_true", help="one phase through tandem serve (see above)"
    )
    parser.add_argument(
        "--torch-native-extend",
        choices=("new-rows", "stock"),
        default=d.torch_native_extend,
        help="the engine's prompt attention (engine.torch_native_extend)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    options = Options(
        context_tokens=args.context,
        pool_tokens=args.pool_tokens,
        be_prompt_tokens=args.be_prompt,
        be_prompts=args.be_prompts,
        rt_prompt_tokens=args.rt_prompt,
        rt_long_prompt_tokens=args.rt_long_prompt,
        chats=args.chats,
        ttft_ms=args.ttft_ms,
        torch_native_extend=args.torch_native_extend,
    )
    if args.be_prompt + 8 > args.context or args.rt_long_prompt + 16 > args.context:
        parser.error("--be-prompt and --rt-long-prompt must fit in --context with their output")
    if min(args.be_prompts, args.chats, args.rt_prompt, args.pool_tokens) < 1:
        parser.error("--be-prompts, --chats, --rt-prompt and --pool-tokens must be ≥ 1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.studies.long_prompt " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.gateway:
        summaries = [run_gateway(options, args.workdir)]
    else:
        summaries = [p.summary() for p in run(options, args.workdir)]
    result = {"command": command, "options": asdict(options), "phases": summaries}
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
