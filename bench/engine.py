"""Engine benchmark: our LLMEngine against Hugging Face `generate`, same model, dtype and workload.

Measures, in one run:
1. throughput: N requests with random prompts (20..400 tokens, real vocab, no special tokens) and
   random output lengths (16..256), greedy, ignore_eos. Ours: add all, step until done. Baseline:
   transformers `generate` in static batches of max_num_seqs, left padded, run to the batch's
   longest output; only each request's own output length counts as useful tokens. When the engine
   attends through a kernel, the same workload (other prompt tokens, so no prefix-cache hits) runs
   again on its torch attention path (gather + SDPA), to show what the kernel is worth.
2. decode tokens/s at several batch sizes (32-token prompts, 128 new tokens), timing only the
   steps after every request has its first token.
3. TTFT with a 1,000-token system prompt: uncached (a system prompt never seen before) against
   cached (same system prompt as the previous request, different user suffix); medians.

Run: .venv/bin/python bench/engine.py [--num-requests 64] [--out bench/out/engine.json] [--quick]
Prints one JSON object and writes it to --out; draws bench/out/engine.png when matplotlib exists.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import greedy, hf_static_batch, machine, pyplot, token_pool, write_result  # bench/ is on sys.path
from transformers import AutoModelForCausalLM

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.attention import TorchAttention

TARGET_THROUGHPUT_RATIO = 3.0  # ours / hf, useful tokens per second
TARGET_TTFT_RATIO = 0.25  # cached / uncached
HFModel = Any  # a transformers causal LM; its generate() has no usable static type


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    prompt_lens: tuple[int, int] = (20, 400)
    output_lens: tuple[int, int] = (16, 256)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    decode_prompt_len: int = 32
    decode_new_tokens: int = 128
    system_prompt_len: int = 1000
    suffix_len: int = 16
    ttft_repeats: int = 5
    seed: int = 0


QUICK = Workload(16, (20, 100), (8, 32), (1, 8), 32, 32, 1000, 16, 2)


def make_requests(pool: list[int], w: Workload) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(w.seed)
    prompts = [rng.choices(pool, k=rng.randint(*w.prompt_lens)) for _ in range(w.num_requests)]
    outputs = [rng.randint(*w.output_lens) for _ in range(w.num_requests)]
    return prompts, outputs


def run_ours(engine: LLMEngine, prompts: list[list[int]], outputs: list[int]) -> dict:
    """Add every request, step until done; tokens/s over the whole wall time."""
    start = time.perf_counter()
    for prompt, n in zip(prompts, outputs, strict=True):
        engine.add_request(prompt, greedy(n))
    generated = 0
    while engine.has_unfinished:
        generated += sum(len(o.delta_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    assert generated == sum(outputs), f"generated {generated}, expected {sum(outputs)}"
    return rates(elapsed, generated, sum(map(len, prompts)))


def rates(elapsed: float, generated: int, num_prompt_tokens: int) -> dict:
    return {
        "seconds": round(elapsed, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / elapsed, 2),
        "total_tokens_per_s": round((generated + num_prompt_tokens) / elapsed, 2),
    }


def run_hf(model: HFModel, prompts: list[list[int]], outputs: list[int], batch: int, pad_id: int) -> dict:
    """Static batches of `batch` requests; useful tokens are each request's own output length."""
    start = time.perf_counter()
    computed = 0
    for i in range(0, len(prompts), batch):
        lens = outputs[i : i + batch]
        num_new = hf_static_batch(model, prompts[i : i + batch], max(lens), pad_id)
        assert num_new == max(lens), f"hf generated {num_new} tokens, expected {max(lens)}"
        computed += num_new * len(lens)
    elapsed = time.perf_counter() - start
    result = rates(elapsed, sum(outputs), sum(map(len, prompts)))
    result["computed_tokens"] = computed  # including padding past each request's own length
    return result


def load_hf(engine: LLMEngine) -> tuple[HFModel, int]:
    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.dtype).eval()
    tok = engine.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model, pad_id


def decode_rate(engine: LLMEngine, pool: list[int], batch: int, w: Workload) -> dict:
    """Time only the steps after every request has produced its first token."""
    rng = random.Random(f"decode-{w.seed}-{batch}")
    rids = {
        engine.add_request(rng.choices(pool, k=w.decode_prompt_len), greedy(w.decode_new_tokens)) for _ in range(batch)
    }
    started: set[str] = set()
    elapsed, tokens = 0.0, 0
    while engine.has_unfinished:
        is_decoding = started == rids
        t0 = time.perf_counter()
        outs = engine.step()
        if is_decoding:
            elapsed += time.perf_counter() - t0
            tokens += sum(len(o.delta_token_ids) for o in outs)
        started |= {o.request_id for o in outs if o.delta_token_ids}
    return {
        "batch": batch,
        "decode_tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2),
    }


