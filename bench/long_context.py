"""Long context on a Gemma-3-shaped model: what its sliding layers save in KV bytes and decode time.

Gemma 3 attends the last 512 (1B) or 1,024 (4B up) positions on five layers of every six, and the whole context
on the sixth. The engine keeps the sliding layers' K/V in a pool of its own that releases what the window has
passed (engine/kv_groups.py), and their attention reads the window alone. This builds a random-weight model of
Gemma 3 1B's widths (hidden 1,152, 4 heads of 256 over 1 KV head, MLP 6,912, window 512) with one period of its
layer pattern by default (five local layers and a global one: the bytes' ratio is the full model's, the
run is short), the built-in tokenizer's vocabulary (49,152 rows; no tokenizer is needed, the prompts are ids),
and runs one request at each context length twice in the same run: as Gemma 3 (windows) and with every layer
global (the same weights, sliding_window removed). For each: prefill seconds, decode tokens/s over the last
tokens, and the KV bytes the request holds at the end against what the window's arithmetic predicts
(global layers x context + sliding layers x (window + step), block-aligned).

Run: .venv/bin/python bench/long_context.py [--contexts 8192 32768] [--layers 6] [--out bench/out/long_context.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when run as a script

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import Sequence

GEMMA3_1B = dict(  # google/gemma-3-1b-pt's config.json, the vocabulary and depth aside
    model_type="gemma3_text",
    architectures=["Gemma3ForCausalLM"],
    hidden_size=1152,
    intermediate_size=6912,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    vocab_size=49152,
    hidden_activation="gelu_pytorch_tanh",
)
BLOCK, STEP = 16, 512  # the engine's block size and prefill chunk (max_num_batched_tokens)


def write_model(path: Path, layers: int, window: bool) -> Path:
    """A random Gemma 3 of GEMMA3_1B's widths (seeded: the windowed and global twins share every weight)."""
    import transformers

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    if not window:
        types = ["full_attention"] * layers
    config = transformers.Gemma3TextConfig(**GEMMA3_1B, num_hidden_layers=layers, layer_types=types)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def held_bytes(engine: LLMEngine, seq: Sequence) -> int:
    """The KV bytes seq holds: its global blocks and, with a window pool, the sliding layers' unreleased ones."""
    pools = engine.runner.kv_pools
    per_block = [p[:, :, 0].numel() * p.element_size() for p in pools]  # [layers, 2, B, KVH, D] of one block
    held = (len(seq.block_table) - seq.num_released_blocks) * per_block[0]
    if len(pools) > 1:
        held += (len(seq.window_table) - seq.window_released) * per_block[1]
    return held


def predicted_bytes(layers: int, context: int, window: bool) -> int:
    """Global layers x the context, sliding layers x what the window and a step span, in whole blocks."""
    per_layer_block = 2 * BLOCK * GEMMA3_1B["num_key_value_heads"] * GEMMA3_1B["head_dim"] * 2  # bf16
    num_global = layers // 6 if window else layers
    blocks = -(-context // BLOCK)
    # a decode step's window: positions context - W + 1 .. context, block-aligned
    window_blocks = min(blocks, -(-(GEMMA3_1B["sliding_window"] - 1) // BLOCK) + 1)
    return (num_global * blocks + (layers - num_global) * window_blocks) * per_layer_block


def run_one(model_dir: Path, context: int, decode: int, kv_bytes: int) -> tuple[dict, LLMEngine, Sequence]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            block_size=BLOCK,
            max_num_batched_tokens=STEP,
            max_num_seqs=4,
            kv_cache_bytes=kv_bytes,
            enable_prefix_caching=False,
        )
    )
    prompt = [random.Random(context).randrange(1000, 40000) for _ in range(context - decode)]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=decode, ignore_eos=True))
    seq = engine.requests[rid]
    start = time.perf_counter()
    while seq.num_output_tokens == 0:
        engine.step()
    prefill_s = time.perf_counter() - start
    first = seq.num_output_tokens
    start = time.perf_counter()
    held = 0
    while not seq.is_finished:
        held = max(held, held_bytes(engine, seq))
        engine.step()
    decode_s = time.perf_counter() - start
    record = {
        "prefill_s": round(prefill_s, 2),
        "prefill_tokens_per_s": round(len(prompt) / prefill_s, 1),
        "decode_tokens_per_s": round((decode - first) / decode_s, 2),
        "kv_bytes_held": held,
        "kv_mib_held": round(held / 2**20, 1),
        "attention": engine.attention_backend,
    }
    return record, engine, seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=6, help="a multiple of 6 keeps Gemma 3's 5:1 pattern")
    parser.add_argument("--decode", type=int, default=32, help="tokens generated after the prompt")
    parser.add_argument("--out", type=Path, default=Path("bench/out/long_context.json"))
    args = parser.parse_args()
    results: dict = {"machine": machine(torch.bfloat16), "shape": {**GEMMA3_1B, "num_hidden_layers": args.layers}}
    results["block_size"], results["max_num_batched_tokens"] = BLOCK, STEP
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {w: write_model(Path(tmp) / ("window" if w else "global"), args.layers, w) for w in (True, False)}
        for context in args.contexts:
            kv_bytes = 2 * predicted_bytes(args.layers, context, False) + (64 << 20)  # room for the global twin
            row: dict = {"context": context}
            for window in (True, False):
                record, _, _ = run_one(dirs[window], context, args.decode, kv_bytes)
                record["kv_bytes_predicted"] = predicted_bytes(args.layers, context, window)
                row["gemma3" if window else "every_layer_global"] = record
                print(context, "window" if window else "global", record, flush=True)
            w, g = row["gemma3"], row["every_layer_global"]
            row["kv_bytes_ratio"] = round(w["kv_bytes_held"] / g["kv_bytes_held"], 3)
            row["decode_speedup"] = round(w["decode_tokens_per_s"] / g["decode_tokens_per_s"], 2)
            row["prefill_speedup"] = round(g["prefill_s"] / w["prefill_s"], 2)
            runs.append(row)
    results["runs"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
