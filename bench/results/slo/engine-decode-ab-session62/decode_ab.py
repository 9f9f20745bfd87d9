"""One-off study (session 62): is the tandem-patched engine slower per iteration than stock SGLang?

Each mode starts a fresh `tandem serve` (engine as the live bench starts it: 64 request slots,
16,384 KV tokens, one torch thread, SGLang's info log with a decode line per iteration), sends
8 short requests to warm it, then 64 requests at once straight to the engine (100-token prompts,
150 tokens each, ignore_eos), and reads SGLang's own "gen throughput" of every decode log line
taken with all 64 running. Modes: `stock` (SGLang's priority scheduler, no plugin), `tandem`
(the plugin with config.yaml's tandem options), `fcfs` (the plugin with the FCFS policy).

    python bench/results/slo/engine-decode-ab-session62/decode_ab.py \
        stock tandem fcfs stock tandem fcfs stock tandem fcfs
"""

import asyncio
import random
import re
import secrets
import sys
import time
from pathlib import Path

import aiohttp
import yaml

from bench.live import free_port, served

CONFIG_YAML = Path(__file__).parents[4] / "config.yaml"
OPTS = yaml.safe_load(CONFIG_YAML.read_text())["engine"]["policy_options"]


def cfg(mode, port, gport, wd):
    eng = {
        "kind": "sglang",
        "port": port,
        "launch": True,
        "device": "cpu",
        "max_total_tokens": 16384,
        "max_running_requests": 64,
        "chunked_prefill_size": 512,
        "log_file": str(wd / "engine.log"),
        "startup_timeout_s": 300,
        "extra_args": ["--log-level", "info", "--decode-log-interval", "1"],
    }
    if mode == "stock":
        eng.update(patch=False, enable_priority_scheduling=True)
    else:
        eng.update(
            patch=True,
            policy=mode,
            profile="cpu-tiny",
            policy_options=OPTS if mode == "tandem" else {},
        )
    return {
        "gateway": {"host": "127.0.0.1", "port": gport},
        "database": {"url": f"sqlite+aiosqlite:///{wd / 'tandem.db'}"},
        "engine": eng,
    }


async def load(port, key, n=64, out=150):
    rng = random.Random(0)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:

        async def one(i):
            ids = [rng.randrange(100, 2000) for _ in range(100)]
            async with s.post(
                f"http://127.0.0.1:{port}/generate",
                json={
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": out,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                },
            ) as r:
                await r.read()

        t = time.monotonic()
        await asyncio.gather(*[one(i) for i in range(n)])
        return time.monotonic() - t


def main(modes):
    res = []
    for k, mode in enumerate(modes):
        wd = Path(f"/tmp/decode-ab/{k}-{mode}")
        wd.mkdir(parents=True, exist_ok=True)
        port, gport = free_port(), free_port()
        p = wd / "config.yaml"
        p.write_text(yaml.safe_dump(cfg(mode, port, gport, wd)))
        key = secrets.token_hex(8)
        with served(p, secrets.token_hex(8), wd / "gateway.log", gport, key):
            asyncio.run(load(port, key, 8, 10))  # warm
            wall = asyncio.run(load(port, key))
        tps = [
            float(m.group(2))
            for m in re.finditer(
                r"#running-req: (\d+),.*?gen throughput \(token/s\): ([\d.]+)",
                (wd / "engine.log").read_text(),
            )
            if m.group(1) == "64"
        ]
        tps.sort()
        med = tps[len(tps) // 2] if tps else None
        res.append((mode, round(wall, 2), len(tps), med))
        print(
            mode,
            "wall",
            round(wall, 2),
            "n64",
            len(tps),
            "median gen tok/s at 64 running",
            med,
            flush=True,
        )
    print(res)


if __name__ == "__main__":
    main(sys.argv[1:])
