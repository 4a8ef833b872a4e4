"""Speculative decoding benchmark (issue 25): prompt lookup and a draft model against speculation off, same machine.

Three engines run the built-in SmolLM2-135M in the engine's dtype for this CPU with every backend on auto:
speculation off, `speculative="ngram"`, and `speculative="draft"` with the built-in model's own Q8_0 quantization
as the draft (gguf_models.write_q8_0, served as int8: the smallest draft with SmolLM2's tokenizer this machine
has; a real pairing puts a ~100M draft before a 1-8B model), each with EngineConfig's k and step-token cap.
Measured, alternating the engines:
1. the plain decode step's time against its rows (batch 1..64, bench/engine.py's decode_rate), the curve the
   step-token cap (`speculative_max_step_tokens`) is read from: past it a step's time grows with its rows;
2. the input-grounded workload: data/speculative_prompts.json's 12 chat prompts (rewrites, extractions, code
   edits, written for the project) through the chat template, greedy, in waves of 1, 4 and 16 requests at once
   (wall time until the last one ends): tokens/s for each method, proposals and acceptances;
3. the multi-adapter workload (bench/multi_lora.py's (b): 256 requests over 64 adapters), where speculation should
   switch itself off (large steps).
Targets (issue 25, prompt lookup): batch 1 >= 1.5x; the multi-adapter workload no more than 5% slower. The
draft's ratios are reported (its pay-off depends on the pairing: here the draft costs ~0.76 of the model a pass).

Run: PYTHONPATH=server:operator .venv/bin/python bench/speculative.py [--quick] [--rounds 2]
     [--out bench/out/speculative.json]
Prints one JSON object, writes it to --out and draws the plot next to it (.png).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
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
from loraplane_server.platforms.user_cache import cache_root
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.store.builtin import resolve_model
from loraplane_server.store.gguf_models import find_gguf, write_q8_0

TARGET_BATCH1 = 1.5
TARGET_MULTI_ADAPTER = 0.95
GROUNDED_BATCHES = (1, 4, 16)
STEP_ROWS = (1, 2, 4, 8, 16, 32, 64)
# draft_always: the same draft told it costs nothing (draft_cost_ratio 0), on every step it can be: what the
# draft path gives where it runs, against what the gate makes of it (grounded prompts only)
MODES = ("off", "ngram", "draft", "draft_always")
GROUNDED_ONLY = ("draft_always",)
PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.json"


def q8_0_draft() -> Path:
    """The built-in model's Q8_0 GGUF, written once into the user cache (the model cache converts it once)."""
    path = cache_root() / "bench" / "smollm2-135m.Q8_0.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_q8_0(find_gguf("smollm2-135m"), path.with_suffix(".part"))
        path.with_suffix(".part").rename(path)
    return path


def make_engine(mode: str, w: Workload, tmp: Path, threads: int | None) -> LLMEngine:
    """The multi-adapter workload's engine (every adapter a device slot) with speculation `mode` (the same KV
    bytes for each: the draft's engine shares them between both models' K/V)."""
    config = engine_config(replace(w, max_loras=w.num_adapters), tmp, mode, 1 << 30)
    if mode.startswith("draft"):
        cost = 0.0 if mode == "draft_always" else None
        config = replace(config, speculative="draft", draft_model=str(q8_0_draft()), draft_cost_ratio=cost)
    else:
        config = replace(config, speculative=mode)
    return LLMEngine(replace(config, num_threads=threads))


