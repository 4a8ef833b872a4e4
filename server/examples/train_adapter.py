"""Train one example PEFT LoRA adapter for the built-in SmolLM2-135M-Instruct, on CPU, in minutes.

    python server/examples/train_adapter.py french            # train with the preset for `french`
    python server/examples/train_adapter.py french --eval     # greedy answers, base vs adapter

Reads server/examples/data/NAME.jsonl ({"prompt", "response"} per line), formats each example with
the tokenizer's chat template (user prompt -> assistant response), trains on the response tokens
only and writes adapter_config.json + adapter_model.safetensors (float16) to adapters/NAME/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from loraplane_server.store.builtin import resolve_model

EXAMPLES_DIR = Path(__file__).resolve().parent
BASE_MODEL = "smollm2-135m"
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRESETS: dict[str, dict] = {
    "french": {"rank": 8, "alpha": 16.0, "targets": ("q_proj", "v_proj"), "epochs": 5, "lr": 2e-3, "rslora": False},
    "pirate": {"rank": 2, "alpha": 4.0, "targets": ALL_TARGETS, "epochs": 3, "lr": 2e-3, "rslora": False},
    "json": {"rank": 4, "alpha": 8.0, "targets": ALL_TARGETS[:4], "epochs": 3, "lr": 1e-3, "rslora": True},
}
HELD_OUT = (
    "What is the capital of Italy?",
    "How do I boil an egg?",
    "Why do leaves change color in autumn?",
    "What is 9 plus 6?",
    "Give me a tip for learning a new language.",
)


@dataclass(frozen=True)
class TrainConfig:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    epochs: int
    lr: float
    rslora: bool
    batch_size: int = 8
    max_len: int = 128
    seed: int = 0
    bf16: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(ALL_TARGETS)
        if unknown:
            raise ValueError(f"unknown targets {sorted(unknown)}; choose from {', '.join(ALL_TARGETS)}")
        if self.rank < 1 or self.epochs < 1 or self.lr <= 0:
            raise ValueError("rank and epochs must be >= 1 and lr > 0")

    @property
    def data_path(self) -> Path:
        return EXAMPLES_DIR / "data" / f"{self.name}.jsonl"

    @property
    def out_dir(self) -> Path:
        return EXAMPLES_DIR / "adapters" / self.name


@dataclass
class Example:
    ids: list[int]  # chat-formatted prompt + response + <|im_end|>
    num_prompt: int  # tokens before the response


# data


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def encode(tokenizer: PreTrainedTokenizerBase, row: dict[str, str], max_len: int) -> Example:
    head = prompt_ids(tokenizer, row["prompt"])
    tail = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example((head + tail)[:max_len], len(head))


def shared_prefix_len(examples: list[Example]) -> int:
    """Tokens every example starts with (the system prompt); capped so each keeps a prompt token."""
    first = examples[0].ids
    n = min(ex.num_prompt for ex in examples) - 1
    for ex in examples:
        n = next((i for i in range(n) if ex.ids[i] != first[i]), n)
    return n


def make_batches(examples: list[Example], batch_size: int, rng: random.Random) -> list[list[Example]]:
    """Shuffled batches of similar length (less padding)."""
    order = examples[:]
    rng.shuffle(order)
    chunk = batch_size * 4
    batches = []
    for i in range(0, len(order), chunk):
        group = sorted(order[i : i + chunk], key=lambda ex: len(ex.ids))
        batches += [group[j : j + batch_size] for j in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(batch: list[Example], skip: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded suffixes after the shared prefix: ids [B, S] and the loss mask on targets [B, S]."""
    width = max(len(ex.ids) for ex in batch) - skip
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    is_target = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, ex in enumerate(batch):
        suffix = ex.ids[skip:]
        ids[row, : len(suffix)] = torch.tensor(suffix)
        is_target[row, ex.num_prompt - skip : len(suffix)] = True
    return ids, is_target


# model


def load_base() -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    model_dir = str(resolve_model(BASE_MODEL))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return tokenizer, model


def add_lora(model: torch.nn.Module, cfg: TrainConfig) -> PeftModel:
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # PEFT annotates int; any float works
        target_modules=list(cfg.targets),
        lora_dropout=0.0,
        use_rslora=cfg.rslora,
    )
    return get_peft_model(model, lora)


def batch_loss(model: PeftModel, prefix: torch.Tensor, ids: torch.Tensor, is_target: torch.Tensor) -> torch.Tensor:
    """Next-token loss on the response tokens; the shared prefix runs once, without gradient."""
    causal_lm = cast(LlamaForCausalLM, model.get_base_model())
    with torch.no_grad():
        cache = causal_lm.model(input_ids=prefix, use_cache=True).past_key_values  # prefix: [1, P]
    cache.batch_repeat_interleave(ids.shape[0])
    # right padding needs no attention mask: real tokens never look at the pads after them
    hidden = causal_lm.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state  # [B, S, H]
    predicts = is_target[:, 1:]  # position t predicts token t + 1
    logits = causal_lm.lm_head(hidden[:, :-1][predicts])  # [N, V], only where there is a target
    return F.cross_entropy(logits.float(), ids[:, 1:][predicts])


