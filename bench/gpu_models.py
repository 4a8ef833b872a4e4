"""What bench/gpu.py and bench/peers.py --shape build on a machine with no network, and what they compare
against: random-weight Llama-family checkpoints of real shapes (config.json + safetensors shards, the real
tokenizer files beside them), random PEFT LoRA adapters, and the transformers + PEFT reference that loads them.

The shapes' numbers are the published config.json values of each model (named in `source`); the weights are
N(0, std) (0.02, transformers' init, unless the caller asks otherwise) with norms at 1, built on the bench's
device one layer at a time and written as safetensors shards. The
tokenizer is SmolLM2's (49,152 tokens), carried in bench/data/tokenizer (`bench/gpu.py --prepare` copies it
from the built-in model): the Llama shapes keep their real vocabulary (128,256 rows), so their bytes are the real
models', and prompts use only ids below 49,152.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplane_server.adapters.weights import module_shapes
from loraplane_server.executor.models.registry import model_args

INIT_STD = 0.02  # transformers' initializer_range for all three models
SHARD_BYTES = 2 << 30
# config.json's max_position_embeddings is capped here (rope tables stay small); above llama3 rope's
# original_max_position_embeddings (8192), which transformers requires
MAX_POSITIONS = 16384
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
MAX_TOKENIZER_BYTES = 5 << 20
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EVERY_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
LLAMA3_ROPE_1B = {  # Llama 3.2's rope_scaling
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
LLAMA3_ROPE_8B = {**LLAMA3_ROPE_1B, "factor": 8.0}  # Llama 3.1's


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's shape, as its config.json gives it."""

    name: str
    source: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-5
    model_type: str = "llama"  # qwen2: q, k and v carry a bias, as Qwen2's checkpoints do

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    def config(self) -> dict:
        """config.json: the real values, max_position_embeddings capped at MAX_POSITIONS (llama3 rope's
        frequencies depend on original_max_position_embeddings, not on it), no special token ids (the
        benches ignore eos; the tokenizer is another model's)."""
        cfg: dict = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": min(self.max_position_embeddings, MAX_POSITIONS),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias,
            "mlp_bias": False,
            "initializer_range": INIT_STD,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type == "qwen2":  # Qwen2.5's: no sliding window (its config names one but turns it off)
            cfg["use_sliding_window"] = False
        return cfg

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """Each decoder projection's (in, out) features, as the engine's adapter validation reads them."""
        shapes = module_shapes(model_args(self.config()))
        return {
            name: shapes[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        }

    def num_params(self) -> int:
        dims = self.linear_dims()
        per_layer = sum(i * o for i, o in dims.values()) + 2 * self.hidden_size
        if self.qkv_bias:
            per_layer += sum(dims[name][1] for name in ("q_proj", "k_proj", "v_proj"))
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size + head + self.hidden_size

    def record(self) -> dict:
        return {**asdict(self), "params": self.num_params()}


SMOLLM2_135M = Shape(
    "smollm2-135m", "HuggingFaceTB/SmolLM2-135M config.json", 576, 1536, 30, 9, 3, 64, 49152, 100000.0, None,
    8192, True,
)  # fmt: skip
LLAMA_32_1B = Shape(
    "llama-3.2-1b", "meta-llama/Llama-3.2-1B config.json", 2048, 8192, 16, 32, 8, 64, 128256, 500000.0,
    LLAMA3_ROPE_1B, 131072, True,
)  # fmt: skip
LLAMA_31_8B = Shape(
    "llama-3.1-8b", "meta-llama/Llama-3.1-8B config.json", 4096, 14336, 32, 32, 8, 128, 128256, 500000.0,
    LLAMA3_ROPE_8B, 131072, False,
)  # fmt: skip
# the CPU record's sizes (issue 42, bench/peers.py --shape)
SMOLLM2_17B = Shape(
    "smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B config.json", 2048, 8192, 24, 32, 32, 64, 49152, 130000.0, None,
    8192, True,
)  # fmt: skip
QWEN25_3B = Shape(
    "qwen2.5-3b", "Qwen/Qwen2.5-3B config.json", 2048, 11008, 36, 16, 2, 128, 151936, 1000000.0, None, 32768, True,
    rms_norm_eps=1e-6, model_type="qwen2",
)  # fmt: skip
REAL_SHAPES = {s.name: s for s in (SMOLLM2_135M, LLAMA_32_1B, LLAMA_31_8B, SMOLLM2_17B, QWEN25_3B)}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def quick_shapes() -> dict[str, Shape]:
    """--quick: the same names and kinds (tied or not, llama3 rope, the real vocabularies), 2 layers, narrow."""
    note = "--quick: 2 layers, narrow; not the real shape"
    return {
        "smollm2-135m": replace(SMOLLM2_135M, source=note, num_layers=2),
        "llama-3.2-1b": replace(
            LLAMA_32_1B,
            source=note,
            hidden_size=256,
            intermediate_size=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
        ),  # fmt: skip
        "llama-3.1-8b": replace(
            LLAMA_31_8B,
            source=note,
            hidden_size=256,
            intermediate_size=512,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
        ),  # fmt: skip
    }


# weights
def layer_tensors(
    shape: Shape, layer: int, gen: torch.Generator, dtype: torch.dtype, std: float
) -> dict[str, torch.Tensor]:
    device = gen.device
    prefix = f"model.layers.{layer}."
    out = {
        prefix + "input_layernorm.weight": torch.ones(shape.hidden_size, dtype=dtype, device=device),
        prefix + "post_attention_layernorm.weight": torch.ones(shape.hidden_size, dtype=dtype, device=device),
    }
    for name, (n_in, n_out) in shape.linear_dims().items():
        part = "self_attn" if name in ATTENTION else "mlp"
        weight = torch.empty(n_out, n_in, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
        out[f"{prefix}{part}.{name}.weight"] = weight  # [out, in]
        if shape.qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
            bias = torch.empty(n_out, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
            out[f"{prefix}{part}.{name}.bias"] = bias
    return out


def outer_tensors(shape: Shape, gen: torch.Generator, dtype: torch.dtype, std: float) -> dict[str, torch.Tensor]:
    device = gen.device
    table = (shape.vocab_size, shape.hidden_size)
    out = {
        "model.embed_tokens.weight": torch.empty(table, dtype=dtype, device=device).normal_(0, std, generator=gen),
        "model.norm.weight": torch.ones(shape.hidden_size, dtype=dtype, device=device),
    }
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = torch.empty(table, dtype=dtype, device=device).normal_(0, std, generator=gen)
    return out


class ShardWriter:
    """Tensors to safetensors shards of about SHARD_BYTES, then model.safetensors.index.json."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.pending: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.num_shards = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update((k, v.cpu()) for k, v in tensors.items())
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.num_shards += 1
        name = f"model-{self.num_shards:05d}.safetensors"
        save_file(self.pending, str(self.out_dir / name), metadata={"format": "pt"})
        self.total_bytes += sum(t.numel() * t.element_size() for t in self.pending.values())
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.pending = {}

    def close(self) -> None:
        self.flush()
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_model(
    shape: Shape,
    out_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer_dir: Path | None,
    std: float = INIT_STD,
    seed: int = 0,
) -> dict:
    """A random checkpoint of `shape` in `dtype` (built on `device`, weights N(0, std)) with the tokenizer files;
    what was written."""
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(
        json.dumps({**shape.config(), "torch_dtype": str(dtype).removeprefix("torch.")}, indent=1)
    )
    copied = copy_tokenizer(tokenizer_dir, out_dir) if tokenizer_dir is not None else []
    gen = torch.Generator(device=device).manual_seed(seed)
    writer = ShardWriter(out_dir)
    writer.add(outer_tensors(shape, gen, dtype, std))
    for layer in range(shape.num_layers):
        writer.add(layer_tensors(shape, layer, gen, dtype, std))
    writer.close()
    return {
        "dir": str(out_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "init_std": std,
        "bytes": writer.total_bytes,
        "shards": writer.num_shards,
        "tokenizer_files": copied,
        "seconds": round(time.perf_counter() - start, 2),
    }


# tokenizer
def copy_tokenizer(src: Path, dest: Path) -> list[str]:
    """The tokenizer files present in src, copied to dest; their names. FileNotFoundError without tokenizer.json."""
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json (run bench/gpu.py --prepare on a dev machine)")
    dest.mkdir(parents=True, exist_ok=True)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    for name in names:
        shutil.copyfile(src / name, dest / name)
    return names


def prepare_tokenizer(model_dir: Path, dest: Path) -> dict:
    """--prepare: the built-in model's tokenizer files into dest (for the tree sent to the device)."""
    names = copy_tokenizer(model_dir, dest)
    sizes = {n: (dest / n).stat().st_size for n in names}
    if sum(sizes.values()) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"tokenizer files take {sum(sizes.values())} bytes, over {MAX_TOKENIZER_BYTES}")
    return {"from": str(model_dir), "to": str(dest), "bytes": sizes}


# adapters
@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...] = ATTENTION

    @property
    def alpha(self) -> int:
        return 2 * self.rank  # scale alpha / r = 2

    def config(self, base: str) -> dict:
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "inference_mode": True,
        }


