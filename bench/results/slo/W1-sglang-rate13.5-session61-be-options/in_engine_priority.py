"""One-off study (session 61): the simulator's stand-in for stock SGLang priority scheduling
(`backend/policy/baselines/sglang_like.py`, registry name `priority`) run *inside* the patched
real engine, in place of stock SGLang's own priority scheduler, on the live bench's W1 (cpu) at
a fixed RT rate. The engine logs every iteration of the stand-in's plans, so its behaviour on
the real engine can be set beside stock priority's (the `priority` row of `../run1/`) and the
simulator twin's.

    python bench/results/slo/W1-sglang-rate13.5-session61-be-options/in_engine_priority.py \
        /tmp/in-engine 13.5 90

It reuses the live bench's machinery and swaps two of its decisions for the row `priority`
(the engine section: tandem's plugin with the `priority` policy; and "is this row run by a
policy of ours", which makes the bench follow the engine's iterations and read its `/stats`).
The live bench has no such row: this is a measurement, not a mode of the product.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import bench.live as live
from bench.live_report import write_live_outputs
from bench.runner import BenchConfig

ROW = "priority"
_stock_section = live.engine_section
_stock_base_name = live.base_name


def in_engine_section(name: str, run: live.LiveRun, profile: Any, *rest: Any) -> dict[str, Any]:
    """The live bench's engine section, with the simulator's `priority` in charge for ROW (its
    prefill batches capped at the real engine's chunked_prefill_size, as stock SGLang's are)."""
    section = _stock_section(name, run, profile, *rest)
    if name == ROW:
        section.pop("enable_priority_scheduling", None)
        section.update(
            patch=True,
            policy="priority",
            profile=str(rest[0]),
            policy_options={"chunk_tokens": profile.max_prefill_tokens},
        )
    return section


def main(out_dir: Path, rt_rate_req_s: float, duration_s: float) -> None:
    live.engine_section = in_engine_section
    # ROW is followed like tandem's rows (iterations, /stats); its twin is the same policy
    live.base_name = lambda spec: "tandem" if spec == ROW else _stock_base_name(spec)
    live.SIM_POLICY["tandem"] = "priority"
    config = BenchConfig(
        workload="W1",
        out_dir=out_dir,
        engine="sglang",
        policies=(ROW,),
        rt_rate_req_s=rt_rate_req_s,
        duration_s=duration_s,
        profile="cpu-tiny",
        seed=0,
        variant="cpu",
        command=f"in_engine_priority.py {out_dir} {rt_rate_req_s:g} {duration_s:g}",
    )
    run = live.run_live(live.live_config(config))
    write_live_outputs(run, out_dir)


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
