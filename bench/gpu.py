"""The GPU check of issue 35: one command that fits a short lease on a GPU machine with no network. It builds what
it measures there (gpu_models.py: random-weight models of the SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes
with the real SmolLM2 tokenizer files, random PEFT adapters of ranks 8, 16 and 64) and runs, in this order:

1. tests: the `gpu`-marked pytest tests (the test files that carry the marker), TRITON_INTERPRET=0, in a
   subprocess with a timeout; the summary line and the counts.
2. ceilings: device-to-device copy bandwidth ((bytes read + written) / time) and the bf16 matmul rate (8192^3),
   both CUDA events; the rooflines below use them.
3. parity: the SmolLM2 shape (weights N(0, 0.05): the 0.02 init's greedy output repeats one token), 8 greedy
   requests in one batch (2 base, 2 each of adapters rank 8 on q,k,v,o, rank 16 on q,k,v,o, rank 64 on every
   linear) through LLMEngine (as served: CUDA graphs where it captures them) and through transformers + PEFT
   (generate per request) on the same device. fp32: token for token. bf16: each first divergence must be a near
   tie: on the common prefix, the reference's logit of its own token minus its logit of ours below a tolerance,
   for the bf16 reference or for the fp32 one; the tolerance is the larger of --tie-tolerance (0.05) and bf16's
   own noise measured there: the 90th percentile of how far the bf16 reference misjudges the fp32 reference's
   top-2 gap over every generated position of the batch. The top-2 gaps there recorded too.
4. decode: tokens/s of pure decode steps (32-token prompts, ignore_eos) at batch 1, 8, 64 and 256 on the three
   shapes, bf16: the engine as served (CUDA graphs where it captures them) and, where it does, again with
   enforce_eager; the roofline of a step (the weights it reads plus every sequence's K/V, at the measured copy
   bandwidth) and the fraction of it reached.
5. multi_lora: 1,024 requests over 256 rank-16 adapters (64-token prompts, 64 new tokens, --max-loras 64: a full
   batch of 256 rows holds all 4 requests of 64 adapters) on the 8B shape (the target's) and the 1B one, all
   submitted at once: tokens/s, the same requests on the base model, the ratio; then, on the 1B shape, a
   --peft-subset (32) request subset through transformers +
   PEFT (one left-padded mixed-adapter batch, adapter_names) against ours on the same subset (a subset
   measured, not extrapolated; 0 skips it). --no-multi-lora-8b: the 1B shape alone.
6. latency: 70 prompt tokens -> 10 new with one rank-16 adapter on the device: time to first token and total,
   medians over fresh prompts, 1B and 8B shapes.
7. profile: where a decode step's time goes, SmolLM2 and 8B shapes: batch 1 with graphs (the step's wall time
   against its graph replayed alone, cProfile of the host's Python, torch.profiler's kernels by device time),
   and, where multi_lora wrote its adapters, a full batch of 4 requests per adapter against the same rows on the
   base model (wall time per step, kernels by device time).

The gpu tests run in pytest-xdist workers where the machine has it (each CUDA engine a share of the GPU through
LORAPLANE_TEST_GPU_MEMORY_UTILIZATION), with their slowest durations recorded. Each section (and each shape in
it) records its numbers and seconds, or its error (type, message, the traceback's
last lines) while the others still run; a section that the --budget-s no longer covers is recorded as skipped.
The engines run one at a time (each with --gpu-memory-utilization of the GPU), their describe() line and
memory plan recorded; the GPU, driver and library versions too.

Run on the GPU machine (the tree copied, no install, no network; the tokenizer files in bench/data/tokenizer):
    PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT
One JSON document goes to stdout at the end and to <out>/gpu.json, the plot to <out>/gpu.png; progress to stderr;
<out>/gpu.partial.json after each section (what a run cut off by its lease still returns).
--budget-s (420 by default) bounds the sections, so that the whole run, start-up and compiles included, stays
within 8 minutes on one H100 or H200 (6.5 minutes on an H200, 2026-11-27: docs/gpu/). Before a lease, on a dev machine:
    .venv/bin/python bench/gpu.py --prepare          # the built-in model's tokenizer files -> bench/data/tokenizer
    .venv/bin/python bench/gpu.py --device cpu --quick --out bench/out/gpu   # every section on tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "server"))  # standalone: no install, no PYTHONPATH needed

from gpu_models import (  # noqa: E402
    EVERY_LINEAR,
    REAL_SHAPES,
    AdapterSpec,
    Shape,
    adapter_effect,
    batch_generate,
    divergence,
    gap_errors,
    gaps,
    load_reference,
    prepare_tokenizer,
    quick_shapes,
    reference_greedy,
    sequence_logits,
    write_adapter_family,
    write_adapters,
    write_model,
)

from loraplane_server.config import EngineConfig  # noqa: E402
from loraplane_server.engine.llm_engine import LLMEngine, RequestOutput  # noqa: E402
from loraplane_server.platforms.device import DeviceError, device_info, resolve_device  # noqa: E402
from loraplane_server.sampling_params import SamplingParams  # noqa: E402

TOKENIZER_DIR = REPO / "bench" / "data" / "tokenizer"
SMOL, ONE_B, EIGHT_B = "smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"
PARITY_STD = 0.05
PARITY_ADAPTERS = (AdapterSpec("p-r8", 8), AdapterSpec("p-r16", 16), AdapterSpec("p-r64-all", 64, EVERY_LINEAR))
LATENCY_ADAPTER = AdapterSpec("lat-r16", 16)
GPU_MARK = re.compile(r"\bmark\.(gpu|triton)\b")  # the gpu tests, and the Triton kernels' own (compiled there)
PACKAGES = ("torch", "triton", "transformers", "peft", "safetensors", "tokenizers", "numpy", "matplotlib")
SECTIONS = ("tests", "ceilings", "parity", "decode", "multi_lora", "latency", "profile")


@dataclass(frozen=True)
class Sizes:
    """How much each section does: the real run's, or --quick's (tiny shapes on the CPU)."""

    parity_new: int = 24
    batches: tuple[int, ...] = (1, 8, 64, 256)
    decode_prompt: int = 32
    decode_steps: int = 32
    latency_runs: int = 10
    num_requests: int = 1024
    num_adapters: int = 256
    workload_prompt: int = 64
    workload_new: int = 64
    peft_subset: int = 32  # PEFT took 134 s for 64 requests on the H200 (38 s of it loading 64 adapters)
    max_loras: int = 64  # a full batch (256 rows) holds all 4 requests of 64 adapters
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    seconds_scale: float = 1.0  # the expected seconds of a step, for the budget's checks


QUICK = Sizes(
    parity_new=8,
    batches=(1, 4),
    decode_prompt=16,
    decode_steps=4,
    latency_runs=3,
    num_requests=16,
    num_adapters=8,
    workload_prompt=16,
    workload_new=8,
    peft_subset=8,
    max_loras=4,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    max_model_len=512,
    seconds_scale=0.1,
)


# the budget and guarded sections
class OutOfTime(Exception):
    """A step the budget no longer covers: recorded as skipped."""


class SectionTimeout(Exception):
    """The budget ran out while a section was running (SIGALRM)."""


class Budget:
    def __init__(self, seconds: float, scale: float = 1.0) -> None:
        self.start = time.monotonic()
        self.seconds = seconds
        self.scale = scale

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def need(self, seconds: float, what: str) -> None:
        """OutOfTime unless `seconds` (on a GPU; scaled for --quick) are left."""
        if self.left() < seconds * self.scale:
            raise OutOfTime(
                f"skipped: out of time ({what} needs ~{seconds * self.scale:.0f} s, {self.left():.0f} s left)"
            )


def error_record(exc: BaseException) -> dict:
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip().splitlines()
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": lines[-12:]}


def guarded(fn: Callable[[], dict], on_error: Callable[[], None] | None = None) -> dict:
    """fn's record with status ok, or its error (status error), or skipped when it ran out of time; its seconds."""
    start = time.perf_counter()
    try:
        record = {"status": "ok", **fn()}
    except OutOfTime as exc:
        record = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one section's failure is recorded, the others run
        record = {"status": "error", "error": error_record(exc)}
        if on_error is not None:
            on_error()
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """SectionTimeout in the main thread after `seconds`, again every 10 s until the block ends."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(_signum: int, _frame: FrameType | None) -> None:
        raise SectionTimeout(f"stopped: the budget ran out ({seconds:.0f} s for this section)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0), 10.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def log(budget: Budget, message: str) -> None:
    print(f"[gpu.py {budget.elapsed():6.1f} s] {message}", file=sys.stderr, flush=True)


# engines, one at a time
class Engines:
    """At most one engine alive: each takes its own share of the GPU; dropped before the next starts."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.engine: LLMEngine | None = None
        self.records: list[dict] = []

    def get(self, key: str, config: Callable[[], EngineConfig]) -> LLMEngine:
        if self.key == key and self.engine is not None:
            return self.engine
        self.drop()
        start = time.perf_counter()
        engine = LLMEngine(config())
        plan = engine.memory_plan
        self.records.append(
            {
                "key": key,
                "describe": engine.describe(),
                "memory_plan": plan.to_dict() if plan is not None else None,
                "num_kv_blocks": engine.block_manager.num_blocks,
                "captured_graphs": captured_graphs(engine),
                "start_seconds": round(time.perf_counter() - start, 2),
            }
        )
        self.key, self.engine = key, engine
        return engine

    def drop(self) -> None:
        self.key, self.engine = None, None
        free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Run:
    """One run's settings and what it built; sections read and add to it."""

    args: argparse.Namespace
    device: torch.device
    sizes: Sizes
    shapes: dict[str, Shape]
    work: Path
    budget: Budget
    pool: list[int]
    engines: Engines = field(default_factory=Engines)
    graphs: bool | None = None  # whether the engine captures decode graphs here (known once one has started)
    models: dict[str, dict] = field(default_factory=dict)
    ceilings: dict = field(default_factory=dict)

    def guarded(self, fn: Callable[[], dict]) -> dict:
        return guarded(fn, self.engines.drop)

    def need(self, seconds: float, what: str) -> None:
        self.budget.need(seconds, what)

    def model_dir(self, name: str, dtype: torch.dtype, std: float = 0.02) -> Path:
        """The random checkpoint of shape `name` in `dtype`, written on first use."""
        key = f"{name}-{str(dtype).removeprefix('torch.')}-std{std}"
        if key not in self.models:
            log(self.budget, f"writing {key}")
            tok = Path(self.args.tokenizer_dir) if self.args.tokenizer_ok else None
            self.models[key] = write_model(self.shapes[name], self.work / key, self.device, dtype, tok, std)
        return Path(self.models[key]["dir"])

    def adapter_root(self, name: str) -> Path:
        return self.work / f"adapters-{name}"

    def serving_config(self, name: str, eager: bool) -> EngineConfig:
        s = self.sizes
        gpu = self.device.type == "cuda"
        return EngineConfig(
            model=str(self.model_dir(name, torch.bfloat16)),
            dtype="bfloat16",
            device=self.args.device,
            gpu_memory_utilization=self.args.gpu_memory_utilization if gpu else None,
            kv_cache_bytes=None if gpu else 256 << 20,
            enforce_eager=eager,
            layer_backend=self.args.layer_backend,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            max_loras=s.max_loras,
            max_lora_rank=16,
            adapter_dir=str(self.adapter_root(name)),
            host_cache_bytes=8 << 30,
            disk_cache_dir=str(self.work / "disk-cache"),
        )

    def serving_engine(self, name: str, eager: bool = False) -> LLMEngine:
        """The bf16 engine of shape `name` that decode, latency and multi_lora share: as served (CUDA graphs where
        the engine captures them), or with --enforce-eager."""
        self.adapter_root(name).mkdir(parents=True, exist_ok=True)
        eager = eager or self.args.enforce_eager
        return self.engines.get(f"{'eager' if eager else 'serve'}-{name}", lambda: self.serving_config(name, eager))


