"""The `loraplane` command line."""

from __future__ import annotations

import argparse
import sys
import time

from loraplane_server.config import EngineConfig
from loraplane_server.sampling_params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="built-in model name or a Hugging Face model directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        dtype=a.dtype,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_bytes=int(a.kv_cache_gib * 2**30),
    )


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed
    )


def cmd_chat(a: argparse.Namespace) -> int:
    """Chat with the model: one answer for --prompt, else a prompt loop on stdin."""
    from loraplane_server.engine import LLMEngine

    engine = LLMEngine(_config(a))
    history: list[dict[str, str]] = []
    prompts = [a.prompt] if a.prompt else None
    print(f"loraplane: {a.model} ({engine.dtype}), {engine.block_manager.num_blocks} KV blocks", file=sys.stderr)
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            user = prompts.pop()
        else:
            try:
                user = input("you> ")
            except EOFError:
                return 0
        history.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        start = time.monotonic()
        out = engine.generate([text], _params(a))[0]
        history.append({"role": "assistant", "content": out.text})
        print(out.text)
        rate = len(out.token_ids) / (time.monotonic() - start)
        print(f"[{len(out.token_ids)} tokens, {rate:.1f} tokens/s, {out.finish_reason}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--prompt", help="answer this one message and exit")
    chat.set_defaults(func=cmd_chat)
    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
