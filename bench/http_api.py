"""HTTP benchmark: the multi-adapter workload through `loraplane serve` against the in-process engine.

Workload (same in both, one run): N requests over A adapters (adapter i % A), prompts of random
real-vocab tokens (20..100), outputs 16..64 tokens, greedy, ignore_eos, every request submitted at
once. Adapters: one random PEFT LoRA (r=8, every projection) and A-1 variants with fresh random tensors
of the same shapes and scale; all prewarmed to the device slots (max_loras = A) before timing.

- in-process: LLMEngine, add_request for all, step until done.
- HTTP: the server as a subprocess with the same engine settings; one asyncio client per request,
  streaming /v1/completions with token-id prompts (logprobs=0, so every token is its own chunk).
Reported for each: useful tokens/s, p50/p99 time to first token and inter-token latency; and the
throughput ratio HTTP / in-process (target >= 0.85).

Run: .venv/bin/python bench/http.py [--quick] [--out bench/out/http.json] [--threads 1]
--threads defaults to 1 intra-op thread for both sides: on a shared 2-core machine two OpenMP threads
spin-wait for each other whenever another job holds a core. Prints one JSON object, writes it to --out
and draws a plot next to it (.png) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from common import free_port, machine, percentile, pyplot, wait_ready  # bench/ is on sys.path when run as a script
from safetensors.torch import load_file, save_file

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.store.builtin import resolve_model

TARGET_RATIO = 0.85  # HTTP / in-process, useful tokens per second
TOKEN = "bench-admin-token"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    num_requests: int = 128
    num_adapters: int = 32
    prompt_lens: tuple[int, int] = (20, 100)
    output_lens: tuple[int, int] = (16, 64)
    seed: int = 0


QUICK = Workload(16, 4, (20, 40), (8, 16))


@dataclass
class Request:
    adapter: str
    prompt: list[int]
    max_new: int


@dataclass
class Timing:
    """One request: seconds from the start to its first token, and between its tokens."""

    ttft: float
    gaps: list[float]
    num_tokens: int


# adapters
def make_adapters(model_dir: Path, root: Path, n: int) -> list[str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    template = root / "template"
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(template))
    tensors = load_file(str(template / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    names = [f"bench{i:03d}" for i in range(n)]
    for name in names:
        out = root / "adapters" / name
        out.mkdir(parents=True)
        shutil.copy(template / "adapter_config.json", out / "adapter_config.json")
        fresh = {k: torch.randn(t.shape, generator=gen) * t.float().std() for k, t in tensors.items()}
        save_file(fresh, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return names


def make_requests(engine: LLMEngine, adapters: list[str], w: Workload) -> list[Request]:
    special = set(engine.tokenizer.all_special_ids)
    pool = [i for i in range(min(len(engine.tokenizer), engine.runner.model.args.vocab_size)) if i not in special]
    rng = random.Random(w.seed)
    return [
        Request(
            adapters[i % len(adapters)], rng.choices(pool, k=rng.randint(*w.prompt_lens)), rng.randint(*w.output_lens)
        )
        for i in range(w.num_requests)
    ]


def engine_config(args: argparse.Namespace, w: Workload, adapter_dir: Path) -> EngineConfig:
    total = w.num_requests * (w.prompt_lens[1] + w.output_lens[1])
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_kv_blocks=total // 16 + 64,
        max_num_seqs=w.num_requests,
        max_num_batched_tokens=2048,
        max_loras=w.num_adapters,
        max_lora_rank=8,
        adapter_dir=str(adapter_dir),
    )


# in-process
def warm_engine(engine: LLMEngine, adapters: list[str]) -> None:
    for a in adapters:
        engine.adapters.prewarm(a, "device")
    engine.generate([[1, 2, 3]] * 2, SamplingParams(max_new_tokens=2))
    deadline = time.monotonic() + 600
    while not all(engine.slots.lookup(a) is not None for a in adapters):
        engine.poll_adapters()
        time.sleep(0.05)
        if time.monotonic() > deadline:
            raise TimeoutError("adapters did not reach the device slots")


def run_in_process(engine: LLMEngine, reqs: list[Request]) -> tuple[float, list[Timing]]:
    start = time.perf_counter()
    rids = {}
    for r in reqs:
        params = SamplingParams(max_new_tokens=r.max_new, ignore_eos=True)
        rids[engine.add_request(r.prompt, params, adapter_id=r.adapter)] = len(rids)
    last: dict[str, float] = {}
    timings: dict[str, Timing] = {}
    while engine.has_unfinished:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            assert out.error is None, out.error
            if not out.delta_token_ids:
                continue
            t = timings.setdefault(out.request_id, Timing(now - start, [], 0))
            if out.request_id in last:
                t.gaps.append(now - last[out.request_id])
            t.num_tokens += 1
            last[out.request_id] = now
    return time.perf_counter() - start, [timings[k] for k in sorted(timings, key=rids.__getitem__)]


# HTTP
def start_server(args: argparse.Namespace, cfg: EngineConfig, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "loraplane_server.serving.cli", "serve", "--port", str(port), "--model", cfg.model,
           "--dtype", cfg.dtype, "--num-kv-blocks", str(cfg.num_kv_blocks), "--max-num-seqs", str(cfg.max_num_seqs),
           "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--max-loras", str(cfg.max_loras),
           "--max-lora-rank", str(cfg.max_lora_rank), "--adapter-dir", str(cfg.adapter_dir),
           "--max-queue", "100000", "--admin-token", TOKEN, "--torch-threads", str(args.threads),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log, timeout=600)
    return proc, url


def warm_server(url: str, adapters: list[str]) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for a in adapters:
        r = httpx.post(f"{url}/v1/adapters", json={"id": a, "tier": "device", "wait": True}, headers=auth, timeout=600)
        r.raise_for_status()
    body = {"model": adapters[0], "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


async def stream_one(client: httpx.AsyncClient, r: Request, start: float) -> Timing:
    body = {"model": r.adapter, "prompt": r.prompt, "max_tokens": r.max_new, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    timing, last = None, 0.0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            n = len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
            if timing is None:
                timing = Timing(now - start, [], 0)
            else:
                timing.gaps.append(now - last)
            timing.num_tokens += n
            last = now
    assert timing is not None and timing.num_tokens == r.max_new, (timing, r.max_new)
    return timing


async def run_http(url: str, reqs: list[Request]) -> tuple[float, list[Timing]]:
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(stream_one(client, r, start) for r in reqs))
        return time.perf_counter() - start, list(timings)


# report
def summary(elapsed: float, timings: list[Timing]) -> dict:
    tokens = sum(t.num_tokens for t in timings)
    ttft = [t.ttft for t in timings]
    gaps = [g for t in timings for g in t.gaps]
    ms = lambda x: round(x * 1000, 1)  # noqa: E731
    return {"elapsed_s": round(elapsed, 2), "generated_tokens": tokens, "tokens_per_s": round(tokens / elapsed, 1),
            "ttft_ms": {"p50": ms(percentile(ttft, 0.5)), "p99": ms(percentile(ttft, 0.99))},
            "itl_ms": {"p50": ms(percentile(gaps, 0.5)), "p99": ms(percentile(gaps, 0.99))}}  # fmt: skip


def plot(result: dict, out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    sides = ["in_process", "http"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(sides, [result[s]["tokens_per_s"] for s in sides])
    axes[0].set_title(f"useful tokens/s (ratio {result['throughput_ratio']})")
    for ax, key in zip(axes[1:], ["ttft_ms", "itl_ms"], strict=True):
        for i, q in enumerate(["p50", "p99"]):
            ax.bar([x + i * 0.4 for x in range(2)], [result[s][key][q] for s in sides], width=0.4, label=q)
        ax.set_xticks([0.2, 1.2], sides)
        ax.set_title(key)
        ax.legend()
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=100)
    return png


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides (0: default)")
    p.add_argument("--quick", action="store_true", help=f"a small workload: {QUICK}")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "http.json"))
    args = p.parse_args()
    w = QUICK if args.quick else Workload()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="loraplane-bench-http-"))
    try:
        adapters = make_adapters(model_dir, tmp, w.num_adapters)
        cfg = engine_config(args, w, tmp / "adapters")
        engine = LLMEngine(cfg)
        reqs = make_requests(engine, adapters, w)
        warm_engine(engine, adapters)
        local = summary(*run_in_process(engine, reqs))
        engine.adapters.shutdown()
        del engine
        proc, url = start_server(args, cfg, tmp / "server.log")
        try:
            warm_server(url, adapters)
            remote = summary(*asyncio.run(run_http(url, reqs)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = round(remote["tokens_per_s"] / local["tokens_per_s"], 3)
    result = {
        "workload": asdict(w), "dtype": args.dtype, "threads": args.threads,
        "machine": machine(platform=platform.platform()),
        "in_process": local, "http": remote, "throughput_ratio": ratio, "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, out)
    if png is not None:
        result["plot"] = str(png)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
