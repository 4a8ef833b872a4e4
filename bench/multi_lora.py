"""Multi-LoRA benchmark: our LLMEngine against PEFT on SmolLM2, same machine, same dtype, one run.

Adapters: PEFT makes one random rank-8 LoRA on q_proj/v_proj (init_lora_weights=False); every
benchmark adapter is a copy of its config with fresh random tensors of the same keys, shapes and
scale, written with safetensors into a temporary directory.

Measures:
a. latency of one request (70 prompt tokens -> 10 new, greedy, ignore_eos) with 1, 100 and 1,000
   adapters registered. Ours: every adapter prewarmed to host memory, max_loras of them (the hot
   ones) to device slots; requests go to hot adapters. PEFT: a PeftModel holding the same number
   of adapters (load_adapter), set_adapter + generate; capped at --peft-max-adapters because
   loading is slow. One engine / PeftModel per count, measured round robin so that load on a
   shared machine hits all of them alike; medians. A fresh prompt per repeat (no prefix-cache hits).
b. throughput: 256 requests over 64 adapters (adapter i % 64), prompts 20..200 tokens, outputs
   16..128 tokens, greedy, ignore_eos. Ours: all submitted at once (max_num_seqs=64, max_loras=64,
   adapters hot). PEFT: mixed-adapter static batches of 64 (generate(adapter_names=...)), left
   padded, run to the batch's longest output. Useful tokens = each request's own output length.
c. the same workload through our engine with adapters and with adapter_id=None for all (base),
   alternated --repeats times with fresh prompt contents (same lengths) each run; medians.

Run: .venv/bin/python bench/multi_lora.py [--quick] [--out bench/out/multi_lora.json] [--threads N]
--threads defaults to 0: torch's default, one intra-op thread per core, so both systems get the
whole machine. Run it on an otherwise idle machine: OpenMP threads spin-wait for each other, and
when another job holds a core one request takes 10-100x longer (measured on a loaded 2-core
machine: 39 s against 0.36 s), for PEFT and for us alike; --threads 1 is the way out there.
Prints one JSON object, writes it to --out and draws the plot next to it (.png). When a target is
missed, torch.profiler tables of a few engine steps (workload b; one latency request) go into the JSON.
PEFT's first static batch also runs with every row on the base model, to show its ceiling here.
`compute_floor` bounds (b) from above: the linear layers' FLOPs for the whole workload at this
machine's measured peak matmul rate (all else free), against PEFT's time; no engine can beat PEFT
by more than that ratio here.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import greedy, hf_static_batch, machine, pyplot, token_pool, write_result  # bench/ is on sys.path
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine

TARGET_SCALING = 1.10  # ours at the most adapters / ours at 1 adapter, latency
TARGET_LATENCY_VS_PEFT = 0.5  # ours / PEFT, latency, at every count PEFT was measured
TARGET_THROUGHPUT_VS_PEFT = 10.0  # ours / PEFT, useful tokens per second
TARGET_LORA_VS_BASE = 0.8  # ours with 64 adapters / ours base model, useful tokens per second
PeftLM = Any  # a peft.PeftModel; its generate() has no usable static type
LatencyFn = Callable[[list[int], str], float]  # (prompt, adapter id) -> seconds


@dataclass(frozen=True)
class Workload:
    adapter_counts: tuple[int, ...] = (1, 100, 1000)
    peft_max_adapters: int = 100
    latency_prompt_len: int = 70
    latency_new_tokens: int = 10
    latency_repeats: int = 15
    num_requests: int = 256
    num_adapters: int = 64
    prompt_lens: tuple[int, int] = (20, 200)
    output_lens: tuple[int, int] = (16, 128)
    batch: int = 64  # our max_num_seqs and PEFT's static batch size
    max_loras: int = 64
    max_lora_rank: int = 8
    repeats: int = 1
    seed: int = 0


QUICK = Workload((1, 10, 100), 10, 70, 10, 5, 32, 16, (20, 100), (8, 32), 64, 16, 8, 1)


# adapters
def adapter_id(i: int) -> str:
    return f"a{i:04d}"


def make_template(model_dir: Path, out: Path) -> Path:
    """One random PEFT adapter (r=8, alpha=16, q_proj/v_proj), saved as safetensors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(out))
    return out


