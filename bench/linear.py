"""Linear layers at decode batch sizes and beyond: the compiled CPU kernel against torch's bf16 F.linear.

For each number of rows M (a decode step's batch), runs every projection of SmolLM2-135M's 30
layers (q|k|v, o, gate|up, down; weights laid out one after another, so they stream from DRAM
as in a real step) and the tied 49152-row lm_head, with both implementations, min of several
repeats. The kernel streams W row by row for up to 4 rows and runs a register-tiled GEMM above
that; the engine uses it up to `cpu_kernels.linear_max_rows()` rows (its build's own threshold).

Run: .venv/bin/python bench/linear.py [--threads 1 2] [--out bench/out/linear.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import machine  # bench/ is on sys.path when run as a script

from loraplane_server.kernels import cpu_kernels

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per layer: qkv, o, gate_up, down
LM_HEAD = (576, 49152)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(rows: int, weights: dict[tuple[int, int], list[torch.Tensor]], head: torch.Tensor, repeats: int) -> dict:
    xs = {shape: torch.randn(rows, shape[0]).to(torch.bfloat16) for shape in SHAPES}
    xh = torch.randn(rows, LM_HEAD[0]).to(torch.bfloat16)

    def layers(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: [linear(xs[shape], w) for shape in SHAPES for w in weights[shape]]

    torch_ms = best_ms(layers(F.linear), repeats)
    kernel_ms = best_ms(layers(cpu_kernels.linear), repeats)
    head_torch = best_ms(lambda: F.linear(xh, head), repeats)
    head_kernel = best_ms(lambda: cpu_kernels.linear(xh, head), repeats)
    nbytes = sum(w.numel() * 2 for ws in weights.values() for w in ws) + head.numel() * 2
    total_torch, total_kernel = torch_ms + head_torch, kernel_ms + head_kernel
    return {
        "rows": rows,
        "torch_ms": round(total_torch, 2),
        "kernel_ms": round(total_kernel, 2),
        "speedup": round(total_torch / total_kernel, 2),
        "torch_gb_per_s": round(nbytes / total_torch / 1e6, 1),
        "kernel_gb_per_s": round(nbytes / total_kernel / 1e6, 1),
        "lm_head_torch_ms": round(head_torch, 2),
        "lm_head_kernel_ms": round(head_kernel, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64, 128, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/out/linear.json"))
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit(f"the CPU kernels did not build: {cpu_kernels.load_error()}")
    torch.manual_seed(0)
    weights = {(k, n): [torch.randn(n, k).to(torch.bfloat16) for _ in range(LAYERS)] for k, n in SHAPES}
    head = torch.randn(LM_HEAD[1], LM_HEAD[0]).to(torch.bfloat16)
    threads0 = torch.get_num_threads()
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            results.append({"threads": threads, **measure(rows, weights, head, args.repeats)})
    torch.set_num_threads(threads0)
    out = {
        "machine": machine(),
        "engine_uses_kernel_up_to_rows": cpu_kernels.linear_max_rows(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
