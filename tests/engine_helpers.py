"""Engine tests' shared helpers: an engine built from a model directory, and stepping it to the end.

Tests import this by name (tests/ is on sys.path through its conftest), like lora_helpers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine, RequestOutput

# bench/gpu.py runs the gpu tests in parallel workers on one GPU: each CUDA engine then takes this share of it
GPU_SHARE_ENV = "LORAPLANE_TEST_GPU_MEMORY_UTILIZATION"


def make_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    """An engine on model_dir in float32 (the dtype the reference comparisons use) unless overridden; every
    other field is the test's (EngineConfig's defaults otherwise). A disk_cache_dir keeps adapter copies
    out of the user's cache: tests that load adapters pass one under their tmp_path."""
    fields: dict = {"model": str(model_dir), "dtype": "float32", **overrides}
    share = os.environ.get(GPU_SHARE_ENV)
    if share and str(fields.get("device", "")).startswith("cuda"):  # engines of parallel test workers on one GPU
        asked = fields.get("gpu_memory_utilization")
        fields["gpu_memory_utilization"] = min(float(share), float(asked)) if asked else float(share)  # type: ignore[arg-type]
    return LLMEngine(EngineConfig(**fields))


def run_all(engine: LLMEngine, timeout_s: float = 300, check_errors: bool = False) -> dict[str, RequestOutput]:
    """Step until no request is left and no adapter load is in flight; every finished output by request id.
    check_errors: fail at the first output that carries an error."""
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.has_unfinished and not any(
            engine.adapters.manager.is_loading(a) for a in engine.adapters.manager.records
        ):
            engine.poll_adapters()
            return done
        outputs = engine.step()
        for out in outputs:
            assert not check_errors or out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
        if not outputs and engine.last_step_tokens == 0:
            time.sleep(0.002)  # only a background adapter load can move things on
    raise AssertionError(f"the engine did not finish in {timeout_s} s")


def drain(engine: LLMEngine, steps: int | None = None) -> dict[str, RequestOutput]:
    """At most `steps` steps (all while requests are left when None); the outputs that finished."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished and (steps is None or steps > 0):
        steps = None if steps is None else steps - 1
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    return done