# requests through our engine
def prompts(pool: list[int], n: int, length: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(pool, k=length) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run_to_end(engine: LLMEngine, timeout_s: float) -> tuple[dict[str, RequestOutput], int]:
    """Step until nothing is left; every finished output by id, and the steps. Raises on a request's error."""
    done: dict[str, RequestOutput] = {}
    steps, deadline = 0, time.monotonic() + timeout_s
    while engine.has_unfinished:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not finish in {timeout_s:.0f} s")
        outputs = engine.step()
        steps += 1
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.finished:
                done[out.request_id] = out
    return done, steps


def ours_tokens(engine: LLMEngine, reqs: list[tuple[list[int], str | None]], new: int) -> list[list[int]]:
    ids = [engine.add_request(p, greedy(new), adapter_id=a) for p, a in reqs]
    done, _ = run_to_end(engine, 600)
    return [done[i].token_ids for i in ids]


def timed_workload(
    engine: LLMEngine, device: torch.device, batch: list[list[int]], adapters: Sequence[str | None], new: int
) -> dict:
    """Every request at once, stepped to the end: generated tokens/s over the whole wall time, and how many
    device slot loads the run made."""
    loads = engine.adapters.manager.stats.loads
    slot_loads = loads["device"]
    sync(device)
    start = time.perf_counter()
    for prompt, adapter in zip(batch, adapters, strict=True):
        engine.add_request(prompt, greedy(new), adapter_id=adapter)
    done, steps = run_to_end(engine, 900)
    sync(device)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in done.values())
    if generated != new * len(batch):
        raise AssertionError(f"generated {generated} tokens, expected {new * len(batch)}")
    prompt_tokens = sum(map(len, batch))
    return {
        "requests": len(batch),
        "seconds": round(seconds, 3),
        "steps": steps,
        "slot_loads": loads["device"] - slot_loads,
        "generated_tokens": generated,
        "tokens_per_s": round(generated / seconds, 1),
        "total_tokens_per_s": round((generated + prompt_tokens) / seconds, 1),
    }


