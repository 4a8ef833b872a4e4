"""Issue 24 on a CUDA GPU: the int8 Triton linear's tests compiled for the GPU, then its time against torch's
bf16 F.linear on Llama-3-8B-sized layers.

1. tests/kernels/test_triton_int8.py under pytest, with TRITON_INTERPRET=0 (the kernels compile for the GPU;
   the CUDA run adds float16 and model-sized shapes to the interpreter's);
2. int8_linear vs F.linear(bf16) at M = 1, 16, 256, 2048 rows on (N, K) = (4096, 4096), (14336, 4096),
   (4096, 14336): the median of per-call CUDA-event times, L2 flushed before each call (a decode step
   reads its weights from HBM), and speedup = bf16 time / int8 time (> 1: int8 is faster).

Prints one JSON (GPU name, versions, the test result, the timings); exits 1 without CUDA or when a test fails.

Run: python bench/gpu_check_int8.py [--skip-tests] [--repeats 50] [--out bench/out/gpu_int8.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # timings of the interpreter would mean nothing

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "server"))  # standalone: no install, no PYTHONPATH needed

ROWS = [1, 16, 256, 2048]
LAYERS = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K): q/o, gate (or up), down of Llama-3-8B
TEST_FILE = "tests/kernels/test_triton_int8.py"


def run_tests() -> dict[str, object]:
    """The test file on the GPU, in its own process (pytest-xdist spreads the compiles where installed)."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO / "operator")]),
    }
    parallel = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel, TEST_FILE]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return {"passed": done.returncode == 0, "returncode": done.returncode, "summary": summary}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, as the tests do it: weight ~= scale[:, None] * w."""
    scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def median_us(fn: Callable[[], object], flush: torch.Tensor, repeats: int) -> float:
    for _ in range(3):  # the first call compiles
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends, strict=True):
        # the zeroing evicts L2 and keeps the GPU busy, so the host queues the call ahead: no launch gap timed
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def time_layer(num_n: int, num_k: int, flush: torch.Tensor, repeats: int) -> list[dict[str, object]]:
    from loraplane_server.kernels.triton_int8 import int8_linear

    gen = torch.Generator(device="cuda").manual_seed(num_n + num_k)
    weight = (torch.randn(num_n, num_k, device="cuda", generator=gen) / num_k**0.5).to(torch.bfloat16)
    w, scale = quantize(weight)
    w_deq = (scale[:, None] * w.float()).to(torch.bfloat16)  # what int8 computes with, for the error check
    rows = []
    for num_m in ROWS:
        x = torch.randn(num_m, num_k, device="cuda", generator=gen).to(torch.bfloat16)
        want = F.linear(x, w_deq).float()
        rel_err = ((int8_linear(x, w, scale).float() - want).norm() / want.norm()).item()
        bf16_us = median_us(functools.partial(F.linear, x, weight), flush, repeats)
        int8_us = median_us(functools.partial(int8_linear, x, w, scale), flush, repeats)
        row = {"m": num_m, "n": num_n, "k": num_k, "bf16_us": round(bf16_us, 2), "int8_us": round(int8_us, 2)}
        rows.append({**row, "speedup": round(bf16_us / int8_us, 3), "rel_err_vs_bf16": float(f"{rel_err:.3g}")})
        print(rows[-1], file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-tests", action="store_true", help="only the timings")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per shape (the median is kept)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check_int8.py needs a CUDA GPU: torch.cuda.is_available() is False here")
    if importlib.util.find_spec("triton") is None:
        sys.exit("gpu_check_int8.py needs triton, which does not import here")
    import triton

    result: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    tests = None if args.skip_tests else run_tests()
    if tests is not None:
        result["tests"] = tests
    flush = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")  # well past any GPU's L2
    result["timings"] = [row for n, k in LAYERS for row in time_layer(n, k, flush, args.repeats)]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if tests is not None and not tests["passed"]:
        sys.exit("gpu_check_int8.py: the int8 tests failed on the GPU (their output is above)")


if __name__ == "__main__":
    main()