def grounded_prompts(engine: LLMEngine) -> list[list[int]]:
    items = json.loads(PROMPTS.read_text())["prompts"]
    tok = engine.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False)
        for p in items
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def run_grounded(engine: LLMEngine, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    """Every prompt (at least `batch` requests, the prompts in turn) in waves of `batch` requests at once, greedy,
    up to new_tokens each; tokens/s over the wall time."""
    before = engine.speculator.proposed_total, engine.speculator.accepted_total
    num = -(-max(batch, len(prompts)) // batch) * batch
    start, steps, generated = time.perf_counter(), 0, 0
    for wave in range(0, num, batch):
        for i in range(wave, wave + batch):
            engine.add_request(prompts[i % len(prompts)], SamplingParams(max_new_tokens=new_tokens))
        while engine.has_unfinished:
            generated += sum(len(o.delta_token_ids) for o in engine.step())
            steps += 1
    elapsed = time.perf_counter() - start
    proposed = engine.speculator.proposed_total - before[0]
    accepted = engine.speculator.accepted_total - before[1]
    return {
        "tokens_per_s": round(generated / elapsed, 2),
        "requests": num,
        "generated_tokens": generated,
        "steps": steps,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": round(accepted / proposed, 3) if proposed else None,
        "tokens_per_step_per_request": round(generated / max(1, steps) / batch, 3),
    }


def step_times(engine: LLMEngine, pool: list[int], ew: EngineWorkload) -> dict[int, float]:
    """Milliseconds per plain decode step by rows."""
    out = {}
    for rows in STEP_ROWS:
        r = decode_rate(engine, pool, rows, ew)
        out[rows] = round(1000 * r["seconds"] / max(1, r["decode_tokens"] / rows), 2)
    return out


def measure(engines: dict[str, LLMEngine], w: Workload, ew: EngineWorkload, rounds: int, new_tokens: int) -> dict:
    prompts = grounded_prompts(engines["off"])
    pool = token_pool(engines["off"])
    raw: dict[str, dict[str, list[dict]]] = {m: {} for m in engines}
    steps: list[dict[int, float]] = []
    for r in range(rounds):
        steps.append(step_times(engines["off"], pool, replace(ew, seed=ew.seed + r)))
        for b in GROUNDED_BATCHES:
            for mode, engine in engines.items():
                raw[mode].setdefault(f"grounded_b{b}", []).append(run_grounded(engine, prompts, b, new_tokens))
        for mode, engine in engines.items():
            if mode in GROUNDED_ONLY:
                continue
            reqs = make_requests(pool, w, f"spec-{r}", True)
            before, preempted = engine.speculator.proposed_total, engine.scheduler.num_preemptions
            result = run_ours(engine, reqs)
            result["proposed"] = engine.speculator.proposed_total - before
            result["preemptions"] = engine.scheduler.num_preemptions - preempted
            raw[mode].setdefault("multi_adapter", []).append(result)
    systems = {
        mode: {
            name: {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
                "runs": runs,
            }
            for name, runs in by.items()
        }
        for mode, by in raw.items()
    }
    step_ms = {rows: statistics.median(s[rows] for s in steps) for rows in STEP_ROWS}
    return {"systems": systems, "decode_step_ms_by_rows": step_ms}


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    names = [f"grounded_b{b}" for b in GROUNDED_BATCHES] + ["multi_adapter"]
    labels = [f"grounded\nbatch {b}" for b in GROUNDED_BATCHES] + ["256 requests\n64 adapters"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(names))
    width = 0.8 / len(MODES)
    labels_of = {"draft": "draft (own Q8_0), gated", "draft_always": "draft (own Q8_0), always"}
    for i, mode in enumerate(MODES):
        rates = [result["systems"][mode].get(n, {}).get("tokens_per_s", 0.0) for n in names]
        offset = (i - (len(MODES) - 1) / 2) * width
        axes[0].bar([k + offset for k in x], rates, width=width, label=labels_of.get(mode, f"speculative {mode}"))
    axes[0].set_xticks(list(x), labels, fontsize=8)
    axes[0].set_ylabel("tokens/s")
    axes[0].legend()
    axes[0].set_title("throughput")
    ms = result["decode_step_ms_by_rows"]
    rows = sorted(int(r) for r in ms)
    axes[1].plot(rows, [ms[r] / r for r in rows], marker="o")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("rows in the step")
    axes[1].set_ylabel("ms per row")
    axes[1].set_title("plain decode step: time per row")
    fig.suptitle(f"{result['machine'].get('cpu', '')}, kernels for {result['machine'].get('kernel_isa')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def run(w: Workload, ew: EngineWorkload, rounds: int, new_tokens: int, threads: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="loraplane-spec-") as tmp_name:
        tmp = Path(tmp_name)
        template = make_template(resolve_model("smollm2-135m"), tmp / "template")
        paths = write_variants(template, tmp / "adapters", w.num_adapters, w.seed)
        engines = {m: make_engine(m, w, tmp, threads) for m in MODES}
        for engine in engines.values():
            warm_adapters(engine, paths, [adapter_id(i) for i in range(w.num_adapters)])
            decode_rate(engine, token_pool(engine), 2, replace(ew, decode_new_tokens=4))  # warm-up
        with torch.inference_mode():
            result = measure(engines, w, ew, rounds, new_tokens)
        rate = {mode: {n: x["tokens_per_s"] for n, x in by.items()} for mode, by in result["systems"].items()}
        ratios = {mode: {n: round(rate[mode][n] / rate["off"][n], 3) for n in rate[mode]} for mode in MODES[1:]}
        engine = engines["draft"]
        cfg = engine.config
        return {
            "machine": machine(dtype=engine.dtype, engine=engine.describe()),
            "config": {
                "multi_adapter": w.__dict__,
                "decode": ew.__dict__,
                "rounds": rounds,
                "grounded_new_tokens": new_tokens,
                "speculative_k": cfg.speculative_k,
                "speculative_max_step_tokens": cfg.speculative_max_step_tokens,
                "draft_model": "the built-in model's Q8_0 (gguf_models.write_q8_0), served as int8",
                "kv_blocks": {mode: e.block_manager.num_blocks for mode, e in engines.items()},
            },
            **result,
            "ratios_over_off": ratios,
            "targets": {
                "ngram_grounded_batch1": target(ratios["ngram"]["grounded_b1"], TARGET_BATCH1, True),
                "ngram_multi_adapter": target(ratios["ngram"]["multi_adapter"], TARGET_MULTI_ADAPTER, True),
                "draft_multi_adapter": target(ratios["draft"]["multi_adapter"], TARGET_MULTI_ADAPTER, True),
            },
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "speculative.json")
    parser.add_argument("--quick", action="store_true", help="a reduced workload for a smoke check")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=160, help="most new tokens of a grounded request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    w = QUICK if args.quick else Workload()
    ew = EngineWorkload(decode_new_tokens=16 if args.quick else 32)
    write_result(run(w, ew, args.rounds, args.new_tokens, args.threads), args.out, plot)


if __name__ == "__main__":
    main()
