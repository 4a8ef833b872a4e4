"""Quantization benchmark: int8 base weights against the unquantized engine, same machine, same run.

Both engines run the built-in SmolLM2-135M in the engine's dtype for this CPU (bf16 where the kernels' bf16
paths load, fp32 otherwise) with every backend on auto; the int8 one adds `quantization="int8"` (the decoder's
linear layers as int8 with a scale per output channel; embedding, lm_head, norms, LoRA and the KV cache keep
the dtype). Measured, alternating the two engines so drift hits both:
1. decode tokens/s at batch 1, 8 and 64 (bench/engine.py's decode_rate: 32-token prompts, 128 new tokens,
   only the steps after every request has its first token);
2. the multi-adapter workload (bench/multi_lora.py's (b): 256 requests over 64 random adapters, every adapter
   in a device slot), useful tokens/s;
3. the bytes of the model's weights in memory (the linear layers, and the whole model).
Targets (issue 24): batch-1 decode >= 1.6x, the multi-adapter workload >= 1.3x, linear-layer bytes <= 0.55x.

Run: PYTHONPATH=server:operator .venv/bin/python bench/quantization.py [--quick] [--rounds 2]
     [--out bench/out/quantization.json]
Prints one JSON object, writes it to --out and draws the plot next to it (.png).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from common import machine, pyplot, token_pool, write_result  # bench/ is on sys.path
from engine import Workload as EngineWorkload
from engine import decode_rate
from multi_lora import (
    QUICK,
    Workload,
    adapter_id,
    engine_config,
    make_requests,
    make_template,
    run_ours,
    target,
    warm_adapters,
    write_variants,
)

from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.layers.linear import ProjectionLinear
from loraplane_server.spec.draft import weight_bytes as model_weight_bytes  # bench: weight_bytes is this file's own
from loraplane_server.store.builtin import resolve_model

TARGET_DECODE_B1 = 1.6
TARGET_MULTI_ADAPTER = 1.3
TARGET_BYTES = 0.55
DECODE_BATCHES = (1, 8, 64)
MODES = ("none", "int8")


def make_engine(quantization: str, w: Workload, tmp: Path) -> LLMEngine:
    """The multi-adapter workload's engine (every adapter a device slot) with the given quantization."""
    config = engine_config(replace(w, max_loras=w.num_adapters), tmp, quantization, 1 << 30)
    return LLMEngine(replace(config, quantization=quantization))


def weight_bytes(engine: LLMEngine) -> dict[str, int]:
    """Bytes of the decoder's linear layers (weights, scales, row sums, biases) and of every tensor of the model."""
    model = engine.runner.model
    linear = sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, ProjectionLinear)
        for t in (m.weight, m.weight_scale, m.weight_sum, m.bias)
        if t is not None
    )
    everything = model_weight_bytes(model)  # every parameter and buffer
    scales = sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, ProjectionLinear)
        for t in (m.weight_scale, m.weight_sum)
        if t is not None
    )
    return {"linear_layers": linear, "model": everything + scales}


def measure(engines: dict[str, LLMEngine], w: Workload, ew: EngineWorkload, rounds: int) -> dict[str, dict]:
    """Every measurement, the two engines in turn, `rounds` times; medians."""
    pools = {m: token_pool(e) for m, e in engines.items()}
    raw: dict[str, dict[str, list[float]]] = {m: {} for m in engines}
    for r in range(rounds):
        for b in DECODE_BATCHES:
            for mode, engine in engines.items():
                rate = decode_rate(engine, pools[mode], b, replace(ew, seed=ew.seed + r))["tokens_per_s"]
                raw[mode].setdefault(f"decode_b{b}", []).append(rate)
        for mode, engine in engines.items():
            reqs = make_requests(pools[mode], w, f"quant-{r}", True)
            raw[mode].setdefault("multi_adapter", []).append(run_ours(engine, reqs)["tokens_per_s"])
    return {
        mode: {name: {"tokens_per_s": statistics.median(xs), "runs": xs} for name, xs in by.items()}
        for mode, by in raw.items()
    }


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    names = [f"decode_b{b}" for b in DECODE_BATCHES] + ["multi_adapter"]
    labels = [f"decode\nbatch {b}" for b in DECODE_BATCHES] + ["256 requests\n64 adapters"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(names))
    for i, mode in enumerate(MODES):
        rates = [result["systems"][mode][n]["tokens_per_s"] for n in names]
        axes[0].bar([k + (i - 0.5) * 0.4 for k in x], rates, width=0.4, label="bf16" if mode == "none" else mode)
    axes[0].set_xticks(list(x), labels, fontsize=8)
    axes[0].set_ylabel("tokens/s")
    axes[0].legend()
    axes[0].set_title("throughput")
    mib = [result["bytes"][m]["linear_layers"] / 2**20 for m in MODES]
    axes[1].bar(["bf16" if m == "none" else m for m in MODES], mib, color="#2a7")
    axes[1].set_title("linear layers' weights (MiB)")
    fig.suptitle(f"{result['machine'].get('cpu', '')}, kernels for {result['machine'].get('kernel_isa')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def run(w: Workload, ew: EngineWorkload, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="loraplane-quant-") as tmp_name:
        tmp = Path(tmp_name)
        template = make_template(resolve_model("smollm2-135m"), tmp / "template")
        paths = write_variants(template, tmp / "adapters", w.num_adapters, w.seed)
        engines = {m: make_engine(m, w, tmp) for m in MODES}
        for engine in engines.values():
            warm_adapters(engine, paths, [adapter_id(i) for i in range(w.num_adapters)])
            decode_rate(engine, token_pool(engine), 2, replace(ew, decode_new_tokens=4))  # warm-up
        with torch.inference_mode():
            systems = measure(engines, w, ew, rounds)
        sizes = {m: weight_bytes(e) for m, e in engines.items()}
        base, q = systems["none"], systems["int8"]
        ratios = {name: round(q[name]["tokens_per_s"] / base[name]["tokens_per_s"], 3) for name in base}
        ratios["linear_layer_bytes"] = round(sizes["int8"]["linear_layers"] / sizes["none"]["linear_layers"], 4)
        ratios["model_bytes"] = round(sizes["int8"]["model"] / sizes["none"]["model"], 4)
        engine = engines["int8"]
        return {
            "machine": machine(dtype=engine.dtype, engine=engine.describe()),
            "config": {"multi_adapter": w.__dict__, "decode": ew.__dict__, "rounds": rounds, "modes": MODES},
            "systems": systems,
            "bytes": sizes,
            "ratios_int8_over_unquantized": ratios,
            "targets": {
                "decode_batch1": target(ratios["decode_b1"], TARGET_DECODE_B1, True),
                "multi_adapter": target(ratios["multi_adapter"], TARGET_MULTI_ADAPTER, True),
                "linear_layer_bytes": target(ratios["linear_layer_bytes"], TARGET_BYTES, False),
            },
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "quantization.json")
    parser.add_argument("--quick", action="store_true", help="a reduced workload for a smoke check")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    w = QUICK if args.quick else Workload()
    ew = EngineWorkload(decode_new_tokens=32) if args.quick else EngineWorkload()
    write_result(run(w, ew, args.rounds), args.out, plot)


if __name__ == "__main__":
    main()