def wait_adapters(engine: LLMEngine, names: list[str], tier: str, timeout_s: float) -> float:
    """Register and prewarm `names` to `tier`; seconds until all are there. A failed load raises."""
    start = time.perf_counter()
    root = Path(engine.config.adapter_dir or ".")
    for name in names:
        if name not in engine.adapters.manager.records:
            engine.adapters.register(name, str(root / name))
        engine.adapters.prewarm(name, tier)
    while True:
        rows = {r["id"]: r for r in engine.adapters.residency()}
        failed = [f"{n}: {rows[n]['last_error']}" for n in names if rows[n]["state"] == "failed"]
        if failed:
            raise RuntimeError(f"adapter loads failed: {failed[:3]}")
        if all(
            engine.adapters.manager.is_ready(n) and (tier != "device" or rows[n]["tier"] == "device") for n in names
        ):
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{len(names)} adapters not on {tier} after {timeout_s:.0f} s")
        engine.adapters.manager.wait_for_completion(0.05)
        engine.poll_adapters()


# sections
def section_tests(run: Run) -> dict:
    """The gpu- and triton-marked tests in a subprocess, TRITON_INTERPRET=0 on CUDA; the files picked by their
    marker (every other test file imports what the device may lack, and -m would still collect it)."""
    found = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if GPU_MARK.search(p.read_text())]
    files = sorted(found, key=lambda f: (f.startswith("tests/kernels/"), f))  # the engine's first, the kernels' after
    if not files:
        return {"files": [], "summary": "no test file carries the gpu marker", "passed": False}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO / "operator")])}
    env.pop("TRITON_INTERPRET", None)
    if run.device.type == "cuda":
        env["TRITON_INTERPRET"] = "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu or triton", "-p", "no:cacheprovider", "--durations=12"]
    workers = test_workers(run.device)
    if workers > 1:  # Triton's compiles are CPU-bound: spread over the machine's cores, each engine a GPU share
        cmd += ["-n", str(workers)]
        env["LORAPLANE_TEST_GPU_MEMORY_UTILIZATION"] = str(round(0.6 / workers, 3))
    cmd += ["--continue-on-collection-errors", *files]
    timeout = min(run.args.tests_timeout, max(10.0, run.budget.left() - 60))
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {"files": files, "passed": False, "summary": f"timed out after {timeout:.0f} s", "tail": out[-3000:]}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", summary)}
    record = {"files": files, "workers": workers, "returncode": done.returncode, "summary": summary, "counts": counts}
    record["slowest"] = slowest_tests(done.stdout)
    record["passed"] = done.returncode == 0 and counts.get("passed", 0) > 0
    if done.returncode == 0 and not counts.get("passed"):
        record["note"] = "no test ran (each skipped: they need CUDA)"
    if done.returncode != 0:
        record["tail"] = (done.stdout[-3000:] + "\n" + done.stderr[-1500:]).strip()
    return record


def time_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of fn over CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_seconds(device: torch.device, num_bytes: int, repeats: int) -> float:
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return (time_cuda if device.type == "cuda" else time_cpu)(lambda: dst.copy_(src), repeats)


def matmul_seconds(device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    return (time_cuda if device.type == "cuda" else time_cpu)(lambda: a @ b, repeats)


def measure_ceilings(device: torch.device, copy_bytes: int, n: int, repeats: int) -> dict:
    """Copy bandwidth (bytes read + written per second) and the bf16 matmul rate of an n^3 product."""
    copy_s = copy_seconds(device, copy_bytes, repeats)
    matmul_s = matmul_seconds(device, n, repeats)
    return {
        "copy_bytes": copy_bytes,
        "copy_gb_per_s": float(f"{2 * copy_bytes / copy_s / 1e9:.4g}"),
        "matmul_n": n,
        "bf16_matmul_tflops": float(f"{2 * n**3 / matmul_s / 1e12:.4g}"),
    }


def section_ceilings(run: Run) -> dict:
    if run.device.type != "cuda":
        stand_in = measure_ceilings(run.device, 64 << 20, 512, 5)
        run.ceilings = {**stand_in, "source": "cpu stand-in"}
        return {"gpu": "needs CUDA", "cpu_stand_in": stand_in}
    result = measure_ceilings(run.device, 2 << 30, 8192, 20)
    run.ceilings = {**result, "source": "measured on this GPU"}
    free_memory()
    return result


def test_workers(device: torch.device) -> int:
    """pytest-xdist workers for the tests on a GPU machine (1: serial, where xdist is missing or on the CPU)."""
    if device.type != "cuda" or importlib.util.find_spec("xdist") is None:
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def slowest_tests(stdout: str) -> list[str]:
    """pytest's --durations lines ("12.34s call tests/...::test_x"), the slowest first."""
    return [line.strip() for line in stdout.splitlines() if re.match(r"\s*\d+\.\d+s (call|setup|teardown) ", line)][:12]


def section_parity(run: Run) -> dict:
    shape = run.shapes[SMOL]
    model_dir = run.model_dir(SMOL, torch.float32, PARITY_STD)
    root = run.work / "adapters-parity"
    paths = write_adapters(shape, root, list(PARITY_ADAPTERS), run.device, torch.float32)
    names: list[str | None] = [None, None] + [s.name for s in PARITY_ADAPTERS for _ in range(2)]
    rng = random.Random("parity")
    reqs = [(rng.choices(run.pool, k=rng.randint(8, 40)), a) for a in names]
    out: dict = {"shape": SMOL, "init_std": PARITY_STD, "tie_tolerance": run.args.tie_tolerance}
    out["requests"] = [{"prompt_tokens": len(p), "adapter": a} for p, a in reqs]
    out["adapters"] = {s.name: {"rank": s.rank, "targets": list(s.targets)} for s in PARITY_ADAPTERS}
    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype).removeprefix("torch.")
        out[key] = run.guarded(partial(parity_dtype, run, model_dir, paths, reqs, dtype))
    return out