def write_variants(template: Path, root: Path, n: int, seed: int) -> list[Path]:
    """n adapters: the template's config and keys, new random tensors with each tensor's std."""
    ref = load_file(str(template / "adapter_model.safetensors"))
    stds = {k: t.float().std().item() for k, t in ref.items()}
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(n):
        path = root / adapter_id(i)
        path.mkdir(parents=True, exist_ok=True)
        shutil.copy(template / "adapter_config.json", path / "adapter_config.json")
        tensors = {k: torch.randn(t.shape, generator=gen) * stds[k] for k, t in ref.items()}
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        paths.append(path)
    return paths


# our engine
def engine_config(w: Workload, tmp: Path, name: str, kv_cache_bytes: int) -> EngineConfig:
    return EngineConfig(
        model="smollm2-135m",
        dtype="auto",
        max_num_seqs=w.batch,
        max_loras=w.max_loras,
        max_lora_rank=w.max_lora_rank,
        kv_cache_bytes=kv_cache_bytes,
        host_cache_bytes=4 << 30,
        disk_cache_dir=str(tmp / f"dc-{name}"),
        adapter_dir=None,
    )


def device_ids(engine: LLMEngine) -> set[str]:
    return {row["id"] for row in engine.adapters.residency() if row["tier"] == "device"}


def warm_adapters(engine: LLMEngine, paths: list[Path], hot: list[str], timeout: float = 900.0) -> float:
    """Register every adapter, prewarm all to host and `hot` to device; seconds until done."""
    start = time.perf_counter()
    for i, path in enumerate(paths):
        engine.adapters.register(adapter_id(i), str(path))
        engine.adapters.prewarm(adapter_id(i), "device" if adapter_id(i) in hot else "host")
    ids = [adapter_id(i) for i in range(len(paths))]
    while not (all(map(engine.adapters.manager.is_ready, ids)) and set(hot) <= device_ids(engine)):
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"adapters not warm after {timeout:.0f} s")
        engine.adapters.manager.wait_for_completion(0.05)
        engine.poll_adapters()
    return time.perf_counter() - start