def ttft_once(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token, and how many prompt tokens came from the cache."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, greedy(1))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.delta_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished:
                    engine.step()
                return elapsed, out.num_cached_tokens


def measure_ttft(engine: LLMEngine, pool: list[int], w: Workload) -> dict:
    """Each repeat: a new system prompt (uncached), then the same one with another suffix (cached)."""
    rng = random.Random(f"ttft-{w.seed}")
    uncached, cached, hits = [], [], []
    for _ in range(w.ttft_repeats):
        system = rng.choices(pool, k=w.system_prompt_len)
        t_miss, miss_hits = ttft_once(engine, system + rng.choices(pool, k=w.suffix_len))
        t_hit, num_hits = ttft_once(engine, system + rng.choices(pool, k=w.suffix_len))
        assert miss_hits == 0, f"the uncached request hit {miss_hits} cached tokens"
        uncached.append(t_miss)
        cached.append(t_hit)
        hits.append(num_hits)
    med_miss, med_hit = statistics.median(uncached), statistics.median(cached)
    return {
        "uncached_ms": round(1000 * med_miss, 2),
        "cached_ms": round(1000 * med_hit, 2),
        "ratio_cached_over_uncached": round(med_hit / med_miss, 4),
        "cached_prompt_tokens": hits,
        "prompt_tokens": w.system_prompt_len + w.suffix_len,
    }


def warm_up(engine: LLMEngine, model: HFModel, pool: list[int], pad_id: int) -> None:
    """One small run each, so neither side pays first-call costs inside a measurement."""
    prompts = [pool[:24], pool[100:140]]
    engine.generate(prompts, greedy(4))
    hf_static_batch(model, prompts, 4, pad_id)


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    tp = result["throughput"]
    axes[0].bar(["loraplane", "hf generate"], [tp["ours"]["tokens_per_s"], tp["hf"]["tokens_per_s"]])
    axes[0].set_title(f"useful tokens/s ({tp['ratio_ours_over_hf']}x)")
    dec = result["decode"]
    axes[1].plot([d["batch"] for d in dec], [d["tokens_per_s"] for d in dec], marker="o")
    axes[1].set(title="decode tokens/s", xlabel="batch", xscale="log", xticks=[d["batch"] for d in dec])
    axes[1].set_xticklabels([str(d["batch"]) for d in dec])
    ttft = result["ttft"]
    axes[2].bar(["uncached", "cached"], [ttft["uncached_ms"], ttft["cached_ms"]])
    axes[2].set_title(f"TTFT ms, {ttft['prompt_tokens']}-token prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def measure_throughput(engine: LLMEngine, pool: list[int], w: Workload) -> dict:
    """Ours, then transformers generate on the same requests; the HF model is dropped afterwards."""
    model, pad_id = load_hf(engine)
    prompts, outputs = make_requests(pool, w)
    warm_up(engine, model, pool, pad_id)
    ours = run_ours(engine, prompts, outputs)
    result = {"ours": ours}
    if engine.attention_backend != "torch":  # the same engine on its torch attention path (gather + SDPA)
        kernel = engine.runner.backends
        torch_attention = TorchAttention(kernel.attention.kernel_kv_write)
        engine.runner.use_backends(replace(kernel, attention=torch_attention))
        # same lengths, other tokens: nothing may hit the prefix cache the first run filled
        where = {t: i for i, t in enumerate(pool)}
        fresh = [[pool[(where[t] * 7 + 13) % len(pool)] for t in p] for p in prompts]
        result["ours_torch_attention"] = run_ours(engine, fresh, outputs)
        engine.runner.use_backends(kernel)
        speedup = ours["tokens_per_s"] / result["ours_torch_attention"]["tokens_per_s"]
        result["ratio_kernel_over_torch_attention"] = round(speedup, 3)
    hf = run_hf(model, prompts, outputs, engine.config.max_num_seqs, pad_id)
    result.update(hf=hf, ratio_ours_over_hf=round(ours["tokens_per_s"] / hf["tokens_per_s"], 3))
    return result


def target(value: float, bound: float, at_least: bool) -> dict:
    met = value >= bound if at_least else value <= bound
    return {"target": f"{'>=' if at_least else '<='} {bound}", "value": value, "met": met}


def run(w: Workload, attention_backend: str = "auto") -> dict:
    config = EngineConfig(
        model="smollm2-135m",
        dtype="auto",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        attention_backend=attention_backend,
    )
    engine = LLMEngine(config)
    pool = token_pool(engine)
    with torch.inference_mode():
        throughput = measure_throughput(engine, pool, w)
        decode = [decode_rate(engine, pool, b, w) for b in w.decode_batches]
        ttft = measure_ttft(engine, pool, w)
    return {
        "machine": machine(engine.dtype),
        "config": {
            "engine": asdict(config),
            "attention_backend": engine.attention_backend,
            "workload": asdict(w),
            "hf_batch_size": config.max_num_seqs,
        },
        "throughput": throughput,
        "decode": decode,
        "ttft": ttft,
        "targets": {
            "throughput_ratio": target(throughput["ratio_ours_over_hf"], TARGET_THROUGHPUT_RATIO, at_least=True),
            "ttft_ratio": target(ttft["ratio_cached_over_uncached"], TARGET_TTFT_RATIO, at_least=False),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=None, help="default 64, or 16 with --quick")
    parser.add_argument("--out", type=Path, default=Path("bench/out/engine.json"))
    parser.add_argument("--quick", action="store_true", help="a reduced workload for a smoke check")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu_kernel", "triton"])
    args = parser.parse_args()
    w = QUICK if args.quick else Workload()
    result = run(replace(w, num_requests=args.num_requests) if args.num_requests else w, args.attention_backend)
    write_result(result, args.out, plot)


if __name__ == "__main__":
    main()