def parity_dtype(
    run: Run, model_dir: Path, paths: dict[str, Path], reqs: list[tuple[list[int], str | None]], dtype: torch.dtype
) -> dict:
    """Ours against the reference in `dtype`. Each first divergence is scored by the reference (its logit of its
    own token minus its logit of ours there: ours_gap) and by the fp32 reference (exact_ours_gap): a bf16
    reference's logits are coarse (one bf16 step is 0.03 between 4 and 8) and can call a tie what is not one
    for the exact model, or the other way round; a near tie is one that either calls so."""
    run.need(40, f"parity {dtype}")
    new, start = run.sizes.parity_new, time.perf_counter()
    ours, describe = parity_ours(run, parity_config(run, model_dir, paths, dtype), reqs, new)
    run.engines.drop()  # its GPU memory back before the reference loads
    log(run.budget, f"parity {dtype}: ours in {time.perf_counter() - start:.1f} s; the reference")
    model = load_reference(model_dir, paths, dtype, run.device)
    refs = [reference_greedy(model, p, a, new) for p, a in reqs]
    splits = [divergence(model, p, a, mine, ref) for (p, a), mine, ref in zip(reqs, ours, refs, strict=True)]
    effect = {name: adapter_effect(model, next(p for p, a in reqs if a == name), name) for name in paths}
    noise: dict = {}
    if dtype != torch.float32:  # the bf16 reference's own error on the exact top-2 gaps: bf16's noise floor
        coarse = [sequence_logits(model, p, a, ref) for (p, a), ref in zip(reqs, refs, strict=True)]
        del model
        model = load_reference(model_dir, paths, torch.float32, run.device)
        errors = sorted(
            e
            for (p, a), ref, rows in zip(reqs, refs, coarse, strict=True)
            for e in gap_errors(rows, sequence_logits(model, p, a, ref))
        )
        noise = {
            "rows": len(errors),
            "p50": round(errors[len(errors) // 2], 4),
            "p90": round(errors[int(0.9 * (len(errors) - 1))], 4),
            "max": round(errors[-1], 4),
        }
    for (prompt, adapter), ref, split in zip(reqs, refs, splits, strict=True):
        if split is not None and "ref_token" in split:
            at = split["at"]
            split.update(gaps(model, prompt + ref[:at], adapter, ref[at], split["ours_token"], "exact_"))
    del model
    free_memory()
    rows = [{"adapter": a, "match": d is None, "divergence": d} for (_, a), d in zip(reqs, splits, strict=True)]
    verdict = parity_verdict(splits, dtype, max(run.args.tie_tolerance, noise.get("p90", 0.0)))
    record = {"engine": describe, "new_tokens": new, **verdict, "adapter_effect_max_abs_logit": effect}
    if noise:
        record["reference_bf16_gap_error"] = noise
    return record | {"per_request": rows}


def parity_ours(
    run: Run, config: EngineConfig, reqs: list[tuple[list[int], str | None]], new: int
) -> tuple[list[list[int]], str]:
    engine = run.engines.get(f"parity-{config.dtype}", lambda: config)
    return ours_tokens(engine, reqs, new), engine.describe()


def parity_verdict(splits: list[dict | None], dtype: torch.dtype, tol: float) -> dict:
    found = [d for d in splits if d is not None]
    inf = float("inf")
    near = sum(1 for d in found if min(d.get("ours_gap", inf), d.get("exact_ours_gap", inf)) < tol)
    exact = dtype == torch.float32
    rule = (
        "token for token"
        if exact
        else (
            f"every first divergence a near tie: ours_gap or exact_ours_gap < {tol:.4g} (the larger of --tie-tolerance "
            "and the 90th percentile of the bf16 reference's own error on the exact top-2 gaps of this batch)"
        )
    )
    return {
        "matches": len(splits) - len(found),
        "mismatches": len(found),
        "near_ties": near,
        "passed": not found if exact else near == len(found),
        "rule": rule,
    }


def parity_config(run: Run, model_dir: Path, paths: dict[str, Path], dtype: torch.dtype) -> EngineConfig:
    gpu = run.device.type == "cuda"
    return EngineConfig(
        model=str(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        device=run.args.device,
        gpu_memory_utilization=0.3 if gpu else None,
        kv_cache_bytes=None if gpu else 128 << 20,
        enforce_eager=run.args.enforce_eager,  # as served: decode graphs where the engine captures them
        max_num_seqs=16,
        max_model_len=1024,
        max_loras=len(paths),
        max_lora_rank=64,
        adapter_dir=str(next(iter(paths.values())).parent),
        disk_cache_dir=str(run.work / "disk-cache"),
    )


def weight_read_bytes(shape: Shape, itemsize: int) -> int:
    """The weights one decode step reads: every parameter once, but of an untied input embedding only the
    batch's rows (counted as none)."""
    untied_embedding = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return (shape.num_params() - untied_embedding) * itemsize


def kv_token_bytes(shape: Shape, itemsize: int) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize


def roofline(batch: int, weight_bytes: int, kv_bytes: float, copy_gb_per_s: float | None) -> dict:
    """A decode step's bytes and the tokens/s the copy bandwidth allows for them."""
    step_bytes = weight_bytes + kv_bytes
    if not copy_gb_per_s:
        return {"step_bytes": int(step_bytes)}
    return {"step_bytes": int(step_bytes), "roofline_tokens_per_s": round(batch * copy_gb_per_s * 1e9 / step_bytes, 1)}


def section_decode(run: Run) -> dict:
    out: dict = {"shapes": {}}
    out["method"] = (
        f"{run.sizes.decode_prompt}-token prompts, base model, ignore_eos; after every request's prefill and "
        f"2 more steps, {run.sizes.decode_steps} steps timed (each checked to be pure decode); the engine as served "
        "(CUDA graphs where it captures them) and, where it does, again with --enforce-eager"
    )
    for name in [n for n in (SMOL, EIGHT_B, ONE_B) if n in run.shapes]:  # the 1B engine stays for multi_lora
        out["shapes"][name] = run.guarded(partial(decode_shape, run, name))
    out["graphs"] = {None: "no engine started", True: "captured", False: "not captured: every step eager"}[run.graphs]
    return out


def captured_graphs(engine: LLMEngine) -> int:
    """How many decode CUDA graphs the engine captured (0: its decode steps run eagerly)."""
    return len(getattr(getattr(engine.runner, "graphs", None), "graphs", None) or {})


def graph_replays(engine: LLMEngine) -> int:
    return int(getattr(getattr(engine.runner, "graphs", None), "num_replays", 0))


def decode_shape(run: Run, name: str) -> dict:
    """The engine as served first (it tells whether graphs are captured here), then --enforce-eager where they
    are; once that is known, the eager engine first, so the served one stays for the next section."""
    run.need(90 if name == EIGHT_B else 30, f"decode {name}")
    shape = run.shapes[name]
    weights, per_token = weight_read_bytes(shape, 2), kv_token_bytes(shape, 2)
    out: dict = {"weight_read_bytes": weights, "kv_bytes_per_token": per_token}
    for eager in [True, False] if run.graphs else [False, True]:
        if eager and run.graphs is False:
            continue  # the served engine was eager already
        record = run.guarded(partial(decode_mode, run, name, eager, weights, per_token))
        out["graphs" if run.graphs and not eager else "eager"] = record
    if not run.graphs:
        out["graphs"] = "not captured: every decode step eager"
    return out


def decode_mode(run: Run, name: str, eager: bool, weights: int, per_token: int) -> dict:
    """Every batch size on the served engine (which tells whether graphs are captured) or the eager one."""
    log(run.budget, f"decode {name}{' --enforce-eager' if eager else ''}")
    engine = run.serving_engine(name, eager)
    if not eager:
        run.graphs = captured_graphs(engine) > 0
    return decode_batches(run, engine, weights, per_token)


def decode_batches(run: Run, engine: LLMEngine, weights: int, per_token: int) -> dict:
    rows = {}
    for batch in run.sizes.batches:
        rows[str(batch)] = guarded(partial(decode_batch, run, engine, batch, weights, per_token))
    return {"engine": engine.describe(), "captured_graphs": captured_graphs(engine), "batches": rows}


def step_until(engine: LLMEngine, ids: list[str], tokens: int, timeout_s: float) -> None:
    """Step until each request has `tokens` output tokens; a failed request or the timeout raises."""
    produced, deadline = dict.fromkeys(ids, 0), time.monotonic() + timeout_s
    while min(produced.values()) < tokens:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids)} requests: not {tokens} tokens each after {timeout_s:.0f} s")
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.delta_token_ids)