def residency_counts(engine: LLMEngine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in engine.adapters.residency():
        counts[row["tier"]] = counts.get(row["tier"], 0) + 1
    return counts


def ours_latency(engine: LLMEngine, new_tokens: int) -> LatencyFn:
    def once(prompt: list[int], adapter: str) -> float:
        start = time.perf_counter()
        rid = engine.add_request(prompt, greedy(new_tokens), adapter_id=adapter)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    assert out.error is None and len(out.token_ids) == new_tokens, out.error
                    return time.perf_counter() - start

    return once


# PEFT
def load_peft(model_dir: Path, dtype: torch.dtype, paths: list[Path]) -> tuple[PeftLM, float]:
    """Base model in `dtype` with every adapter loaded (kept in `dtype`); seconds spent loading."""
    from peft import PeftModel

    start = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model = PeftModel.from_pretrained(base, str(paths[0]), adapter_name=adapter_id(0), autocast_adapter_dtype=False)
    for i, path in enumerate(paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=adapter_id(i), autocast_adapter_dtype=False)
    lora_dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert lora_dtypes == {dtype}, f"PEFT adapter weights are {lora_dtypes}, expected {dtype}"
    return model.eval(), time.perf_counter() - start


def peft_latency(model: PeftLM, new_tokens: int, pad_id: int) -> LatencyFn:
    def once(prompt: list[int], adapter: str) -> float:
        start = time.perf_counter()
        model.set_adapter(adapter)
        ids = torch.tensor([prompt])  # [1, S]
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        assert out.shape[1] - ids.shape[1] == new_tokens
        return time.perf_counter() - start

    return once


def pad_token(engine: LLMEngine) -> int:
    tok = engine.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


# a. latency
def hot_adapters(n: int, w: Workload) -> list[str]:
    """The adapters a server keeps on the device: max_loras of the n, chosen at random."""
    rng = random.Random(f"hot-{w.seed}-{n}")
    return sorted(adapter_id(i) for i in rng.sample(range(n), min(n, w.max_loras)))


def round_robin(systems: dict[str, tuple[LatencyFn, list[str]]], prompts: list[list[int]]) -> dict[str, list[float]]:
    """A warm-up on prompts[0], then repeat i: every system serves prompts[i + 1] with its i-th hot adapter."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for fn, hot in systems.values():
        fn(prompts[0], hot[-1])
    for i, prompt in enumerate(prompts[1:]):
        for name, (fn, hot) in systems.items():
            times[name].append(fn(prompt, hot[i % len(hot)]))
    return times


def build_latency_systems(
    w: Workload, tmp: Path, paths: list[Path]
) -> tuple[dict[str, tuple[LatencyFn, list[str]]], dict[str, dict], LLMEngine]:
    """One engine per adapter count, one PeftModel per count up to the cap; setup info per system."""
    systems: dict[str, tuple[LatencyFn, list[str]]] = {}
    setup: dict[str, dict] = {}
    engine = None
    for n in w.adapter_counts:
        engine = LLMEngine(engine_config(w, tmp, f"lat{n}", kv_cache_bytes=64 << 20))
        hot = hot_adapters(n, w)
        seconds = warm_adapters(engine, paths[:n], hot)
        systems[f"ours-{n}"] = (ours_latency(engine, w.latency_new_tokens), hot)
        setup[f"ours-{n}"] = {"warm_seconds": round(seconds, 2), "residency": residency_counts(engine)}
    assert engine is not None
    for n in [n for n in w.adapter_counts if n <= w.peft_max_adapters]:
        model, seconds = load_peft(engine.model_dir, engine.dtype, paths[:n])
        systems[f"peft-{n}"] = (peft_latency(model, w.latency_new_tokens, pad_token(engine)), hot_adapters(n, w))
        setup[f"peft-{n}"] = {"load_seconds": round(seconds, 2), "seconds_per_adapter": round(seconds / n, 4)}
    return systems, setup, engine


def measure_latency(w: Workload, tmp: Path, paths: list[Path]) -> dict:
    systems, setup, engine = build_latency_systems(w, tmp, paths)
    rng = random.Random(f"latency-{w.seed}")
    pool = token_pool(engine)
    prompts = [rng.choices(pool, k=w.latency_prompt_len) for _ in range(w.latency_repeats + 1)]
    times = round_robin(systems, prompts)
    rows = []
    for n in w.adapter_counts:
        ours = statistics.median(times[f"ours-{n}"])
        peft = statistics.median(times[f"peft-{n}"]) if f"peft-{n}" in times else None
        rows.append(latency_row(n, ours, peft, times, setup))
    base = rows[0]["ours_ms"]
    for row in rows:
        row["ours_over_ours_at_1"] = round(row["ours_ms"] / base, 4)
    return {"rows": rows, "peft_max_adapters": w.peft_max_adapters, "repeats": w.latency_repeats}


def latency_row(n: int, ours: float, peft: float | None, times: dict[str, list[float]], setup: dict) -> dict:
    return {
        "num_adapters": n,
        "ours_ms": round(1000 * ours, 2),
        "peft_ms": None if peft is None else round(1000 * peft, 2),
        "ours_over_peft": None if peft is None else round(ours / peft, 4),
        "peft_measured": peft is not None,
        "ours_all_ms": [round(1000 * t, 1) for t in times[f"ours-{n}"]],
        "peft_all_ms": [round(1000 * t, 1) for t in times.get(f"peft-{n}", [])],
        "ours_setup": setup[f"ours-{n}"],
        "peft_setup": setup.get(f"peft-{n}"),
    }


# b, c. throughput
@dataclass
class Requests:
    prompts: list[list[int]]
    outputs: list[int]
    adapters: list[str | None]


def make_requests(pool: list[int], w: Workload, contents: str, with_adapters: bool = True) -> Requests:
    """Lengths and adapters depend on the seed only; token contents on `contents` as well."""
    rng = random.Random(w.seed)
    lens = [rng.randint(*w.prompt_lens) for _ in range(w.num_requests)]
    outputs = [rng.randint(*w.output_lens) for _ in range(w.num_requests)]
    crng = random.Random(f"{w.seed}-{contents}")
    prompts = [crng.choices(pool, k=n) for n in lens]
    adapters = [adapter_id(i % w.num_adapters) if with_adapters else None for i in range(w.num_requests)]
    return Requests(prompts, outputs, adapters)


def rates(elapsed: float, generated: int, num_prompt_tokens: int) -> dict:
    return {
        "seconds": round(elapsed, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / elapsed, 2),
        "total_tokens_per_s": round((generated + num_prompt_tokens) / elapsed, 2),
    }


def run_ours(engine: LLMEngine, reqs: Requests) -> dict:
    """Submit every request at once, step until done; useful tokens/s over the whole wall time."""
    start = time.perf_counter()
    for prompt, n, adapter in zip(reqs.prompts, reqs.outputs, reqs.adapters, strict=True):
        engine.add_request(prompt, greedy(n), adapter_id=adapter)
    generated, steps = 0, 0
    while engine.has_unfinished:
        outs = engine.step()
        assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
        generated += sum(len(o.delta_token_ids) for o in outs)
        steps += 1
    elapsed = time.perf_counter() - start
    assert generated == sum(reqs.outputs), f"generated {generated}, expected {sum(reqs.outputs)}"
    return {**rates(elapsed, generated, sum(map(len, reqs.prompts))), "steps": steps}


def run_peft(model: PeftLM, reqs: Requests, batch: int, pad_id: int) -> dict:
    """Static batches of `batch` requests; useful tokens are each request's own output length."""
    computed, seconds = 0, []
    for i in range(0, len(reqs.prompts), batch):
        lens = reqs.outputs[i : i + batch]
        names = [a or "__base__" for a in reqs.adapters[i : i + batch]]
        start = time.perf_counter()
        num_new = hf_static_batch(model, reqs.prompts[i : i + batch], max(lens), pad_id, adapter_names=names)
        seconds.append(time.perf_counter() - start)
        assert num_new == max(lens), f"PEFT generated {num_new} tokens, expected {max(lens)}"
        computed += num_new * len(lens)
    result = rates(sum(seconds), sum(reqs.outputs), sum(map(len, reqs.prompts)))
    result["computed_tokens"] = computed  # including padding past each request's own length
    result["batch_seconds"] = [round(x, 2) for x in seconds]
    return result


def throughput_engine(w: Workload, tmp: Path, paths: list[Path]) -> LLMEngine:
    """max_num_seqs = max_loras = batch; the workload's adapters hot on the device; warmed up."""
    engine = LLMEngine(engine_config(replace(w, max_loras=max(w.max_loras, w.num_adapters)), tmp, "tp", 1 << 30))
    warm_adapters(engine, paths[: w.num_adapters], [adapter_id(i) for i in range(w.num_adapters)])
    pool = token_pool(engine)
    warm = [pool[:24], pool[100:140]]
    run_ours(engine, Requests(warm, [4, 4], [adapter_id(0), None]))
    return engine


def measure_ours_throughput(engine: LLMEngine, w: Workload) -> dict:
    """Adapters and base alternated `repeats` times, fresh prompt contents each run; medians."""
    pool = token_pool(engine)
    runs: dict[str, list[dict]] = {"lora": [], "base": []}
    for r in range(w.repeats):
        for kind in ("lora", "base") if r % 2 == 0 else ("base", "lora"):
            runs[kind].append(run_ours(engine, make_requests(pool, w, f"{kind}-{r}", kind == "lora")))
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    return {"runs": runs, "lora_tokens_per_s": med["lora"], "base_tokens_per_s": med["base"]}


def measure_peft_throughput(engine: LLMEngine, w: Workload, paths: list[Path]) -> dict:
    """PEFT on workload (b); then its first batch again with every row on "__base__" (no LoRA math)."""
    model, seconds = load_peft(engine.model_dir, engine.dtype, paths[: w.num_adapters])
    pad_id = pad_token(engine)
    reqs = make_requests(token_pool(engine), w, "lora-0")
    hf_static_batch(model, reqs.prompts[:2], 4, pad_id, adapter_names=[adapter_id(0), adapter_id(1)])  # warm-up
    result = run_peft(model, reqs, w.batch, pad_id)
    result["load_seconds"] = round(seconds, 2)
    first = Requests(reqs.prompts[: w.batch], reqs.outputs[: w.batch], [None] * min(w.batch, len(reqs.prompts)))
    base = run_peft(model, first, w.batch, pad_id)
    result["first_batch_seconds"] = {"lora": result["batch_seconds"][0], "base_model": base["seconds"]}
    result["first_batch_lora_over_base_seconds"] = round(result["batch_seconds"][0] / base["seconds"], 3)
    return result


def peak_gemm_gflops(dtype: torch.dtype) -> float:
    """This machine's bf16 (engine dtype) matmul rate at the bench's thread count: the best of a few
    prefill-sized products (2048 x 576 by 576 x 3072, SmolLM2's gate|up)."""
    x, weight = torch.randn(2048, 576).to(dtype), torch.randn(3072, 576).to(dtype)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return 2 * x.shape[0] * x.shape[1] * weight.shape[0] / best / 1e9


def compute_floor(engine: LLMEngine, w: Workload, peft_seconds: float) -> dict:
    """A bound on ours/PEFT for workload (b) that no engine on this machine can pass: the FLOPs of the
    linear layers alone (2 x the layers' weights for every prompt token and every fed-back output
    token, 2 x the lm_head for every output token; attention, LoRA, sampling and all else free) at
    the measured peak matmul rate, against PEFT's measured time."""
    from loraplane_server.executor.layers.linear import ProjectionLinear

    model = engine.runner.model
    layers = sum(m.weight.numel() for m in model.modules() if isinstance(m, ProjectionLinear))
    head = model.args.vocab_size * model.args.hidden_size
    reqs = make_requests(token_pool(engine), w, "floor")
    prompt, generated = sum(map(len, reqs.prompts)), sum(reqs.outputs)
    flops = 2 * (layers * (prompt + generated - len(reqs.outputs)) + head * generated)
    gflops = peak_gemm_gflops(engine.dtype)
    seconds = flops / gflops / 1e9
    return {
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "linear_tflops": round(flops / 1e12, 2),
        "peak_gemm_gflops": round(gflops, 1),
        "linear_seconds_at_peak": round(seconds, 2),
        "ours_over_peft_ceiling": round(peft_seconds / seconds, 2),
    }


def measure_throughput(w: Workload, tmp: Path, paths: list[Path]) -> tuple[dict, dict, LLMEngine]:
    engine = throughput_engine(w, tmp, paths)
    with torch.inference_mode():
        ours = measure_ours_throughput(engine, w)
        peft = measure_peft_throughput(engine, w, paths)
        floor = compute_floor(engine, w, peft["seconds"])
    vs_peft = {
        "ours_tokens_per_s": ours["lora_tokens_per_s"],
        "peft_tokens_per_s": peft["tokens_per_s"],
        "ours_over_peft": round(ours["lora_tokens_per_s"] / peft["tokens_per_s"], 3),
        "ours_runs": ours["runs"]["lora"],
        "peft": peft,
        "compute_floor": floor,
    }
    vs_base = {
        "lora_tokens_per_s": ours["lora_tokens_per_s"],
        "base_tokens_per_s": ours["base_tokens_per_s"],
        "lora_over_base": round(ours["lora_tokens_per_s"] / ours["base_tokens_per_s"], 4),
        "runs": ours["runs"],
    }
    return vs_peft, vs_base, engine


# profile
def profile_table(engine: LLMEngine, reqs: Requests, skip_steps: int, num_steps: int) -> list[str]:
    """torch.profiler ops by self CPU time over num_steps engine steps, after skip_steps; then abort all."""
    from torch.profiler import ProfilerActivity, profile

    for prompt, n, adapter in zip(reqs.prompts, reqs.outputs, reqs.adapters, strict=True):
        engine.add_request(prompt, greedy(n), adapter_id=adapter)
    for _ in range(skip_steps):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        ms = 1000 * (time.perf_counter() - start) / num_steps
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=44)
    return [f"{num_steps} steps, {ms:.1f} ms per step wall", *table.splitlines()]


