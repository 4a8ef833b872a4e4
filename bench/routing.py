"""Routing benchmark: a pool of 3 local servers fed the same Zipf workload round robin (what a plain Service
does) and through `loraplane router`, one after the other, each on freshly started servers.

Workload: N streaming /v1/completions over A adapters drawn from a Zipf law (s = 1.1), C in flight at once,
greedy, 16 new tokens, prompts of random real words. Servers: the built-in model in fp32, one intra-op thread
each, --max-loras 4 (so a pod that serves every adapter keeps loading into its slots).
Reported per mode: adapter loads into device slots per pod, the device-slot hit rate, p50/p99 time to first
token and tokens/s, and the router's ratios to round robin. The CPU model and flags are recorded.

Run: .venv/bin/python bench/routing.py [--quick] [--out bench/out/routing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import free_port, machine, pyplot, wait_ready  # bench/ is on sys.path when run as a script
from http_api import make_adapters

from loraplane_server.store.builtin import resolve_model

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-admin-token"
WORDS = "the a of river stone light morning city music quiet green open story travel paper window".split()


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": TOKEN}
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO, env=env)


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of the pod's counters that matter here."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(
            ("loraplane_adapter_loads_total", "loraplane_adapter_hits_total", "loraplane_adapter_misses_total")
        ):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def one(client: httpx.AsyncClient, url: str, adapter: str, prompt: str) -> tuple[float, int]:
    body = {"model": adapter, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True}
    start, first, tokens = time.monotonic(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.monotonic()
                tokens += 1
    return (first or time.monotonic()) - start, tokens


async def drive(targets: list[str], jobs: list[tuple[str, str]], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    total = 0

    async def run(i: int, adapter: str, prompt: str) -> None:
        nonlocal total
        async with sem:
            ttft, tokens = await one(client, targets[i % len(targets)], adapter, prompt)
            ttfts.append(ttft)
            total += tokens

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.monotonic()
        await asyncio.gather(*(run(i, a, p) for i, (a, p) in enumerate(jobs)))
        elapsed = time.monotonic() - start
    ttfts.sort()
    return {
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(total / elapsed, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
    }


def run_mode(mode: str, adapters_dir: Path, jobs: list[tuple[str, str]], args: argparse.Namespace, work: Path) -> dict:
    ports = [free_port() for _ in range(3)]
    pods = [f"http://127.0.0.1:{p}" for p in ports]
    flags = ["--dtype", "float32", "--torch-threads", "1", "--log-level", "warning", "--max-loras", "4",
             "--max-model-len", "256", "--num-kv-blocks", "96", "--adapter-dir", str(adapters_dir)]  # fmt: skip
    procs = [
        start(
            [sys.executable, "-m", "loraplane_server.serving.cli", "serve", "--port", str(p), *flags],
            work / f"{mode}-{p}.log",
        )
        for p in ports
    ]
    router = None
    try:
        for url, proc in zip(pods, procs, strict=True):
            wait_ready(url, proc)
        targets = pods
        if mode == "router":
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "loraplane_server.serving.cli",
                "router",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ]
            for i, url in enumerate(pods):
                cmd += ["--pod", f"pod-{i}={url}"]
            router = start(cmd, work / "router.log")
            targets = [f"http://127.0.0.1:{port}"]
            wait_ready(targets[0], router, timeout=60)
        before = [scrape(u) for u in pods]
        result = asyncio.run(drive(targets, jobs, args.concurrency))
        after = [scrape(u) for u in pods]
        per_pod = []
        for b, a in zip(before, after, strict=True):
            diff = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
            hits = diff.get('loraplane_adapter_hits_total{tier="device"}', 0.0)
            misses = sum(v for k, v in diff.items() if k.startswith("loraplane_adapter_misses_total"))
            loads = diff.get('loraplane_adapter_loads_total{tier="device"}', 0.0)
            per_pod.append({"device_loads": int(loads), "device_hits": int(hits), "misses": int(misses)})
        result["per_pod"] = per_pod
        hits = sum(p["device_hits"] for p in per_pod)
        result["device_hit_rate"] = round(hits / max(hits + sum(p["misses"] for p in per_pod), 1), 3)
        result["device_loads"] = sum(p["device_loads"] for p in per_pod)
        return result
    finally:
        for proc in [*procs, *([router] if router else [])]:
            proc.terminate()
        for proc in [*procs, *([router] if router else [])]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    modes = ["round_robin", "router"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(modes, [result[m]["device_loads"] for m in modes], color=["#999", "#2a7"])
    axes[0].set_title("adapter loads into device slots")
    axes[1].bar(modes, [result[m]["ttft_p50_ms"] for m in modes], color=["#999", "#2a7"], label="p50")
    axes[1].set_title("time to first token p50 (ms)")
    axes[2].bar(modes, [result[m]["tokens_per_s"] for m in modes], color=["#999", "#2a7"])
    axes[2].set_title("tokens/s (3 pods)")
    fig.suptitle(
        f"{result['workload']['requests']} requests, {result['workload']['adapters']} adapters (Zipf), "
        f"{result['machine']['cpu']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--adapters", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "routing.json"))
    args = p.parse_args()
    if args.quick:
        args.requests, args.adapters = 60, 12
    work = Path(tempfile.mkdtemp(prefix="loraplane-routing-"))
    names = make_adapters(resolve_model("smollm2-135m"), work, args.adapters)
    rng = random.Random(0)
    weights = [1 / (i + 1) ** 1.1 for i in range(len(names))]
    jobs = [
        (rng.choices(names, weights)[0], " ".join(rng.choices(WORDS, k=rng.randint(8, 24))))
        for _ in range(args.requests)
    ]
    result: dict = {
        "workload": {
            "requests": args.requests,
            "adapters": args.adapters,
            "zipf_s": 1.1,
            "concurrency": args.concurrency,
            "max_tokens": 16,
            "pods": 3,
            "max_loras": 4,
        },  # fmt: skip
        "machine": machine(server_threads=1),
    }
    for mode in ("round_robin", "router"):
        result[mode] = run_mode(mode, work / "adapters", jobs, args, work)
    rr, rt = result["round_robin"], result["router"]
    result["ratios"] = {
        "device_loads_router_over_rr": round(rt["device_loads"] / max(rr["device_loads"], 1), 3),
        "ttft_p50_router_over_rr": round(rt["ttft_p50_ms"] / rr["ttft_p50_ms"], 3),
        "tokens_per_s_router_over_rr": round(rt["tokens_per_s"] / rr["tokens_per_s"], 3),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
