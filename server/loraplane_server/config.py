"""Engine configuration: one dataclass, built once at the entry point, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU's KV cache when kv_cache_bytes is not set
DEVICE_PATTERN = re.compile(r"(auto|cpu|cuda(:\d{1,3})?)")


def check_device_name(name: str) -> None:
    """Raise ValueError unless `name` is auto, cpu, cuda or cuda:N."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"device={name!r}: expected auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Paths are resolved by the caller."""

    model: str = "smollm2-135m"  # built-in name, model directory, .gguf file, hf://org/repo[@rev], s3://bucket/prefix
    model_cache: str | None = None  # downloaded and converted models; None: <user cache>/loraplane/models
    offline: bool = False  # the model cache (or local files) only: no download
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    # none | int8: the decoder's linear layers (q, k, v, o, gate, up, down) as int8 weights with one scale per
    # output channel, quantized at load; activations, LoRA, norms, the KV cache, embedding and lm_head keep dtype.
    # A pre-quantized int8 checkpoint (executor/models/quantized.py) is served as int8 whatever this says.
    quantization: str = "none"
    # auto (CUDA when torch sees a GPU, else the CPU) | cpu | cuda | cuda:N (device.py); a CUDA device that cannot
    # serve is an error at start, never a CPU fallback
    device: str = "auto"
    # CUDA: the fraction of the GPU's memory this engine takes (weights, the profiled peak step, then the KV cache
    # and adapter slots, as vLLM's flag); None: DEFAULT_GPU_MEMORY_UTILIZATION. Refused on the CPU.
    gpu_memory_utilization: float | None = None
    # CUDA: decode steps run eagerly, never as CUDA graphs (cuda_graphs.py; captured at start otherwise)
    enforce_eager: bool = False
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    # None: 1 GiB on the CPU; on CUDA what the GPU memory budget leaves (a number here fixes it instead)
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    max_loras: int = 8  # device slots: distinct adapters in one step
    max_lora_rank: int = 64
    adapter_dir: str | None = None  # every subdirectory is an adapter named after it
    host_cache_bytes: int = 2 << 30
    disk_cache_bytes: int = 20 << 30
    disk_cache_dir: str | None = None  # None: <user cache>/loraplane/adapters
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    lora_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere) | torch | triton
    # attention: auto (triton on CUDA for decode, cpu_kernel on the CPU when it builds: decode, and prefill in bf16;
    # else torch) | torch | cpu_kernel
    # | triton
    attention_backend: str = "auto"
    # dense layers (linear up to cpu_kernels.linear_max_rows() rows, fused norm/rotary/activation, BGMV):
    # auto (cpu_kernel on the CPU in bf16 when it builds, else torch) | torch | cpu_kernel
    layer_backend: str = "auto"
    # with the layer kernels and cpu_kernel attention: the layers before the last as one call each to the fused
    # CPU decoder layer (csrc/decoder_layer_cpu.cpp, same bits) in the families whose layers it computes;
    # off: the Python layers, the same kernels one by one
    fuse_layers: bool = True
    # speculative decoding (speculative.py): off | ngram (prompt lookup) | draft (draft_model proposes), the
    # default of requests that do not choose (SamplingParams.speculative); at most speculative_k proposals a
    # sequence and step, and proposals only while a step holds fewer than speculative_max_step_tokens tokens
    # (past that a step is compute-bound on this CPU, bench/speculative.py, and verifying costs more than it saves)
    speculative: str = "off"
    # a smaller model with the target's tokenizer (same sources as `model`) for speculative="draft": loaded next
    # to the target, run without adapters, its KV cache in the target's blocks (draft.py); None: no draft method
    draft_model: str | None = None
    # a draft pass's time over a plain decode step's, for whether a step's draft proposals pay (speculative.py
    # draft_pays): None measures it as the engine runs (the bytes each model reads until then); 0 always drafts
    draft_cost_ratio: float | None = None
    speculative_k: int = 4
    speculative_max_step_tokens: int = 32

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: expected a fraction in (0, 1]")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be >= 1")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={self.dtype!r}: expected auto, bfloat16, float16 or float32")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"quantization={self.quantization!r}: expected none or int8")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.lora_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"lora_backend={self.lora_backend!r}: expected auto, torch or triton")
        if self.attention_backend not in ("auto", "torch", "cpu_kernel", "triton"):
            raise ValueError(
                f"attention_backend={self.attention_backend!r}: expected auto, torch, cpu_kernel or triton"
            )
        if self.layer_backend not in ("auto", "torch", "cpu_kernel", "triton"):
            raise ValueError(f"layer_backend={self.layer_backend!r}: expected auto, torch, cpu_kernel or triton")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.speculative not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative={self.speculative!r}: expected off, ngram or draft")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative=draft needs a draft_model (--draft-model)")
        if self.draft_cost_ratio is not None and not 0 <= self.draft_cost_ratio <= 100:
            raise ValueError("draft_cost_ratio must be in [0, 100] (None: measured)")
        if self.speculative_k < 1 or self.speculative_max_step_tokens < 1:
            raise ValueError("speculative_k and speculative_max_step_tokens must be >= 1")
        if not isinstance(self.fuse_layers, bool):
            raise ValueError(f"fuse_layers={self.fuse_layers!r}: expected true or false")
