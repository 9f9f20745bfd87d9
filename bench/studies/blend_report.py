"""Puts the BE-ordering verdict on a `tandem bench W4 --policies fcfs,dfs,blend` report.

    python -m bench.studies.blend_report DIR [--cpu FILE.json]

Rewrites DIR/report.md so that its first line is the exact command of the run (from
results.json) and appends the ratios the Batch API's targets are stated in: blend's total
tokens/s over fcfs's, its prefix reuse over dfs's (the sharing optimum), and the makespans; with
`--cpu`, the same ratios measured on the real CPU engine by `python -m bench.studies.blend_cpu`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MARK = "## BE orderings: blend vs fcfs and dfs"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}×" if a is not None and b else "–"


def summary(results: dict[str, Any], cpu: dict[str, Any] | None) -> str:
    """The markdown section with the target ratios."""
    pol = results["policies"]
    lines = [MARK, ""]
    if all(name in pol for name in ("fcfs", "dfs", "blend")):
        f, d, b = pol["fcfs"], pol["dfs"], pol["blend"]
        lines += [
            "| | fcfs | dfs | blend |",
            "|---|---:|---:|---:|",
            f"| total tok/s (prompt + output, over the makespan) | {f['be_total_tok_s']:.0f} | "
            f"{d['be_total_tok_s']:.0f} | {b['be_total_tok_s']:.0f} |",
            f"| makespan s | {f['be_makespan_s']:.1f} | {d['be_makespan_s']:.1f} | "
            f"{b['be_makespan_s']:.1f} |",
            f"| prefix reuse | {f['prefix_reuse_ratio']:.1%} | {d['prefix_reuse_ratio']:.1%} | "
            f"{b['prefix_reuse_ratio']:.1%} |",
            "",
            "* simulator: blend / fcfs throughput "
            f"**{_ratio(b['be_total_tok_s'], f['be_total_tok_s'])}** (dfs / fcfs "
            f"{_ratio(d['be_total_tok_s'], f['be_total_tok_s'])}); blend's prefix "
            f"reuse is **{b['prefix_reuse_ratio'] / d['prefix_reuse_ratio']:.1%}** of dfs's.",
        ]
    if cpu is not None:
        mean = cpu["mean"]

        def runs(name: str) -> str:
            return ", ".join(f"{v:.0f}" for v in mean[name]["total_tok_s_runs"])

        lines += [
            f"* CPU engine (`python -m bench.studies.blend_cpu --requests {cpu['requests']} "
            f"--repeats {cpu['repeats']}`: stock SGLang, the tiny model, {cpu['requests']} lines, "
            f"{cpu['max_inflight']} in flight, {cpu['kv_tokens']} KV tokens; orderings "
            f"alternate):",
            f"  * prompt tokens the engine had to compute (after its prefix cache), mean per run: "
            f"fcfs {mean['fcfs']['computed_prompt_tokens']:.0f}, dfs "
            f"{mean['dfs']['computed_prompt_tokens']:.0f}, blend "
            f"{mean['blend']['computed_prompt_tokens']:.0f} → blend / fcfs "
            f"**{cpu['blend_vs_fcfs_computed_prompt_tokens']:.3f}×**; prefix reuse fcfs "
            f"{mean['fcfs']['prefix_reuse_ratio']:.1%}, dfs {mean['dfs']['prefix_reuse_ratio']:.1%}"
            f", blend {mean['blend']['prefix_reuse_ratio']:.1%} (blend / dfs "
            f"{cpu['blend_reuse_vs_dfs']:.1%}).",
            f"  * total tok/s per run (wall clock): fcfs {runs('fcfs')}; dfs {runs('dfs')}; blend "
            f"{runs('blend')} → median blend / fcfs "
            f"**{cpu['blend_vs_fcfs_throughput_median']:.2f}×** (means "
            f"{cpu['blend_vs_fcfs_throughput']:.2f}×). Much of the spread is the machine: "
            f"other jobs shared its 2 cores, and SGLang's scheduler busy-polls, so even "
            f"the engine's CPU seconds follow wall time.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.blend_report", description=__doc__
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument(
        "--cpu", type=Path, help="results JSON of python -m bench.studies.blend_cpu"
    )
    parser.add_argument("--notes", type=Path, help="a markdown file appended after the ratios")
    args = parser.parse_args(argv)
    results = json.loads((args.dir / "results.json").read_text())
    cpu = json.loads(args.cpu.read_text()) if args.cpu else None
    report = (args.dir / "report.md").read_text()
    command = next(
        line.split("`")[1] for line in report.splitlines() if line.startswith("Command: `")
    )
    body = report.split(MARK)[0].rstrip() + "\n"
    if not body.startswith(command):
        body = f"{command}\n\n{body}"
    notes = args.notes.read_text() if args.notes else ""
    (args.dir / "report.md").write_text(
        body + "\n" + summary(results, cpu) + ("\n" + notes if notes else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
