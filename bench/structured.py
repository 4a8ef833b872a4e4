"""Structured output benchmark (issue 38): the multi-adapter workload with every request constrained to a JSON
schema, against the same workload unconstrained, same engine, same run. The workload is bench/multi_lora.py's (b):
256 requests over 64 random rank-8 adapters, random real-token prompts of 20..200 tokens, output caps of 16..128
tokens, all submitted at once (max_num_seqs = 64, adapters hot), on the built-in SmolLM2-135M in the engine's dtype
for this CPU; each prompt a chat request for JSON of about its length (the template around its random tokens,
"Describe the text above as JSON." at the end: on bare random tokens the model fills every place the JSON grammar
allows whitespace, which shows nothing of a real request's masks). Constrained: request i follows schema i % 16 of a
seeded generator (objects of 2-5 fields: bounded strings and numbers, enums, booleans, arrays with bounds, a nested
object), greedy, capped at its workload length (its grammar ends it earlier when complete). Unconstrained: the same
lengths, adapters and caps, greedy, ignore_eos, each request exactly as many tokens as its constrained twin made, so
both sides generate the same tokens (the prompts' contents differ: no prefix-cache hit on the first side's prompts).
A cold round (every schema compiled as its requests are added; each schema's compile time is reported too), then
--repeats warm rounds (the grammars cached), each with fresh prompt contents; medians. The masks' cost per step:
what the worker thread spent filling them (overlapping the forward pass), what the step waited for them past the
forward, and applying them, against the step's time.
Target: constrained >= 0.85x unconstrained useful tokens/s (warm).

Run: .venv/bin/python bench/structured.py [--quick] [--repeats 3] [--threads N] [--out bench/out/structured.json]
Prints one JSON object, writes it to --out and draws the plot next to it (.png).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from common import greedy, machine, pyplot, token_pool, write_result  # bench/ is on sys.path
from multi_lora import (
    QUICK,
    Requests,
    Workload,
    make_requests,
    make_template,
    target,
    throughput_engine,
    write_variants,
)

from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.sampling_params import SamplingParams, StructuredOutput
from loraplane_server.store.builtin import resolve_model

TARGET_CONSTRAINED_VS_FREE = 0.85  # constrained / unconstrained useful tokens/s
NUM_SCHEMAS = 16
FIELDS = ["name", "city", "score", "tags", "level", "color", "size", "id", "note", "kind", "count", "age"]


# schemas
def field_schema(rng: random.Random, nested: bool) -> dict:
    r = rng.random()
    if nested and r < 0.15:
        return object_schema(rng, 3, nested=False)
    if r < 0.35:
        return {"type": "string", "maxLength": rng.randint(4, 24)}
    if r < 0.5:
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(10, 10_000)}
    if r < 0.6:
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1000])}
    if r < 0.7:
        return {"type": "boolean"}
    if r < 0.85:
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "none", "other"], rng.randint(2, 5))}
    items = {"type": "string", "maxLength": 12} if rng.random() < 0.5 else {"type": "integer"}
    return {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(2, 5)}


def object_schema(rng: random.Random, max_fields: int, nested: bool = True) -> dict:
    names = rng.sample(FIELDS, rng.randint(2, max_fields))
    return {
        "type": "object",
        "properties": {name: field_schema(rng, nested) for name in names},
        "required": sorted(rng.sample(names, rng.randint(1, len(names)))),
        "additionalProperties": False,
    }


def schemas(seed: int) -> list[str]:
    rng = random.Random(f"schemas-{seed}")
    return [json.dumps(object_schema(rng, 5)) for _ in range(NUM_SCHEMAS)]


# one side of a round
def run_side(engine: LLMEngine, reqs: Requests, params: list[SamplingParams]) -> dict:
    """Submit every request at once (compiling any grammar not cached), step until done."""
    matchers = engine.runner.matchers
    before = (matchers.fill_seconds, matchers.wait_seconds, matchers.apply_seconds, matchers.fill_rows)
    start = time.perf_counter()
    ids = [
        engine.add_request(prompt, p, adapter_id=adapter)
        for prompt, p, adapter in zip(reqs.prompts, params, reqs.adapters, strict=True)
    ]
    added = time.perf_counter()
    done, steps = {}, 0
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
        steps += 1
    elapsed = time.perf_counter() - start
    outs = [done[i] for i in ids]
    generated = sum(len(o.token_ids) for o in outs)
    fill, wait, apply, rows = (
        now - then
        for now, then in zip(
            (matchers.fill_seconds, matchers.wait_seconds, matchers.apply_seconds, matchers.fill_rows),
            before,
            strict=True,
        )
    )
    return {
        "seconds": round(elapsed, 3),
        "add_seconds": round(added - start, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / elapsed, 2),
        "steps": steps,
        "step_ms": round(1000 * elapsed / steps, 2),
        "mask_fill_ms_per_step": round(1000 * fill / steps, 3),
        "mask_wait_ms_per_step": round(1000 * wait / steps, 3),
        "mask_apply_ms_per_step": round(1000 * apply / steps, 3),
        "mask_rows_per_step": round(rows / steps, 1),
        "finished_by_grammar": sum(o.finish_reason == "stop" for o in outs),
        "lengths": [len(o.token_ids) for o in outs],
        "texts_sample": [o.text for o in outs[:3]],
    }


def constrained_params(reqs: Requests, texts: list[str]) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=n, structured=StructuredOutput("json_schema", texts[i % len(texts)]))
        for i, n in enumerate(reqs.outputs)
    ]


def asking_for_json(engine: LLMEngine, reqs: Requests) -> Requests:
    """The workload's requests with each prompt a chat request for JSON of about its length: the chat template's
    head, the workload's random tokens (its length less the template's, at least 4), then the ask."""
    template = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "\x00"}], add_generation_prompt=True, tokenize=False
    )
    before, after = template.split("\x00")
    head = engine.tokenizer.encode(before, add_special_tokens=False)
    tail = engine.tokenizer.encode("\n\nDescribe the text above as JSON." + after, add_special_tokens=False)
    prompts = [head + p[: max(4, len(p) - len(head) - len(tail))] + tail for p in reqs.prompts]
    return Requests(prompts, reqs.outputs, reqs.adapters)


def run_round(engine: LLMEngine, w: Workload, texts: list[str], name: str) -> dict:
    """The constrained side, then the unconstrained side on other prompt contents of the same lengths (no prefix
    cache hit on the first side's prompts), each request as many tokens as its constrained twin made."""
    pool = token_pool(engine)
    reqs = asking_for_json(engine, make_requests(pool, w, f"{name}-constrained"))
    constrained = run_side(engine, reqs, constrained_params(reqs, texts))
    twins = asking_for_json(engine, make_requests(pool, w, f"{name}-free"))
    free = run_side(engine, twins, [greedy(n) for n in constrained["lengths"]])
    assert constrained["generated_tokens"] == free["generated_tokens"]
    ratio = constrained["tokens_per_s"] / free["tokens_per_s"]
    return {"constrained": constrained, "unconstrained": free, "constrained_over_unconstrained": round(ratio, 4)}


def compile_times(engine: LLMEngine, texts: list[str]) -> list[float]:
    """Each schema's compile on its own (a fresh cache entry: what a first request waits for), seconds."""
    assert engine.grammars is not None
    seconds = []
    for text in texts:
        start = time.perf_counter()
        engine.grammars.compile(StructuredOutput("json_schema", text + " "))  # another text: not cached
        seconds.append(round(time.perf_counter() - start, 4))
    return seconds


def run(w: Workload, repeats: int, tmp: Path) -> dict:
    load_start = os.getloadavg()
    template = make_template(resolve_model("smollm2-135m"), tmp / "template")
    paths = write_variants(template, tmp / "adapters", w.num_adapters, w.seed)
    engine = throughput_engine(w, tmp, paths)
    texts = schemas(w.seed)
    with torch.inference_mode():
        cold = run_round(engine, w, texts, "cold")
        warm = [run_round(engine, w, texts, f"warm-{r}") for r in range(repeats)]
        compiles = compile_times(engine, texts)
    ratio = statistics.median(r["constrained_over_unconstrained"] for r in warm)
    steps = [r["constrained"] for r in warm]
    mask = {
        key: statistics.median(s[key] for s in steps)
        for key in ("step_ms", "mask_fill_ms_per_step", "mask_wait_ms_per_step", "mask_apply_ms_per_step")
    }
    mask["fill_share_of_step"] = round(mask["mask_fill_ms_per_step"] / mask["step_ms"], 4)
    exposed = mask["mask_wait_ms_per_step"] + mask["mask_apply_ms_per_step"]
    mask["exposed_share_of_step"] = round(exposed / mask["step_ms"], 4)
    return {
        "machine": machine(
            engine.dtype,
            xgrammar=importlib.metadata.version("xgrammar"),
            load_average={"start": load_start, "end": os.getloadavg()},
        ),
        "config": {
            "workload": asdict(w),
            "repeats": repeats,
            "num_schemas": NUM_SCHEMAS,
            "engine": asdict(engine.config),
        },
        "schemas_sample": [json.loads(t) for t in texts[:2]],
        "compile_seconds": {"each": compiles, "median": statistics.median(compiles), "max": max(compiles)},
        "cold_round": cold,
        "warm_rounds": warm,
        "constrained_over_unconstrained": ratio,
        "mask_cost": mask,
        "targets": {"constrained_vs_unconstrained": target(ratio, TARGET_CONSTRAINED_VS_FREE, at_least=True)},
    }


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rounds = [result["cold_round"], *result["warm_rounds"]]
    names = ["cold", *(f"warm {i}" for i in range(len(result["warm_rounds"])))]
    x = range(len(rounds))
    axes[0].bar([i - 0.2 for i in x], [r["unconstrained"]["tokens_per_s"] for r in rounds], 0.4, label="free text")
    axes[0].bar([i + 0.2 for i in x], [r["constrained"]["tokens_per_s"] for r in rounds], 0.4, label="JSON schema")
    axes[0].set_xticks(list(x), names)
    axes[0].set_title(f"useful tokens/s ({result['constrained_over_unconstrained']}x warm, median)")
    axes[0].legend()
    m = result["mask_cost"]
    keys = ["step_ms", "mask_fill_ms_per_step", "mask_wait_ms_per_step", "mask_apply_ms_per_step"]
    axes[1].bar(["step", "fill (worker)", "waited", "apply"], [m[k] for k in keys])
    axes[1].set_title("ms per constrained step (median of warm rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/structured.json"))
    parser.add_argument("--quick", action="store_true", help="a reduced workload for a smoke check")
    parser.add_argument("--repeats", type=int, default=None, help="warm rounds (default 3, --quick 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    w = replace(QUICK, num_requests=48) if args.quick else Workload()
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        result = run(w, repeats, Path(tmp))
    write_result(result, args.out, plot)


if __name__ == "__main__":
    main()