def decode_batch(run: Run, engine: LLMEngine, batch: int, weights: int, per_token: int) -> dict:
    run.need(5 + batch / 16, f"decode batch {batch}")
    steps, warm = run.sizes.decode_steps, 2
    ids = [
        engine.add_request(p, greedy(warm + steps + 4))
        for p in prompts(run.pool, batch, run.sizes.decode_prompt, f"d{batch}")
    ]
    step_until(engine, ids, 1 + warm, 120)  # prefill (chunked), then two decode steps
    context = sum(len(engine.requests[i]) for i in ids)
    replays = graph_replays(engine)
    sync(run.device)
    start, generated, pure = time.perf_counter(), 0, True
    for _ in range(steps):
        generated += sum(len(o.delta_token_ids) for o in engine.step())
        pure = pure and engine.last_step_tokens == batch
    sync(run.device)
    seconds = time.perf_counter() - start
    replays = graph_replays(engine) - replays
    for i in ids:
        engine.abort(i)
    run_to_end(engine, 60)
    rate = generated / seconds
    mean_kv = (context + batch * (steps - 1) / 2) * per_token
    line = roofline(batch, weights, mean_kv, run.ceilings.get("copy_gb_per_s"))
    if "roofline_tokens_per_s" in line:
        line["roofline_fraction"] = round(rate / line["roofline_tokens_per_s"], 3)
    ms = 1000 * seconds / steps
    line["graph_replays"] = replays
    return {"tokens_per_s": round(rate, 1), "ms_per_step": round(ms, 3), "steps": steps, "pure_decode": pure, **line}


def held_first(run: Run, names: Sequence[str]) -> list[str]:
    """The shapes of `names` this run has, the one whose serving engine is running first (no restart)."""
    held = run.engines.key or ""
    return sorted((n for n in names if n in run.shapes), key=lambda n: held != f"serve-{n}")


def section_profile(run: Run) -> dict:
    """Where a batch-1 decode step's time goes, with graphs: the step's wall time against its graph replayed alone
    (the GPU's share), the host's Python by function (cProfile), the kernels by device time (torch.profiler)."""
    out: dict = {
        "method": (
            "one 32-token request decoding: 20 engine steps timed (wall), the bucket's graph replayed 20 times back to "
            "back (CUDA events: the forward's GPU time), cProfile over 20 steps (tottime per step), torch.profiler "
            "over 5 steps (device time per step by kernel)"
        )
    }
    for name in held_first(run, (SMOL, EIGHT_B)):
        out[name] = run.guarded(partial(profile_shape, run, name))
    return out


def profile_shape(run: Run, name: str) -> dict:
    import cProfile
    import pstats

    run.need(60 if name == EIGHT_B else 20, f"profile {name}")
    log(run.budget, f"profile {name}")
    engine = run.serving_engine(name)
    rid = engine.add_request(prompts(run.pool, 1, run.sizes.decode_prompt, "prof")[0], greedy(400))
    step_until(engine, [rid], 4, 120)
    steps = 20
    out: dict = {"step_ms": step_ms(run, engine, steps)}
    graphs = getattr(engine.runner, "graphs", None)
    graph = getattr(graphs, "graphs", {}).get((1, False)) if graphs is not None else None
    if graph is not None and run.device.type == "cuda":
        out["graph_replay_ms"] = round(1000 * time_cuda(graph.replay, steps), 3)
        out["host_ms"] = round(out["step_ms"] - out["graph_replay_ms"], 3)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    sync(run.device)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:18]  # type: ignore[attr-defined]
    out["python_tottime_us_per_step"] = [
        f"{1e6 * tt / steps:8.1f} {cum * 1e6 / steps:8.1f} {Path(f).name}:{line} {fn}"
        for (f, line, fn), (_, _, tt, cum, _) in rows
    ]
    if run.device.type == "cuda":
        out["kernels_us_per_step"] = kernel_table(engine, 5)
    engine.abort(rid)
    run_to_end(engine, 60)
    names = sorted(p.name for p in run.adapter_root(name).glob("m*"))  # multi_lora's adapters, where it ran
    if names:
        out["batch_lora"] = run.guarded(partial(profile_batch, run, engine, names))
    return out