def profiles(engine: LLMEngine, w: Workload) -> dict[str, list[str]]:
    """Workload (b) once every sequence decodes (64 adapters), and one latency request from the start."""
    pool = token_pool(engine)
    rng = random.Random(f"profile-{w.seed}")
    single = Requests([rng.choices(pool, k=w.latency_prompt_len)], [w.latency_new_tokens], [adapter_id(0)])
    return {
        "throughput_decode_steps": profile_table(engine, make_requests(pool, w, "profile"), 8, 5),
        "latency_request": profile_table(engine, single, 0, w.latency_new_tokens),
    }


# report
def target(value: float | None, bound: float, at_least: bool) -> dict:
    met = value is not None and (value >= bound if at_least else value <= bound)
    return {"target": f"{'>=' if at_least else '<='} {bound}", "value": value, "met": met}


def targets(latency: dict, vs_peft: dict, vs_base: dict) -> dict:
    rows = latency["rows"]
    peft_ratios = [r["ours_over_peft"] for r in rows if r["peft_measured"]]
    return {
        "latency_scaling": target(rows[-1]["ours_over_ours_at_1"], TARGET_SCALING, at_least=False),
        "latency_vs_peft_worst": target(max(peft_ratios, default=None), TARGET_LATENCY_VS_PEFT, at_least=False),
        "throughput_vs_peft": target(vs_peft["ours_over_peft"], TARGET_THROUGHPUT_VS_PEFT, at_least=True),
        "lora_vs_base": target(vs_base["lora_over_base"], TARGET_LORA_VS_BASE, at_least=True),
    }


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rows = result["latency"]["rows"]
    axes[0].plot([r["num_adapters"] for r in rows], [r["ours_ms"] for r in rows], marker="o", label="loraplane")
    peft_rows = [r for r in rows if r["peft_measured"]]
    axes[0].plot([r["num_adapters"] for r in peft_rows], [r["peft_ms"] for r in peft_rows], marker="s", label="PEFT")
    axes[0].set(title="latency, 70 -> 10 tokens (ms)", xlabel="adapters registered", xscale="log", ylim=(0, None))
    axes[0].legend()
    tp = result["throughput_vs_peft"]
    axes[1].bar(["loraplane", "PEFT"], [tp["ours_tokens_per_s"], tp["peft_tokens_per_s"]])
    axes[1].set_title(f"useful tokens/s, mixed adapters ({tp['ours_over_peft']}x)")
    vb = result["lora_vs_base"]
    num = result["config"]["workload"]["num_adapters"]
    axes[2].bar([f"{num} adapters", "base model"], [vb["lora_tokens_per_s"], vb["base_tokens_per_s"]])
    axes[2].set_title(f"loraplane tokens/s ({vb['lora_over_base']}x of base)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def make_adapters(w: Workload, tmp: Path, model_dir: Path) -> tuple[list[Path], float]:
    start = time.perf_counter()
    template = make_template(model_dir, tmp / "template")
    paths = write_variants(template, tmp / "adapters", max(*w.adapter_counts, w.num_adapters), w.seed)
    return paths, time.perf_counter() - start


def run(w: Workload, tmp: Path) -> dict:
    from loraplane_server.store.builtin import resolve_model

    load_start = os.getloadavg()
    paths, make_seconds = make_adapters(w, tmp, resolve_model("smollm2-135m"))
    with torch.inference_mode():
        latency = measure_latency(w, tmp, paths)
    gc.collect()
    vs_peft, vs_base, engine = measure_throughput(w, tmp, paths)
    result = {
        "machine": machine(
            engine.dtype,
            peft=importlib.metadata.version("peft"),
            load_average={"start": load_start, "end": os.getloadavg()},
        ),
        "config": {"workload": asdict(w), "engine": asdict(engine.config), "adapter_make_seconds": round(make_seconds)},
        "latency": latency,
        "throughput_vs_peft": vs_peft,
        "lora_vs_base": vs_base,
        "targets": targets(latency, vs_peft, vs_base),
    }
    if not all(t["met"] for t in result["targets"].values()):
        result["profile"] = profiles(engine, w)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/multi_lora.json"))
    parser.add_argument("--quick", action="store_true", help="a reduced workload for a smoke check (~2 min)")
    parser.add_argument("--peft-max-adapters", type=int, default=None, help="cap on adapters loaded into PEFT")
    parser.add_argument("--repeats", type=int, default=None, help="ours lora/base throughput runs each")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default (all cores)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    w = QUICK if args.quick else Workload()
    w = replace(w, peft_max_adapters=args.peft_max_adapters or w.peft_max_adapters, repeats=args.repeats or w.repeats)
    with tempfile.TemporaryDirectory(prefix="multi-lora-") as tmp:
        result = run(w, Path(tmp))
    write_result(result, args.out, plot)


if __name__ == "__main__":
    main()
