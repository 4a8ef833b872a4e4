"""The engine's device, chosen once at start: `--device auto|cpu|cuda|cuda:N` resolved against the machine
(auto: CUDA when torch sees a GPU, else the CPU; an explicit CUDA device that cannot serve is an error with
its reason, never a silent CPU fallback), what the GPU is, and its memory budget: vLLM's
`--gpu-memory-utilization`, the weights and a profiled peak step first, the KV cache gets what is left."""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraplane_server.config import check_device_name

log = logging.getLogger("loraplane.device")

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GIB = 1 << 30


def gib(num_bytes: int) -> str:
    """Bytes as the messages and the log show them: 12.34 GiB."""
    return f"{num_bytes / GIB:.2f} GiB"


class DeviceError(RuntimeError):
    """The requested device cannot serve: no CUDA build of torch, no GPU visible, a driver that does not
    answer, an index past the last GPU. The message says which and what to do."""


class GPUMemoryError(DeviceError):
    """The model, its profiled step or one full-length sequence's KV cache does not fit the GPU budget."""


def cuda_unusable_reason() -> str | None:
    """None when torch can run on a CUDA GPU here; else why not, in words a pod's status can carry."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch"
    if torch.cuda.is_available():
        return None
    try:  # is_available() hides the driver's own words; init() raises them
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or AssertionError, by version
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"CUDA cannot start: {first}"
    return "no CUDA device is visible (torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES)"


def resolve_device(requested: str) -> torch.device:
    """The device the engine runs on. auto: cuda:0 when CUDA works here, else the CPU. cuda or cuda:N
    that cannot run raises DeviceError with the reason."""
    check_device_name(requested)
    if requested == "cpu":
        return torch.device("cpu")
    reason = cuda_unusable_reason()
    if requested == "auto":
        return torch.device("cpu") if reason else torch.device("cuda", 0)
    if reason:
        raise DeviceError(f"--device {requested}: {reason}")
    index = int(requested.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {requested}: this machine shows {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class DeviceInfo:
    """What the engine runs on, for the start-up line and /v1/debug/engine."""

    device: str  # cpu, cuda:0, ...
    name: str  # the GPU's name, or the CPU's model name
    total_memory_bytes: int | None = None
    compute_capability: str | None = None  # "9.0"
    cuda_version: str | None = None  # torch's CUDA runtime
    driver_version: str | None = None
    num_multiprocessors: int | None = None

    def to_dict(self) -> dict[str, str | int | None]:
        return asdict(self)

    def describe(self) -> str:
        if self.total_memory_bytes is None:
            return f"{self.device} ({self.name})"
        return (
            f"{self.device} ({self.name}, {self.total_memory_bytes / GIB:.1f} GiB, "
            f"compute capability {self.compute_capability}, CUDA {self.cuda_version}, driver {self.driver_version})"
        )


def device_info(device: torch.device, cpu_name: str) -> DeviceInfo:
    """The device's facts; cpu_name names the CPU (cpu_features.describe())."""
    if device.type != "cuda":
        return DeviceInfo(str(device), cpu_name)
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo(
        device=str(device),
        name=props.name,
        total_memory_bytes=int(props.total_memory),
        compute_capability=f"{props.major}.{props.minor}",
        cuda_version=torch.version.cuda,
        driver_version=_driver_version(),
        num_multiprocessors=int(props.multi_processor_count),
    )


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version as the driver reports it (no nvidia-smi needed)."""
    path = Path("/proc/driver/nvidia/version")
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9.]+)", text)
    return match.group(1) if match else None


@dataclass(frozen=True)
class MemoryPlan:
    """The GPU memory budget of one engine, as vLLM splits it: the budget is utilization x total; the
    weights, adapter slots and the profiled peak step's activations (torch's peak), plus what the process
    holds outside torch's allocator (the CUDA context, cuBLAS workspaces), come off it first; the KV cache
    gets the rest, in whole blocks."""

    total_bytes: int
    budget_bytes: int
    peak_step_bytes: int  # torch's peak over weights, slots and the profiled step
    non_torch_bytes: int
    block_bytes: int
    num_blocks: int

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "kv_cache_bytes": self.kv_cache_bytes}

    def describe(self) -> str:
        return (
            f"GPU memory: budget {gib(self.budget_bytes)} of {gib(self.total_bytes)}; weights, adapter slots and the "
            f"peak step {gib(self.peak_step_bytes)}, outside torch {gib(self.non_torch_bytes)}; KV cache "
            f"{gib(self.kv_cache_bytes)} = {self.num_blocks} blocks of {self.block_bytes} bytes"
        )


def plan_gpu_memory(
    total_bytes: int,
    free_at_start: int,
    utilization: float,
    peak_step_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
    min_blocks: int,
) -> MemoryPlan:
    """The KV blocks the budget leaves (pure). free_at_start: free GPU memory before the engine took any (other
    processes hold the rest); min_blocks: the blocks one sequence of the longest context needs. Raises
    GPUMemoryError with the bytes needed and available when the budget cannot be met."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={utilization}: expected a fraction in (0, 1]")
    budget = int(total_bytes * utilization)
    if budget > free_at_start:
        raise GPUMemoryError(
            f"--gpu-memory-utilization {utilization} asks for {gib(budget)} of this GPU's {gib(total_bytes)}, but only "
            f"{gib(free_at_start)} were free at start (other processes hold the rest); lower it or free the GPU"
        )
    kv_bytes = budget - peak_step_bytes - non_torch_bytes
    num_blocks = max(kv_bytes, 0) // block_bytes
    if num_blocks < min_blocks:
        need = peak_step_bytes + non_torch_bytes + min_blocks * block_bytes
        raise GPUMemoryError(
            f"the model does not fit: weights, adapter slots and the peak step take {gib(peak_step_bytes)} "
            f"(+{gib(non_torch_bytes)} outside torch), and one sequence of the full context needs {min_blocks} KV "
            f"blocks ({gib(min_blocks * block_bytes)}): {gib(need)} needed, {gib(budget)} available under "
            f"--gpu-memory-utilization {utilization}; raise it, lower --max-model-len or --max-num-batched-tokens, "
            "or use --quantization int8"
        )
    return MemoryPlan(total_bytes, budget, peak_step_bytes, non_torch_bytes, block_bytes, num_blocks)


def check_weights_fit(weight_bytes: int, total_bytes: int, free_at_start: int, utilization: float) -> None:
    """Before any weight is loaded: the checkpoint's bytes in the serving dtype against the budget, so a model
    that cannot fit fails with both numbers, not a CUDA out-of-memory halfway through the load."""
    budget = min(int(total_bytes * utilization), free_at_start)
    if weight_bytes > budget:
        raise GPUMemoryError(
            f"the model does not fit: its weights need {gib(weight_bytes)}, {gib(budget)} are "
            f"available (--gpu-memory-utilization {utilization} of {gib(total_bytes)}, "
            f"{gib(free_at_start)} free); use a GPU with more memory or --quantization int8"
        )
