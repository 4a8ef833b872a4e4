"""Builds and loads the CPU kernels (csrc/*.cpp), once per machine: decode and prefill attention
over the paged KV cache, the linear layers (a weight-streaming path for a few rows, a
register-tiled GEMM for more; bf16 weights, and int8 ones quantized per channel by executor/layers/quant.py),
and the fused elementwise parts of
a decoder layer (RMSNorm with the residual add, rotary, SiLU-and-multiply) and LoRA for the rows
of many adapters (BGMV); bf16.

The sources are compiled for a named target (cpu_features.KERNEL_TARGETS: avx512_bf16, avx2,
generic; never -march=native), and the target is picked at run time from the CPU's flags: `load()`
takes the best target this CPU runs from a directory of prebuilt ones (`LORAPLANE_KERNELS_DIR`, which
the server image fills at image build: `python -m loraplane_server.kernels.cpu_kernels build`), or
else from the user cache (`cache_root()/kernels`), building it there on first use (~1 min on 2
cores) with torch's extension builder. A build is keyed by the target, the sources, torch's version
and the compiler flags, so one image or one shared cache volume serves nodes of different CPUs.
When no compiler is available or the build fails, `load()` returns False with the reason in
`load_error()` and the engine keeps its torch paths.

The library reports the instruction set it was compiled for (`isa()`). Every op runs on any x86
CPU; the bf16 fast paths (linear, LoRA (BGMV), decode and prefill attention, the layer ops) exist
in an AVX-512 BF16 build (vdpbf16ps) and in an AVX2 build (FMA over bf16 widened to fp32), and
`has_bf16_kernels()` is the one question the engine and the tests ask before taking them.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from loraplane_server.platforms import cpu_features
from loraplane_server.platforms.user_cache import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE_NAMES = (
    "bindings.cpp",  # every op's schema
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "linear_cpu.cpp",
    "linear_int8_cpu.cpp",
    "layer_ops_cpu.cpp",
    "lora_cpu.cpp",
    "decoder_layer_cpu.cpp",
)
SOURCES = tuple(CSRC / name for name in SOURCE_NAMES)
# included by the sources: part of the build key
HEADERS = (CSRC / "cpu_common.h", CSRC / "ops.h", CSRC / "layer_weights.h")
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without it the kernel runs on
# one thread. The extension then links libgomp.so.1, which resolves to the copy torch already loaded.
LDFLAGS = ["-fopenmp"]
BF16_ISAS = ("avx512_bf16", "avx2")  # the builds whose library holds the bf16 fast paths
PREBUILT_ENV = "LORAPLANE_KERNELS_DIR"  # a (read-only) directory of prebuilt targets, looked in first
LIBRARY = "loraplane_cpu_kernels.so"
_lock = threading.Lock()
_state: dict[str, object] = {}


def cflags(target: str | None = None) -> list[str]:
    """-O3, the target's flags (this CPU's best target by default) and OpenMP."""
    return ["-O3", *cpu_features.march_flags(target), "-fopenmp"]


def build_dir(target: str | None = None, root: Path | None = None) -> Path:
    """Where the build for `target` (this CPU's best by default) lives under root (the user cache's
    kernels/ by default): a folder named by the target and a key of what the binary depends on."""
    target = target or cpu_features.kernel_target()
    flags = " ".join(cflags(target) + LDFLAGS)
    sources = [source.read_bytes() for source in SOURCES + HEADERS]
    parts = [*sources, torch.__version__.encode(), flags.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return (root or cache_root() / "kernels") / f"loraplane_cpu-{target}-{key}"


def prebuilt(target: str) -> Path | None:
    """The library of `target` in LORAPLANE_KERNELS_DIR, if that directory holds a build of these
    sources for it."""
    root = os.environ.get(PREBUILT_ENV)
    if not root:
        return None
    library = build_dir(target, Path(root)) / LIBRARY
    return library if library.is_file() else None


def _compile(target: str, directory: Path) -> None:
    """Builds (unless built) and loads the library for `target` in `directory`."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="loraplane_cpu_kernels",
        sources=[str(source) for source in SOURCES],
        extra_cflags=cflags(target),
        extra_ldflags=list(LDFLAGS),  # the extension builder appends to the list it is given
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def load() -> bool:
    """Loads the build for this CPU's best target (prebuilt, or built into the user cache on first
    use, ~1 min); True when it is usable."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("LORAPLANE_DISABLE_CPU_KERNELS"):
            _state.update(ok=False, error="disabled by LORAPLANE_DISABLE_CPU_KERNELS")
            return False
        try:
            target = cpu_features.kernel_target()
            _state["target"] = target
            library = prebuilt(target)
            if library is not None:
                torch.ops.load_library(str(library))
            else:
                directory = build_dir(target)
                if not (directory / LIBRARY).is_file():
                    log.info(
                        "building the CPU kernels for target %s on %s (once per target and version, about a minute)",
                        target,
                        cpu_features.describe(),
                    )
                _compile(target, directory)
            ops = (
                "paged_decode_attention_",
                "write_kv_",
                "paged_prefill_attention_",
                "linear_",
                "linear_int8_",
                "linear_int8_silu_mul_",
                "add_rms_norm_",
                "rotary_",
                "silu_mul_",
                "argmax_rows_",
                "bgmv_",
                "bgmv_packed_",
                "decoder_layer_",
                "isa",
                "linear_max_rows",
            )
            ok = all(hasattr(torch.ops.loraplane, op) for op in ops)
            _state.update(ok=ok, error=None if ok else "the library lacks some of its ops (a stale build?)")
            if ok:
                _state["isa"] = str(torch.ops.loraplane.isa())
                _state["linear_max_rows"] = int(torch.ops.loraplane.linear_max_rows())
        except Exception as error:  # no compiler, no ninja, a build error: keep the torch path
            log.warning("CPU kernels unavailable, using the torch paths: %s", error)
            _state.update(ok=False, error=f"{type(error).__name__}: {error}")
        return bool(_state["ok"])


def build(targets: list[str], root: Path) -> dict[str, float]:
    """Builds each target's library under root (as LORAPLANE_KERNELS_DIR reads it), each in a child
    process (one process loads one build of the ops); returns the seconds each took. A target this
    CPU cannot run still builds: the compiler only needs its flags."""
    seconds = {}
    for target in targets:
        started = time.monotonic()
        directory = build_dir(target, root)
        command = [
            sys.executable,
            "-m",
            "loraplane_server.kernels.cpu_kernels",
            "build",
            "--target",
            target,
            "--into",
            str(root),
            "--in-process",
        ]
        subprocess.run(command, check=False)
        # loading a target the building CPU lacks may fail after the build: the library is what counts
        if not (directory / LIBRARY).is_file():
            raise RuntimeError(f"the CPU kernels did not build for {target} in {directory}")
        seconds[target] = round(time.monotonic() - started, 1)
    return seconds


def load_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def isa() -> str | None:
    """The instruction set the loaded library was compiled for (avx512_bf16, avx2 or generic); None
    when it did not load."""
    if "ok" not in _state:  # asked on every prefill layer: no lock once loaded
        load()
    return _state.get("isa")  # type: ignore[return-value]


def loaded_isa() -> str | None:
    """isa() of a library already loaded, without building or loading one (None if none is)."""
    return _state.get("isa") if _state.get("ok") else None  # type: ignore[return-value]


def linear_max_rows() -> int:
    """Rows of x up to which the layers take linear() over torch's GEMM: the loaded build's own threshold
    (csrc/ops.h kLinearMaxRows, measured per ISA by bench/linear.py); 0 when no library loaded."""
    if "ok" not in _state:
        load()
    return int(_state.get("linear_max_rows", 0))  # type: ignore[call-overload]


def has_bf16_kernels() -> bool:
    """Whether the library holds the bf16 fast paths (linear, BGMV, decode and prefill attention, the
    layer ops): built for AVX-512 BF16 or for AVX2 (x86-64-v3), on a CPU that has it."""
    return isa() in BF16_ISAS


def missing_bf16_kernels() -> str:
    """Why has_bf16_kernels() is False, in words a user can act on."""
    if not load():
        return f"the CPU kernels did not build: {load_error()}"
    return (
        f"the CPU kernels were built for {isa()}: this CPU has neither AVX-512 BF16 nor AVX2: {cpu_features.describe()}"
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q: [S, H, D]; caches: [N, B, KVH, D]; block_tables: [S, W]; context_lens: [S] -> [S, H, D], written
    into `out` when given (rows may be strided); window > 0: each row's last `window` positions alone."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.loraplane.paged_decode_attention_(out, q, k_cache, v_cache, block_tables, context_lens, scale, window)
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache/v_cache [N, B, KVH, D] at flat slot slot_mapping[t] = k[t]/v[t] ([T, KVH, D], rows may be strided)."""
    torch.ops.loraplane.write_kv_(k_cache, v_cache, k, v, slot_mapping)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [M, K] (rows may be strided): weight [N, K] contiguous -> [M, N] (bf16 is the fast case)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    torch.ops.loraplane.linear_(out, x, weight, bias)
    return out