def adapter_tensors(
    shape: Shape, spec: AdapterSpec, gen: torch.Generator, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A [r, in] ~ N(0, 1/in) and lora_B [out, r] ~ N(0, 0.01/r): B non-zero, so the adapter
    moves each projection's output by about a quarter of the base's."""
    tensors = {}
    dims = shape.linear_dims()
    for layer in range(shape.num_layers):
        for module in spec.targets:
            n_in, n_out = dims[module]
            part = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a = torch.randn(spec.rank, n_in, generator=gen, device=gen.device) / n_in**0.5
            b = torch.randn(n_out, spec.rank, generator=gen, device=gen.device) * (0.1 / spec.rank**0.5)
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{key}.lora_B.weight"] = b.to(dtype).cpu()
    return tensors


def save_adapter(out_dir: Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor], base: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(spec.config(base), indent=1))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def write_adapters(
    shape: Shape, root: Path, specs: list[AdapterSpec], device: torch.device, dtype: torch.dtype, seed: int = 1
) -> dict[str, Path]:
    """One adapter per spec, each with its own random tensors; name -> directory."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {s.name: save_adapter(root / s.name, s, adapter_tensors(shape, s, gen, dtype), root.name) for s in specs}


def write_adapter_family(
    shape: Shape,
    root: Path,
    names: list[str],
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
    bases: int = 4,
    targets: tuple[str, ...] = ATTENTION,
) -> dict[str, Path]:
    """Many adapters fast: `bases` random tensor sets (seeded), adapter i = set i % bases with its B scaled by
    its own factor in [0.75, 1.25), so no two adapters are equal."""
    spec = AdapterSpec("family", rank, targets)
    gen = torch.Generator(device=device).manual_seed(7)
    sets = [adapter_tensors(shape, spec, gen, dtype) for _ in range(min(bases, len(names)))]
    paths = {}
    for i, name in enumerate(names):
        factor = 0.75 + 0.5 * i / len(names)
        tensors = {k: t * factor if ".lora_B." in k else t for k, t in sets[i % len(sets)].items()}
        paths[name] = save_adapter(root / name, replace(spec, name=name), tensors, root.name)
    return paths


# the transformers + PEFT reference
def load_reference(model_dir: Path, adapters: dict[str, Path], dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' model of model_dir in dtype on device, with every adapter loaded by name (kept in dtype)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    base = base.to(device).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(
        base, str(adapters[names[0]]), adapter_name=names[0], autocast_adapter_dtype=False
    )
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name, autocast_adapter_dtype=False)
    return model.eval()