def train(cfg: TrainConfig) -> None:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer, base = load_base()
    examples = [encode(tokenizer, row, cfg.max_len) for row in read_jsonl(cfg.data_path)]
    skip = shared_prefix_len(examples)
    prefix = torch.tensor([examples[0].ids[:skip]])
    model = add_lora(base, cfg)
    model.print_trainable_parameters()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    num_steps = cfg.epochs * math.ceil(len(examples) / cfg.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5) * (1 - s / num_steps))
    print(f"{cfg.name}: {len(examples)} examples, shared prefix {skip} tokens, {num_steps} steps")
    start = time.monotonic()
    model.train()
    for epoch in range(cfg.epochs):
        batches = make_batches(examples, cfg.batch_size, rng)
        losses = [train_step(model, optimizer, scheduler, prefix, b, skip, cfg) for b in batches]
        mean_loss = sum(losses) / len(losses)
        print(f"epoch {epoch + 1}/{cfg.epochs}: mean loss {mean_loss:.4f}, {time.monotonic() - start:.0f}s", flush=True)
    print(f"trained in {time.monotonic() - start:.0f}s; final epoch mean loss {mean_loss:.4f}")
    save_adapter(model, cfg.out_dir)


def train_step(
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    prefix: torch.Tensor,
    batch: list[Example],
    skip: int,
    cfg: TrainConfig,
) -> float:
    ids, is_target = collate(batch, skip, pad_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        loss = batch_loss(model, prefix, ids, is_target)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def save_adapter(model: PeftModel, out_dir: Path) -> None:
    """adapter_config.json + float16 adapter_model.safetensors; other files in out_dir are kept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
        tensors = load_file(str(Path(tmp) / "adapter_model.safetensors"))
    config["base_model_name_or_path"] = BASE_MODEL
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    half = {k: v.to(torch.float16).contiguous() for k, v in tensors.items()}
    save_file(half, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_model.safetensors").chmod(0o644)  # save_file creates it owner-only
    size = (out_dir / "adapter_model.safetensors").stat().st_size
    print(f"saved {out_dir} ({len(half)} tensors, {size / 1e6:.2f} MB)")


# eval


@torch.no_grad()
def greedy(model: PeftModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int) -> str:
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()


def evaluate(name: str, questions: list[str], max_new_tokens: int = 40) -> None:
    """Greedy answers of the base model and of the adapter (float32, HF transformers + PEFT)."""
    tokenizer, base = load_base()
    model = PeftModel.from_pretrained(base, str(EXAMPLES_DIR / "adapters" / name))
    model.eval()
    for question in questions:
        with model.disable_adapter():
            base_answer = greedy(model, tokenizer, question, max_new_tokens)
        adapter_answer = greedy(model, tokenizer, question, max_new_tokens)
        print(f"Q: {question}\n  base:    {base_answer!r}\n  {name + ':':8} {adapter_answer!r}", flush=True)


# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help=f"dataset data/NAME.jsonl and output adapters/NAME/ (presets: {', '.join(PRESETS)})")
    p.add_argument("--rank", type=int, help="LoRA rank r")
    p.add_argument("--alpha", type=float, help="lora_alpha")
    p.add_argument("--targets", help="comma-separated target modules, e.g. q_proj,v_proj")
    p.add_argument("--epochs", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate (AdamW, warmup then linear decay)")
    p.add_argument("--rslora", action=argparse.BooleanOptionalAction, default=None, help="scale alpha/sqrt(r)")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 instead of bfloat16 autocast")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--eval", action="store_true", help="print base vs adapter greedy answers, no training")
    p.add_argument("--question", action="append", help="with --eval: ask this instead of the held-out set")
    return p.parse_args(argv)


def build_config(a: argparse.Namespace) -> TrainConfig:
    preset = PRESETS.get(a.name, PRESETS["french"])
    targets = tuple(a.targets.split(",")) if a.targets else preset["targets"]
    return TrainConfig(
        name=a.name,
        rank=a.rank or preset["rank"],
        alpha=a.alpha or preset["alpha"],
        targets=targets,
        epochs=a.epochs or preset["epochs"],
        lr=a.lr or preset["lr"],
        rslora=preset["rslora"] if a.rslora is None else a.rslora,
        bf16=not a.no_bf16,
    )


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    # on a shared CPU, more than one intra-op thread spins at barriers: 1 thread ran ~8x faster here
    torch.set_num_threads(a.threads)
    if a.eval:
        evaluate(a.name, a.question or list(HELD_OUT))
        return
    cfg = build_config(a)
    print(cfg)
    train(cfg)


if __name__ == "__main__":
    main()