def linear_gemm_rows(rows: int, k: int) -> int:
    """Of a bf16 linear() of `rows` rows with `k` columns, how many (the first) the kernel's GEMM computes;
    the rest run its decode paths. A row's bits depend on which of the two computes it, not on the
    other rows' values."""
    return int(torch.ops.loraplane.linear_gemm_rows(rows, k))


def linear_int8(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (scale * w)^T (+ bias) for bf16 x [M, K] (rows may be strided) and an int8 weight from
    quant.quantize_int8 (w int8 [N, K], scale fp32 [N], wsum int32 [N]) -> bf16 [M, N]. Up to 4 rows:
    weight-only, exact up to fp32 sums; more: x quantized per row to int8 too (W8A8, integer dots)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    torch.ops.loraplane.linear_int8_(out, x, w, scale, wsum, bias)
    return out


def linear_int8_silu_mul(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu_mul(linear_int8(x, w, scale, wsum, bias)) in one pass for w = [gate; up] (int8 [2I, K]) ->
    bf16 [M, I]; the same bits as the two ops."""
    out = torch.empty(x.shape[0], w.shape[0] // 2, dtype=x.dtype, device=x.device)
    torch.ops.loraplane.linear_int8_silu_mul_(out, x, w, scale, wsum, bias)
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place, when given); returns weight * rmsnorm(residual). bf16 [T, n]."""
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    torch.ops.loraplane.add_rms_norm_(out, residual, delta, weight, eps)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates q [T, H, D] and k [T, KVH, D] in place; cos, sin: [T, D]; all bf16."""
    torch.ops.loraplane.rotary_(q, k, cos, sin)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(linear(x, weight, bias)) in one pass for weight = [gate; up] ([2I, K]) -> [M, I]: the
    GEMM's tile holds both halves, so the [M, 2I] product is never written (same bits as the two ops)."""
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    torch.ops.loraplane.linear_silu_mul_(out, x, weight, bias)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (bf16 [T, 2I]) -> [T, I]."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    torch.ops.loraplane.silu_mul_(out, gate_up)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for bf16 logits [T, V] (rows may be strided) -> int64 [T]."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.loraplane.argmax_rows_(out, logits)
    return out


def prefill_kernel_applies(q: torch.Tensor) -> bool:
    """Whether paged_prefill_attention covers q: bf16, head_dim 64 or 128, a build with the bf16 paths."""
    return prefill_kernel_applies_to(q.dtype, q.shape[-1])


def prefill_kernel_applies_to(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype == torch.bfloat16 and head_dim in (64, 128) and has_bf16_kernels()


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx: int,
    scale: float,
    window: int = 0,
) -> None:
    """Causal attention of one prefill chunk into out [n, H, D]: q [n, H, D] at positions ctx..ctx+n-1,
    keys and values (the chunk's own already written) from the caches [N, B, KVH, D] via block_table;
    window > 0: the query at position p sees positions p - window + 1 .. p alone (the blocks wholly before
    the first query's window are never read)."""
    torch.ops.loraplane.paged_prefill_attention_(out, q, k_cache, v_cache, block_table, ctx, scale, window)


def bgmv_(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    slots: torch.Tensor,
    proj_rows: torch.Tensor,
    out_bounds: torch.Tensor,
    skip_slot: int,
) -> None:
    """out[b] += (x[b] a[s]^T) bt[s] with s = slots[b], block-diagonal per projection p: rank rows
    proj_rows[s, p] = (first, count) of a[s] and bt[s], against out columns out_bounds[p]:out_bounds[p+1].
    Rows on skip_slot untouched. out [B, N], x [B, K], a [S, W, K], bt [S, W, N], slots [B] int64,
    proj_rows [S, P, 2] int64, out_bounds [P + 1] int64; bf16."""
    torch.ops.loraplane.bgmv_(out, x, a, bt, slots, proj_rows, out_bounds, skip_slot)


def bgmv_packed_(
    out: torch.Tensor,
    x: torch.Tensor,
    packed: torch.Tensor,
    slots: torch.Tensor,
    proj: torch.Tensor,
    out_bounds: torch.Tensor,
    skip_slot: int,
) -> None:
    """bgmv_ over the packed layout: packed [S, C] bf16, slot s holding for each projection p it targets
    A_p [rank_p, K] then B_p^T [rank_p, width_p] back to back; proj [S, P, 2] int64 = (offset of A_p, rank_p)."""
    torch.ops.loraplane.bgmv_packed_(out, x, packed, slots, proj, out_bounds, skip_slot)


def layer_weights(
    weights: list[torch.Tensor | None],
    heads: tuple[int, int],
    scale: float,
    eps: tuple[float, float],
    window: int = 0,
) -> torch.ScriptObject:
    """One decoder layer's weights for decoder_layer, gathered (and checked) once at load
    (csrc/layer_weights.h): weights = qkv_w, qkv_b, o_w, post_norm_w, gate_up_w, gate_up_b, down_w, down_b,
    next_norm_w (None for the last layer); heads = (num_heads, num_kv_heads); eps = (the post-attention
    norm's, the next norm's); window: the layer's sliding attention window (0: full attention)."""
    return torch.classes.loraplane.LayerWeights(*weights, *heads, scale, *eps, window)


def decoder_layer(
    x: torch.Tensor,
    h: torch.Tensor,
    weights: torch.ScriptObject,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: list[torch.Tensor | None],
    chunk_tables: list[torch.Tensor],
    chunks: list[int],
    lora: list[torch.Tensor | None],
    num_decode: int,
    skip_slot: int,
) -> torch.Tensor:
    """One decoder layer (csrc/decoder_layer_cpu.cpp): x [T, hidden] += attention and MLP (in place);
    returns the next layer's normed input, or for the last layer (weights without a next norm) x itself,
    on the logits rows alone where step names them. weights: layer_weights(); step: cos, sin,
    slot_mapping, decode block tables, decode context lengths, LoRA row slots, logits rows, their LoRA
    slots; chunks: (query_start, tokens, context) per prefill chunk; lora: (packed, proj, out_bounds) for
    qkv, o, gate_up, down (None where not targeted); num_decode: the decode rows (first in x)."""
    return torch.ops.loraplane.decoder_layer_(
        x, h, weights, k_cache, v_cache, step, chunk_tables, chunks, lora, num_decode, skip_slot
    )


def main(argv: list[str] | None = None) -> None:
    """python -m loraplane_server.kernels.cpu_kernels build [--target T ...] [--into DIR]: the server
    image's build step (every target, into the directory LORAPLANE_KERNELS_DIR then names)."""
    parser = argparse.ArgumentParser(prog="python -m loraplane_server.kernels.cpu_kernels")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--target", action="append", choices=list(cpu_features.KERNEL_TARGETS))
    parser.add_argument("--into", type=Path, default=cache_root() / "kernels")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # build()'s child
    args = parser.parse_args(argv)
    if args.in_process:
        _compile(args.target[0], build_dir(args.target[0], args.into))
        return
    for target, took in build(args.target or list(cpu_features.KERNEL_TARGETS), args.into).items():
        print(f"{target}: {build_dir(target, args.into)} ({took} s)")


if __name__ == "__main__":
    main()
