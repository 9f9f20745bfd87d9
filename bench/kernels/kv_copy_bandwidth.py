"""Bandwidth of the KV checkpoint kernels (backend/kernels/kv_copy.py) against torch, on one GPU.

    python -m bench.kernels.kv_copy_bandwidth                  # Llama-3.1-8B KV shape, bf16
    python -m bench.kernels.kv_copy_bandwidth --tokens 16 256 4096 --json out.json
    python -m bench.kernels.kv_copy_bandwidth --smoke          # CPU: checks the script only

For each number of scattered slots n, the same bytes (n slots × every K and V layer) move
device→host (checkpoint) and host→device (restore) in four ways:

* `torch copy`: one contiguous device buffer of those bytes ↔ pinned host: the copy bandwidth
  of the device, the ceiling;
* `index_select + copy`: per layer `index_select` into a device staging buffer, then one copy
  (restore: one copy, then per layer `index_copy_`): what plain torch does for scattered slots;
* `triton direct`: `gather`/`scatter` straight between the layer buffers and pinned host memory
  (zero-copy over PCIe, no staging);
* `triton staged`: the kernels into/out of a device staging buffer plus one bulk copy.

Times are CUDA-event medians over `--repeats` runs after warm-up; GB/s = bytes / time (10⁹).
The issue's target: triton ≥ 80 % of `torch copy`, and faster than `index_select + copy`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from backend.kernels.kv_copy import KvLayers
from backend.kernels.kv_copy_ref import gather_slots_reference

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def _time_ms(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time

        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(samples)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _methods(
    kv: KvLayers, slots: torch.Tensor, pin: bool
) -> dict[str, dict[str, Callable[[], None]]]:
    """The four ways to move n slots, per direction (buffers allocated once, here)."""
    layers = kv.layers
    n = slots.numel()
    nbytes = kv.num_layers * n * kv.row_bytes
    host = kv.empty_packed(n, pin=pin)
    staging = torch.empty(kv.packed_shape(n), dtype=kv.dtype, device=kv.device)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=kv.device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    kv.gather(slots, host)
    if not torch.equal(
        host.view(torch.uint8).cpu(), gather_slots_reference(layers, slots).view(torch.uint8).cpu()
    ):
        raise SystemExit(f"gather of {n} slots differs from the torch reference")

    def torch_d2h() -> None:
        flat_host.copy_(flat_dev, non_blocking=True)

    def torch_h2d() -> None:
        flat_dev.copy_(flat_host, non_blocking=True)

    def direct_d2h() -> None:
        kv.gather(slots, host, check=False)

    def direct_h2d() -> None:
        kv.scatter(slots, host, check=False)

    def index_select_d2h() -> None:
        for i, t in enumerate(layers):
            torch.index_select(t, 0, slots, out=staging[i])
        host.copy_(staging, non_blocking=True)

    def index_copy_h2d() -> None:
        staging.copy_(host, non_blocking=True)
        for i, t in enumerate(layers):
            t.index_copy_(0, slots, staging[i])

    def staged_d2h() -> None:
        kv.gather(slots, staging, check=False)
        host.copy_(staging, non_blocking=True)

    def staged_h2d() -> None:
        staging.copy_(host, non_blocking=True)
        kv.scatter(slots, staging, check=False)

    return {
        "d2h": {
            "torch copy": torch_d2h,
            "index_select + copy": index_select_d2h,
            "triton direct": direct_d2h,
            "triton staged": staged_d2h,
        },
        "h2d": {
            "torch copy": torch_h2d,
            "index_select + copy": index_copy_h2d,
            "triton direct": direct_h2d,
            "triton staged": staged_h2d,
        },
    }


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = DTYPES[args.dtype]
    layers = [
        torch.randn(args.pool_slots, args.kv_heads, args.head_dim, device=device).to(dtype)
        for _ in range(2 * args.layers)
    ]
    kv = KvLayers(layers)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, object]] = []
    for n in args.tokens:
        slots = torch.randperm(args.pool_slots, generator=gen)[:n].to(device)
        nbytes = kv.num_layers * n * kv.row_bytes
        for direction, fns in _methods(kv, slots, pin=device.type == "cuda").items():
            times = {name: _time_ms(fn, args.repeats, device) for name, fn in fns.items()}
            base = times["torch copy"]
            for name, ms in times.items():
                rows.append(
                    {
                        "direction": direction,
                        "tokens": n,
                        "bytes": nbytes,
                        "method": name,
                        "ms": ms,
                        "gb_s": nbytes / ms / 1e6,
                        "of_torch_copy": base / ms,
                    }
                )
    return rows


def _table(rows: list[dict[str, object]]) -> str:
    out = [
        "| direction | tokens | MB | method | ms | GB/s | ÷ torch copy |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['direction']} | {r['tokens']} | {int(r['bytes']) / 1e6:.1f} | "  # type: ignore[call-overload]
            f"{r['method']} | {float(r['ms']):.3f} | {float(r['gb_s']):.1f} | "  # type: ignore[arg-type]
            f"{float(r['of_torch_copy']):.2f} |"
        )  # type: ignore[arg-type]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.kernels.kv_copy_bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=32, help="model layers (K and V each: 2×)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--pool-slots", type=int, default=200_000, help="slots per layer buffer")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[16, 128, 1024, 8192],
        help="scattered slots per copy",
    )
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on CPU (Triton interpreter): checks the script, times nothing meaningful",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.pool_slots, args.repeats = 2, 64, 1
        args.tokens = [4, 16]
    elif not torch.cuda.is_available():
        print("kv_copy_bandwidth: error: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if max(args.tokens) > args.pool_slots:
        print("kv_copy_bandwidth: error: --tokens larger than --pool-slots", file=sys.stderr)
        return 2
    rows = run(args)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    print(
        f"device: {name}; {2 * args.layers} layer buffers × {args.kv_heads} heads × "
        f"{args.head_dim} × {args.dtype}\n"
    )
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
