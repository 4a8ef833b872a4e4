"""Decode attention on the CPU: how much of a layer's time is memory, not arithmetic.

A batch-64 decode step of workload (b) in bench/multi_lora.py attends 64 sequences of ~140 tokens
in each of SmolLM2's 30 layers: ~7 MB of keys and values a layer, in 6 KB blocks scattered over a
1 GiB cache. This runs the compiled decode-attention kernel on such a batch three ways, median of
several repeats, microseconds per layer call:
- hot: one layer's blocks 30 times over (they stay in L2/L3): the kernel's arithmetic;
- cold, scattered: 30 layers in turn, each sequence's blocks at random places (as in the engine
  after a while): what a decode step pays;
- cold, contiguous: the same, each sequence's blocks consecutive in the pool.
Each also as GB/s of keys and values read. The gap between hot and cold is the memory system's.

Run: .venv/bin/python bench/attention.py [--threads 1 2] [--out bench/out/attention.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import machine as common_machine  # bench/ is on sys.path when run as a script

from loraplane_server.kernels import cpu_kernels

LAYERS, BLOCK, KV_HEADS, HEADS, HEAD_DIM = 30, 16, 3, 9, 64  # SmolLM2-135M, the engine's block size
NUM_BLOCKS = 2900  # a 1 GiB cache of these blocks (kv_cache_bytes' default)


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_tables(lens: list[int], contiguous: bool, rng: random.Random) -> torch.Tensor:
    """[S, W] block ids: each sequence's at random places, or in one consecutive run each."""
    need = [-(-n // BLOCK) for n in lens]
    width = max(need)
    if contiguous:
        starts = rng.sample(range(0, NUM_BLOCKS - width, width), len(lens))
        rows = [[s + j for j in range(n)] for s, n in zip(starts, need, strict=True)]
    else:
        pool = rng.sample(range(NUM_BLOCKS), sum(need))
        rows = [pool[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def measure(num_seqs: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    caches = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    lens = [rng.randint(20, 200) + rng.randint(16, 128) // 2 for _ in range(num_seqs)]  # prompt + half the output
    q = torch.randn(num_seqs, HEADS, HEAD_DIM).to(torch.bfloat16)
    ctx = torch.tensor(lens)
    kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2  # keys and values, bf16

    def layers(tables: torch.Tensor, hot: bool) -> None:
        for layer in range(LAYERS):
            cache = caches[0 if hot else layer]
            cpu_kernels.paged_decode_attention(q, cache[0], cache[1], tables, ctx, HEAD_DIM**-0.5)

    scattered, contiguous = block_tables(lens, False, rng), block_tables(lens, True, rng)
    row: dict[str, object] = {"num_seqs": num_seqs, "tokens": sum(lens), "kv_mb_per_layer": round(kv_bytes / 1e6, 2)}
    cases = (("hot", scattered, True), ("cold_scattered", scattered, False), ("cold_contiguous", contiguous, False))
    for name, tables, hot in cases:
        seconds = median_s(functools.partial(layers, tables, hot), repeats) / LAYERS
        row[f"{name}_us"] = round(seconds * 1e6, 1)
        row[f"{name}_gb_per_s"] = round(kv_bytes / seconds / 1e9, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/out/attention.json"))
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit(f"the CPU kernels did not build: {cpu_kernels.load_error()}")
    threads0 = torch.get_num_threads()
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        results += [{"threads": threads, **measure(n, args.repeats, seed=n)} for n in args.seqs]
    torch.set_num_threads(threads0)
    machine = common_machine(torch_threads_at_start=threads0)
    out = {"machine": machine, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
