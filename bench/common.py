"""What the benchmarks share: the machine record, greedy requests over real tokens, a left-padded
transformers baseline, percentiles, starting a server and matplotlib when it is installed.

bench/ is on sys.path when a benchmark runs as a script, so they import this as `common`.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import torch

from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.platforms import cpu_features
from loraplane_server.sampling_params import SamplingParams


def machine(dtype: torch.dtype | None = None, **extra: object) -> dict:
    """The CPU model and flags (every bench records them), the library versions and the threads."""
    import transformers

    from loraplane_server.kernels import cpu_kernels

    info: dict[str, object] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        **cpu_features.record(),
        "kernel_isa": cpu_kernels.isa(),
        "load_average": os.getloadavg(),
    }
    if dtype is not None:
        info["dtype"] = str(dtype).removeprefix("torch.")
    return {**info, **extra}


def greedy(n: int) -> SamplingParams:
    """Exactly n new tokens, greedy (eos ignored, so both sides of a comparison do the same work)."""
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def token_pool(engine: LLMEngine) -> list[int]:
    """Every real-vocab token id that is not a special token."""
    special = set(engine.tokenizer.all_special_ids)
    vocab = min(len(engine.tokenizer), engine.runner.model.args.vocab_size)
    return [i for i in range(vocab) if i not in special]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [B, S]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, S]
    return ids, mask


def hf_static_batch(model: Any, prompts: list[list[int]], max_new: int, pad_id: int, **extra: object) -> int:
    """One left-padded static batch through transformers' generate to its longest output, never stopping at
    eos (extra: e.g. PEFT's adapter_names); returns the new tokens per row."""
    ids, mask = left_pad(prompts, pad_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_id,
        **extra,
    )
    assert isinstance(out, torch.Tensor)  # [B, S + new]
    return out.shape[1] - ids.shape[1]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(
    url: str, proc: subprocess.Popen, log: Path | None = None, timeout: float = 900.0, path: str = "/ready"
) -> None:
    """Until GET url+path answers 200; an error with the log's tail if the server exits first or time runs out."""

    def tail() -> str:
        return log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}: {tail()}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url}{path} did not become ready in {timeout:.0f} s: {tail()}")


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (no plot then)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_result(result: dict, out: Path, plot: Callable[[dict, Path], str | None]) -> None:
    """The JSON (with its plot's path, the PNG beside it) to `out`, and to stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