def profile_batch(run: Run, engine: LLMEngine, names: list[str]) -> dict:
    """multi_lora's decode step: a full batch (max_num_seqs rows) of 4 requests per adapter over max_loras adapters,
    and the same rows on the base model: wall time per step and the kernels by device time."""
    run.need(30, "profile batch_lora")
    s = run.sizes
    per = 4
    adapters = [names[i // per] for i in range(min(s.max_num_seqs, per * min(s.max_loras, len(names))))]
    out: dict = {"rows": len(adapters), "adapters": len(set(adapters))}
    for kind, which in (("lora", adapters), ("base", [None] * len(adapters))):
        batch = prompts(run.pool, len(which), s.decode_prompt, f"pb-{kind}")
        ids = [engine.add_request(p, greedy(200), adapter_id=a) for p, a in zip(batch, which, strict=True)]
        step_until(engine, ids, 3, 120)
        record: dict = {"step_ms": step_ms(run, engine, 10)}
        record["pure_decode"] = engine.last_step_tokens == len(which)
        if run.device.type == "cuda":
            record["kernels_us_per_step"] = kernel_table(engine, 3)
        for i in ids:
            engine.abort(i)
        run_to_end(engine, 60)
        out[kind] = record
    return out


def step_ms(run: Run, engine: LLMEngine, steps: int) -> float:
    """Milliseconds per engine step over `steps` steps, the device synchronized before and after."""
    sync(run.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(run.device)
    return round(1000 * (time.perf_counter() - start) / steps, 3)


def kernel_table(engine: LLMEngine, steps: int) -> list[str]:
    """torch.profiler over `steps` engine steps: the kernels by device time per step (the top 15), and the total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        device_us = float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)
        if device_us > 0:
            rows.append((device_us / steps, e.count // steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return [f"total {total:.1f}"] + [f"{us:8.1f} x{n:<4d} {key[:90]}" for us, n, key in rows[:15]]


def section_latency(run: Run) -> dict:
    order = held_first(run, (ONE_B, EIGHT_B))
    return {name: run.guarded(partial(latency_shape, run, name)) for name in order}


def latency_shape(run: Run, name: str) -> dict:
    run.need(60 if name == EIGHT_B else 20, f"latency {name}")
    log(run.budget, f"latency {name}")
    engine = run.serving_engine(name)
    write_adapters(run.shapes[name], run.adapter_root(name), [LATENCY_ADAPTER], run.device, torch.bfloat16)
    prewarm_s = wait_adapters(engine, [LATENCY_ADAPTER.name], "device", 120)
    runs = [one_latency(run, engine, f"lat{i}") for i in range(2 + run.sizes.latency_runs)][2:]  # 2 warm-ups
    ttft, total = [r[0] for r in runs], [r[1] for r in runs]
    return {
        "prompt_tokens": 70,
        "new_tokens": 10,
        "adapter": {"rank": LATENCY_ADAPTER.rank, "targets": list(LATENCY_ADAPTER.targets)},
        "runs": len(runs),
        "prewarm_seconds": round(prewarm_s, 2),
        "ttft_ms_median": round(1000 * statistics.median(ttft), 2),
        "total_ms_median": round(1000 * statistics.median(total), 2),
        "total_ms_min": round(1000 * min(total), 2),
        "decode_ms_per_token_median": round(1000 * statistics.median((b - a) / 9 for a, b in runs), 3),
    }


def one_latency(run: Run, engine: LLMEngine, seed: str) -> tuple[float, float]:
    """(time to first token, total) of one 70 -> 10 request on the latency adapter, a fresh prompt."""
    prompt = prompts(run.pool, 1, 70, seed)[0]
    start = time.perf_counter()
    rid = engine.add_request(prompt, greedy(10), adapter_id=LATENCY_ADAPTER.name)
    first = None
    while time.perf_counter() - start < 60:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.delta_token_ids:
                first = time.perf_counter() - start
            if out.finished:
                if out.error is not None or len(out.token_ids) != 10:
                    raise RuntimeError(f"latency request: {out.error or len(out.token_ids)}")
                return first or 0.0, time.perf_counter() - start
    raise TimeoutError("a 70 -> 10 request did not finish in 60 s")


def section_multi_lora(run: Run) -> dict:
    names = ([EIGHT_B] if run.args.multi_lora_8b else []) + [ONE_B]  # the target's shape first
    return {name: run.guarded(partial(multi_lora_shape, run, name)) for name in names}


def multi_lora_shape(run: Run, name: str) -> dict:
    s = run.sizes
    run.need(90 if name == EIGHT_B else 45, f"multi_lora {name}")
    names = [f"m{i:03d}" for i in range(s.num_adapters)]
    out = multi_lora_setup(run, name, names)
    engine = run.serving_engine(name)
    adapters = [names[i % len(names)] for i in range(s.num_requests)]
    for kind, which in (("lora", adapters), ("base", [None] * s.num_requests)):
        log(run.budget, f"multi_lora {name}: {kind}")
        batch = prompts(run.pool, s.num_requests, s.workload_prompt, kind)
        out[kind] = timed_workload(engine, run.device, batch, which, s.workload_new)
    out["lora_over_base"] = round(out["lora"]["tokens_per_s"] / out["base"]["tokens_per_s"], 3)
    if not s.peft_subset or name == EIGHT_B:
        why = "--peft-subset 0" if not s.peft_subset else "PEFT runs on the 1B shape (8B would outlast the lease)"
        out["peft_subset"] = {"status": "skipped", "reason": why}
        return out
    subset, names = prompts(run.pool, s.peft_subset, s.workload_prompt, "subset"), adapters[: s.peft_subset]
    out["ours_subset"] = timed_workload(engine, run.device, subset, names, s.workload_new)
    out["peft_subset"] = run.guarded(partial(peft_workload, run, name, subset, names))
    peft_rate = out["peft_subset"].get("tokens_per_s")
    out["ours_over_peft_subset"] = round(out["ours_subset"]["tokens_per_s"] / peft_rate, 2) if peft_rate else None
    return out


def multi_lora_setup(run: Run, name: str, names: list[str]) -> dict:
    """The adapters written and warm in host memory on the served engine, which ran a few requests."""
    s = run.sizes
    log(run.budget, f"multi_lora {name}: {len(names)} adapters")
    start = time.perf_counter()
    write_adapter_family(run.shapes[name], run.adapter_root(name), names, 16, run.device, torch.bfloat16)
    out: dict = {"adapters": len(names), "rank": 16, "targets": list(LATENCY_ADAPTER.targets)}
    out["method"] = (
        f"{s.num_requests} requests (adapter i % {len(names)}), {s.workload_prompt}-token prompts, "
        f"{s.workload_new} new tokens, ignore_eos, all submitted at once; the adapters in host memory first; "
        f"tokens/s over the wall time. PEFT: the first {s.peft_subset} requests as one left-padded batch with "
        "adapter_names (its mixed-adapter batching), against ours on the same subset"
    )
    out["build_seconds"] = round(time.perf_counter() - start, 2)
    engine = run.serving_engine(name)
    out["engine"] = engine.describe()
    out["max_loras"] = engine.config.max_loras
    out["prewarm_host_seconds"] = round(wait_adapters(engine, names, "host", 300), 2)
    timed_workload(engine, run.device, prompts(run.pool, 4, 16, "warm"), [names[0], names[1], None, None], 4)
    out["slot_load"] = run.guarded(partial(slot_load, run, engine, names[0]))
    return out


def slot_load(run: Run, engine: LLMEngine, adapter_id: str, repeats: int = 5) -> dict:
    """One adapter into a device slot, two ways: the host tier's weights (one buffer, page-locked on CUDA: one
    asynchronous transfer, then copies on the device) and the same tensors as separate pageable ones (a synchronous
    copy per layer and module, as slots loaded before). host_ms: until load() returns (what the engine's step
    waits for); done_ms: until the device holds them. Into a spare one-slot LoRASlots: the engine's stay as they
    are. Medians of `repeats` after one warm-up."""
    from dataclasses import replace

    from loraplane_server.executor.lora.slots import LoRASlots

    weights = engine.adapters.manager.weights(adapter_id)
    model = engine.runner.model
    spare = LoRASlots(
        model.lora_shapes(), model.args.num_layers, 1, engine.config.max_lora_rank, engine.dtype, run.device
    )
    pageable = replace(weights, tensors={k: (a.clone(), b.clone()) for k, (a, b) in weights.tensors.items()}, flat=None)
    flat = weights.flat
    out: dict = {"adapter_mb": round(weights.nbytes / 1e6, 2), "pinned": flat is not None and flat.is_pinned()}
    for label, w in (("one_transfer", weights), ("per_tensor_pageable", pageable)):
        host, done = [], []
        for i in range(repeats + 1):
            sync(run.device)
            start = time.perf_counter()
            spare.load(0, w)
            returned = time.perf_counter()
            sync(run.device)
            if i:
                host.append(1000 * (returned - start))
                done.append(1000 * (time.perf_counter() - start))
        out[label] = {"host_ms": round(statistics.median(host), 3), "done_ms": round(statistics.median(done), 3)}
    return out


def peft_workload(run: Run, name: str, batch: list[list[int]], adapters: Sequence[str | None]) -> dict:
    """The subset as one left-padded mixed-adapter batch through transformers + PEFT (adapter_names)."""
    run.need(60, f"PEFT subset {name}")
    log(run.budget, f"multi_lora {name}: PEFT subset")
    start = time.perf_counter()
    unique = sorted({a for a in adapters if a is not None})
    paths = {a: run.adapter_root(name) / a for a in unique}
    model = load_reference(run.model_dir(name, torch.bfloat16), paths, torch.bfloat16, run.device)
    load_s = time.perf_counter() - start
    batch_generate(model, batch[:2], adapters[:2], 2)  # warm-up
    sync(run.device)
    start = time.perf_counter()
    generated = batch_generate(model, batch, adapters, run.sizes.workload_new)
    sync(run.device)
    seconds = time.perf_counter() - start
    del model
    free_memory()
    return {
        "requests": len(batch),
        "adapters": len(unique),
        "load_seconds": round(load_s, 2),
        "seconds": round(seconds, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / seconds, 1),
    }


# the record
def machine(device: torch.device) -> dict:
    from loraplane_server.platforms import cpu_features

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    driver = Path("/proc/driver/nvidia/version")
    return {
        "device": device_info(device, cpu_features.describe()).to_dict(),
        "driver": driver.read_text().splitlines()[0].strip() if driver.is_file() else None,
        "torch_cuda": torch.version.cuda,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
    }


def dig(record: Any, *keys: str) -> Any:
    """record[k1][k2]... or None where a level is missing (a section that failed or was skipped)."""
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record


def target(value: float | None, bound: float, note: str = "") -> dict:
    met = None if value is None else value >= bound
    return {"value": value, "at_least": bound, "met": met, **({"note": note} if note else {})}


def measured_shape(sections: dict, key: str) -> str:
    """The multi_lora shape whose record holds `key`: the 8B (the targets' shape) where it ran, else the 1B."""
    return next((n for n in (EIGHT_B, ONE_B) if dig(sections, "multi_lora", n, key)), ONE_B)


def summary(sections: dict) -> dict:
    decode = dig(sections, "decode", "shapes") or {}
    rates = {
        f"{name} {mode}": {b: r.get("tokens_per_s") for b, r in (dig(record, mode, "batches") or {}).items()}
        for name, record in decode.items()
        for mode in ("eager", "graphs")
        if isinstance(dig(record, mode), dict)
    }
    multi_shape, peft_shape = (measured_shape(sections, key) for key in ("lora_over_base", "ours_over_peft_subset"))
    multi, peft = (dig(sections, "multi_lora", shape) or {} for shape in (multi_shape, peft_shape))
    smol = [dig(decode, SMOL, mode, "batches", "1", "tokens_per_s") for mode in ("graphs", "eager")]
    eager_8b = dig(decode, EIGHT_B, "eager", "batches", "1", "roofline_fraction")
    return {
        "statuses": {name: dig(s, "status") for name, s in sections.items()},
        "tests_passed": dig(sections, "tests", "passed"),
        "parity_fp32_passed": dig(sections, "parity", "float32", "passed"),
        "parity_bf16_passed": dig(sections, "parity", "bfloat16", "passed"),
        "graphs": dig(sections, "decode", "graphs"),
        "decode_tokens_per_s": rates,
        "targets": {
            "8b_decode_b1_roofline_fraction_with_graphs": target(
                dig(decode, EIGHT_B, "graphs", "batches", "1", "roofline_fraction"), 0.6, f"eager: {eager_8b}"
            ),
            "multi_lora_over_base": target(multi.get("lora_over_base"), 0.9, f"{multi_shape} shape"),
            "multi_lora_over_peft": target(
                peft.get("ours_over_peft_subset"),
                10.0,
                f"{peft_shape} shape, {dig(peft, 'peft_subset', 'requests')}-request subset",
            ),
            "smollm2_graphs_over_eager_b1": target(round(smol[0] / smol[1], 2) if all(smol) else None, 2.0),
        },
    }


def plot(result: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=80)
    sections = result["sections"]
    plot_decode(axes[0][0], dig(sections, "decode", "shapes") or {})
    plot_bars(axes[0][1], "multi-LoRA (generated tokens/s)", multi_lora_bars(sections))
    plot_bars(axes[1][0], "70 -> 10 with one adapter (ms)", latency_bars(sections))
    axes[1][1].axis("off")
    axes[1][1].text(
        0, 1, json.dumps(result["summary"]["targets"], indent=1)[:1500], va="top", family="monospace", size=7
    )
    fig.suptitle(f"bench/gpu.py on {dig(result, 'machine', 'device', 'name')}", size=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def plot_decode(ax: Any, shapes: dict) -> None:
    batches: set[int] = set()
    for name, record in shapes.items():
        for mode, style in (("eager", "-"), ("graphs", "-.")):
            rows = [(int(b), r) for b, r in (dig(record, mode, "batches") or {}).items() if r.get("status") == "ok"]
            if not rows:
                continue
            xs = [b for b, _ in rows]
            batches.update(xs)
            line = ax.plot(xs, [r["tokens_per_s"] for _, r in rows], ls=style, marker="o", label=f"{name} {mode}")
            roof = [(b, r["roofline_tokens_per_s"]) for b, r in rows if "roofline_tokens_per_s" in r]
            if roof and mode == "eager":
                ax.plot(*zip(*roof, strict=True), ls=":", color=line[0].get_color(), alpha=0.6)
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="decode (dotted: roofline)")
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.tick_params(axis="x", which="minor", length=0, labelbottom=False)
    if batches:
        ax.legend(fontsize=7)


def multi_lora_bars(sections: dict) -> dict[str, float]:
    keys = {
        "ours, adapters": "lora",
        "ours, base": "base",
        "ours, subset": "ours_subset",
        "PEFT, subset": "peft_subset",
    }
    bars: dict[str, float] = {}
    for shape in (EIGHT_B, ONE_B):
        multi = dig(sections, "multi_lora", shape) or {}
        short = shape.split("-")[-1].upper()  # 8B, 1B
        bars |= {f"{short} {label}": v for label, key in keys.items() if (v := dig(multi, key, "tokens_per_s"))}
    return bars


def latency_bars(sections: dict) -> dict[str, float]:
    bars = {}
    for name, record in (dig(sections, "latency") or {}).items():
        if isinstance(record, dict) and record.get("status") == "ok":
            bars[f"{name} TTFT"] = record["ttft_ms_median"]
            bars[f"{name} total"] = record["total_ms_median"]
    return bars


def plot_bars(ax: Any, title: str, bars: dict[str, float]) -> None:
    ax.barh(list(bars), list(bars.values()))
    ax.set_title(title, size=9)
    ax.tick_params(labelsize=7)


# the run
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu", help="folder for gpu.json, gpu.png")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (with --quick: the dev machine's check)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few requests (the CPU check of the script)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall time for all sections (the rest is skipped)")
    p.add_argument("--tests-timeout", type=float, default=150.0, help="seconds for the pytest subprocess")
    p.add_argument("--tokenizer-dir", default=str(TOKENIZER_DIR), help="tokenizer.json and friends")
    p.add_argument("--work-dir", help="where the models and adapters are written (default: /dev/shm or /tmp)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="each bench engine's share")
    p.add_argument("--tie-tolerance", type=float, default=0.05, help="bf16 parity: a near tie's logit gap")
    p.add_argument("--layers-8b", type=int, help="fewer layers for the Llama-3.1-8B shape (recorded)")
    p.add_argument(
        "--multi-lora-8b",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the multi_lora workload on the 8B shape (the target's) before the 1B one (--no-multi-lora-8b: 1B only)",
    )
    p.add_argument("--layer-backend", default="auto", help="the bench engines' layer_backend (auto: triton on CUDA)")
    p.add_argument("--max-loras", type=int, help="multi_lora's device slots (adapters in one batch; default 64)")
    p.add_argument("--peft-subset", type=int, help="multi_lora's PEFT subset in requests (0: skip PEFT; default 64)")
    p.add_argument("--enforce-eager", action="store_true", help="every engine eager (no CUDA graphs), e.g. a rerun")
    p.add_argument("--prepare", action="store_true", help="copy the built-in model's tokenizer files, then exit")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def load_pool(tokenizer_dir: Path) -> tuple[list[int], dict]:
    """The token ids prompts draw from: the tokenizer's non-special ids; without a tokenizer, 1,000..39,999."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as exc:  # noqa: BLE001 - recorded; the models are then written without tokenizer files
        return list(range(1000, 40000)), {"ok": False, "dir": str(tokenizer_dir), "error": error_record(exc)}
    special = set(tok.all_special_ids)
    pool = [i for i in range(len(tok)) if i not in special]
    note = "the Llama shapes keep their 128,256-row vocabulary; prompts use only ids the tokenizer has"
    return pool, {"ok": True, "dir": str(tokenizer_dir), "size": len(tok), "class": type(tok).__name__, "note": note}


def work_dir(args: argparse.Namespace) -> tuple[Path, bool]:
    """(the folder, whether this run made it): /dev/shm when it has room for the 8B shape, else the temp dir."""
    if args.work_dir:
        return Path(args.work_dir), False
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > (4 << 30 if args.quick else 40 << 30)
    return Path(tempfile.mkdtemp(prefix="loraplane-gpu-", dir=shm if roomy else None)), True


def make_shapes(args: argparse.Namespace) -> dict[str, Shape]:
    shapes = quick_shapes() if args.quick else dict(REAL_SHAPES)
    if args.layers_8b:
        eight = shapes[EIGHT_B]
        note = f"{eight.source}, {args.layers_8b} of its {eight.num_layers} layers (--layers-8b)"
        shapes[EIGHT_B] = replace(eight, num_layers=args.layers_8b, source=note)
    return shapes


def part_statuses(record: dict, depth: int = 2) -> list[str]:
    """The statuses of the records nested in `record` (its shapes, dtypes, batches), `depth` levels down."""
    found: list[str] = []
    for value in record.values():
        if isinstance(value, dict):
            found += [value["status"]] if "status" in value else part_statuses(value, depth - 1) if depth > 1 else []
    return found


def rolled_up(record: dict) -> dict:
    """A section whose every part was skipped is itself skipped."""
    parts = part_statuses(record)
    if record["status"] == "ok" and parts and set(parts) == {"skipped"}:
        return {**record, "status": "skipped", "reason": "skipped: out of time (every part)"}
    return record


def run_sections(run: Run, names: list[str]) -> dict:
    sections: dict = {}
    table: dict[str, Callable[[Run], dict]] = {
        "tests": section_tests,
        "ceilings": section_ceilings,
        "parity": section_parity,
        "decode": section_decode,
        "profile": section_profile,
        "latency": section_latency,
        "multi_lora": section_multi_lora,
    }
    for name in SECTIONS:
        if name not in names:
            continue
        log(run.budget, f"section {name}")
        if run.budget.left() <= 0:
            sections[name] = {"status": "skipped", "reason": "skipped: out of time"}
            continue
        with alarm(run.budget.left() + 15):
            sections[name] = rolled_up(run.guarded(partial(table[name], run)))
        log(run.budget, f"section {name}: {sections[name]['status']} in {sections[name]['seconds']} s")
        partial_json = run.args.out / "gpu.partial.json"  # what a run killed by its lease's end still returns
        partial_json.write_text(json.dumps({"sections": sections}, indent=1, default=str) + "\n")
    run.engines.drop()
    return sections


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare:
        from loraplane_server.store.builtin import resolve_model

        print(json.dumps(prepare_tokenizer(resolve_model("smollm2-135m"), Path(args.tokenizer_dir)), indent=1))
        return 0
    try:
        device = resolve_device(args.device)
    except (DeviceError, ValueError) as exc:
        print(f"bench/gpu.py: {exc}", file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
        result = bench(args, device)
    text = json.dumps(result, indent=1, default=str)
    (args.out / "gpu.json").write_text(text + "\n")
    print(text)
    failed = [n for n, s in result["sections"].items() if s.get("status") == "error"]
    return 1 if failed else 0


def bench(args: argparse.Namespace, device: torch.device) -> dict:
    sizes = QUICK if args.quick else Sizes()
    asked = {"max_loras": args.max_loras, "peft_subset": args.peft_subset}
    sizes = dataclasses.replace(sizes, **{k: v for k, v in asked.items() if v is not None})
    budget = Budget(args.budget_s, sizes.seconds_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    pool, tokenizer = load_pool(Path(args.tokenizer_dir))
    args.tokenizer_ok = tokenizer["ok"]
    work, made = work_dir(args)
    shapes = make_shapes(args)
    run = Run(args, device, sizes, shapes, work, budget, pool)
    result: dict = {
        "bench": "gpu",
        "issue": 35,
        "quick": args.quick,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    result["machine"] = machine(device)
    result["tokenizer"] = tokenizer
    result["shapes"] = {n: s.record() for n, s in shapes.items()}
    result["work_dir"] = str(work)
    try:
        result["sections"] = run_sections(run, args.sections.split(","))
    finally:
        if made:
            shutil.rmtree(work, ignore_errors=True)
    result["engines"] = run.engines.records
    result["models"] = run.models
    result["ceilings"] = run.ceilings
    result["summary"] = summary(result["sections"])
    result["wall_seconds"] = round(budget.elapsed(), 1)
    try:
        result["plot"] = plot(result, args.out / "gpu.png")
    except Exception as exc:  # noqa: BLE001 - the JSON matters more than the picture
        result["plot"] = {"error": error_record(exc)}
    return result


if __name__ == "__main__":
    sys.exit(main())
