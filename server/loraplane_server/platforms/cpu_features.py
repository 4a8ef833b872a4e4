"""What this CPU can run: its model name and instruction-set flags from /proc/cpuinfo, capped by
`LORAPLANE_CPU_ISA`.

The project's machines differ in CPU (some with AVX-512 BF16, some with AVX2 alone), and so do its
users'. Every decision that depends on the instruction set (the dtype `auto` picks, which build of the
CPU kernels loads, which kernels the engine calls) reads it here, at run time, so that one switch
moves them all together:

    LORAPLANE_CPU_ISA=native   (default) what the CPU reports
    LORAPLANE_CPU_ISA=avx2     behave as an AVX2-only CPU (x86-64-v3: AVX2, FMA, F16C, no AVX-512):
                               the AVX-512 and AMX flags are hidden and the x86-64-v3 build of the
                               kernels loads, so an AVX-512 machine runs exactly the code an AVX2 one does

The kernels are built per named target (`KERNEL_TARGETS`), never for `-march=native`: the build for
a target runs on every CPU that has the target's flags, so one image or one shared cache serves a
node pool of mixed CPUs, each node loading the best target its CPU has (`kernel_target()`).

(`make test-avx2` runs the engine's tests that way; set ATEN_CPU_CAPABILITY=avx2 beside it to cap
torch's own kernels as well.)
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ISA_ENV = "LORAPLANE_CPU_ISA"
ISA_CAPS = ("native", "avx2")
# flags an AVX2-only CPU (x86-64-v3) does not have: hidden under LORAPLANE_CPU_ISA=avx2
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")
# the flags that decide the engine's paths, as logs and benchmarks record them
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")


def isa_cap() -> str:
    """The LORAPLANE_CPU_ISA setting ('native' when unset); a value it does not know is an error."""
    cap = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if cap not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={cap!r}: expected one of {', '.join(ISA_CAPS)}")
    return cap


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo."""
    model, flags = "", frozenset[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown CPU", flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as the engine may use them: all of them, or under LORAPLANE_CPU_ISA=avx2
    those an AVX2-only CPU has."""
    flags = _cpuinfo()[1]
    if isa_cap() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2))
    return flags


def has_bf16_compute() -> bool:
    """Whether the CPU has bf16 dot products (AVX-512 BF16 or AMX): bf16 is then the fast dtype."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


# the kernels' build targets, best first: (the CPU flags a target needs, its compiler flags)
KERNEL_TARGETS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    # x86-64-v4 (AVX-512 F, BW, CD, DQ, VL) with AVX-512 BF16 and VNNI (the int8 GEMM's vpdpbusd; every
    # CPU with AVX-512 BF16 has it): Zen 4 and later, Cooper Lake, Sapphire Rapids and later
    "avx512_bf16": (
        frozenset(
            {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma"}
        ),
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
    ),
    # x86-64-v3: Haswell (2013) and later, Zen 1 and later; most cloud VMs and laptops
    "avx2": (frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}), ("-march=x86-64-v3", "-mtune=generic")),
    # any x86-64: every op runs, none of the bf16 fast paths exists
    "generic": (frozenset(), ("-march=x86-64", "-mtune=generic")),
}


def kernel_target() -> str:
    """The best of KERNEL_TARGETS this CPU (capped by LORAPLANE_CPU_ISA) can run."""
    flags = cpu_flags()
    return next(name for name, (needs, _) in KERNEL_TARGETS.items() if needs <= flags)


def march_flags(target: str | None = None) -> list[str]:
    """The compiler's target flags for the CPU kernels' build for `target` (this CPU's by default)."""
    return list(KERNEL_TARGETS[target or kernel_target()][1])


def describe() -> str:
    """'<model> (<the ISA flags that matter here>)' for logs, errors and benchmark records."""
    have = [f for f in _ISA_FLAGS if f in cpu_flags()]
    cap = isa_cap()
    suffix = f", capped by {ISA_ENV}={cap}" if cap != "native" else ""
    return f"{cpu_model()} ({' '.join(have) or 'no AVX2'}{suffix})"


def record() -> dict[str, object]:
    """What a benchmark records of the CPU: its model, the ISA flags that pick the paths, the cap."""
    return {"cpu": cpu_model(), "cpu_isa_flags": [f for f in _ISA_FLAGS if f in cpu_flags()], "cpu_isa_cap": isa_cap()}