def with_adapter(model: Any, adapter: str | None) -> contextlib.AbstractContextManager:
    if adapter is None:
        return model.disable_adapter()
    model.set_adapter(adapter)
    return contextlib.nullcontext()


@torch.no_grad()
def reference_greedy(model: Any, prompt: list[int], adapter: str | None, new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)  # [1, S]
    with with_adapter(model, adapter):
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def last_logits(model: Any, ids: list[int], adapter: str | None) -> torch.Tensor:
    with with_adapter(model, adapter):
        return model(torch.tensor([ids], device=model.device)).logits[0, -1].float()  # [V]


@torch.no_grad()
def sequence_logits(model: Any, prompt: list[int], adapter: str | None, new: list[int]) -> torch.Tensor:
    """The logits [len(new), V] that chose each of `new` after `prompt` (one forward over prompt + new)."""
    with with_adapter(model, adapter):
        logits = model(torch.tensor([prompt + new], device=model.device)).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(new) - 1]


def gap_errors(coarse: torch.Tensor, exact: torch.Tensor) -> list[float]:
    """Per row, how far `coarse` (a bf16 reference's logits) misjudges the exact top-2 gap: with a, b the exact
    top two, |(coarse[a] - coarse[b]) - (exact[a] - exact[b])|."""
    top = exact.topk(2, dim=-1).indices  # [N, 2]
    c, e = coarse.gather(1, top), exact.gather(1, top)
    return ((c[:, 0] - c[:, 1]) - (e[:, 0] - e[:, 1])).abs().tolist()


def divergence(model: Any, prompt: list[int], adapter: str | None, ours: list[int], ref: list[int]) -> dict | None:
    """None when equal; else where they part and, on the common prefix, the reference's logit gaps there
    (gaps()), in the reference's own dtype."""
    if ours == ref:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    if at >= min(len(ours), len(ref)):
        return {"at": at, "note": f"lengths differ: ours {len(ours)}, reference {len(ref)}"}
    split = {"at": at, "ref_token": ref[at], "ours_token": ours[at]}
    return {**split, **gaps(model, prompt + ref[:at], adapter, ref[at], ours[at])}


def gaps(model: Any, ids: list[int], adapter: str | None, ref_token: int, ours_token: int, prefix: str = "") -> dict:
    """After `ids`: the model's top-2 logit gap, and its logit of ref_token minus its logit of ours_token."""
    logits = last_logits(model, ids, adapter)
    top = logits.topk(2).values
    return {
        f"{prefix}top2_gap": round(float(top[0] - top[1]), 6),
        f"{prefix}ours_gap": round(float(logits[ref_token] - logits[ours_token]), 6),
    }


def adapter_effect(model: Any, prompt: list[int], adapter: str) -> float:
    """The largest change the adapter makes to the next-token logits after `prompt` (0: it does nothing)."""
    return round(float((last_logits(model, prompt, adapter) - last_logits(model, prompt, None)).abs().max()), 4)


@torch.no_grad()
def batch_generate(model: Any, batch: list[list[int]], adapters: Sequence[str | None], new: int) -> int:
    """One left-padded static batch, each row on its adapter (PEFT's adapter_names; "__base__": none), greedy to
    `new` tokens; the tokens generated (new per row)."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)  # [B, S]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)  # [B, S]
    names = [a or "__base__" for a in adapters]
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, adapter_names=names
    )
    return (out.shape[1] - width) * len(batch)
