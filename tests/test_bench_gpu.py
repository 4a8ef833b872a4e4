"""bench/gpu.py (the GPU check of issue 35) on this machine: the shapes are the published ones, what it builds loads
in the engine and in transformers + PEFT (and they agree), its parity section's JSON from a real `--quick --device
cpu` run, it imports without the packages the GPU machine lacks, `--device cuda` without a GPU fails at once, and
a failing or late step is recorded, not raised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.platforms.device import cuda_unusable_reason
from loraplane_server.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import gpu  # noqa: E402
import gpu_models  # noqa: E402

# what the GPU machine does not have (bench/gpu.py must import without them)
ABSENT = ("fastapi", "uvicorn", "pydantic", "boto3", "botocore", "gguf", "starlette")
HIDE = f"""
import importlib.machinery, sys
class Absent:
    def __init__(self, inner): self.inner = inner
    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] in {ABSENT!r} else self.inner.find_spec(name, path, target)
    def __getattr__(self, name): return getattr(self.inner, name)
sys.meta_path[:] = [Absent(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def test_shapes_are_the_published_models() -> None:
    """Parameter counts of the real checkpoints (SmolLM2-135M, Llama-3.2-1B tied, Llama-3.1-8B untied)."""
    shapes = gpu_models.REAL_SHAPES
    assert shapes["smollm2-135m"].num_params() == 134_515_008
    assert shapes["llama-3.2-1b"].num_params() == 1_235_814_400
    assert shapes["llama-3.1-8b"].num_params() == 8_030_261_248
    eight = shapes["llama-3.1-8b"]
    # a decode step reads every weight once but only the batch's rows of the untied input embedding
    assert gpu.weight_read_bytes(eight, 2) == (8_030_261_248 - 128_256 * 4096) * 2
    assert gpu.kv_token_bytes(eight, 2) == 2 * 32 * 8 * 128 * 2
    assert gpu.roofline(4, 1000, 1000.0, 2.0)["roofline_tokens_per_s"] == 4 * 2e9 / 2000
    cfg = eight.config()
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    assert cfg["max_position_embeddings"] > cfg["rope_scaling"]["original_max_position_embeddings"]


def tokenizer_dir() -> Path:
    """The carried tokenizer files (bench/gpu.py --prepare), else the built-in model's."""
    if (gpu.TOKENIZER_DIR / "tokenizer.json").is_file():
        return gpu.TOKENIZER_DIR
    from loraplane_server.store.builtin import resolve_model

    return resolve_model("smollm2-135m")


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_built_model_and_adapters_agree_with_peft(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick shape (128,256-row vocabulary, llama3 rope, tied or not) written in shards, with adapters of two
    target sets: the engine (fp32, CPU) and transformers + PEFT give the same greedy tokens, base and adapters."""
    monkeypatch.setattr(gpu_models, "SHARD_BYTES", 16 << 20)  # several shards, as the 8B shape's
    shape = gpu_models.quick_shapes()[name]
    cpu = torch.device("cpu")
    written = gpu_models.write_model(shape, tmp_path / "model", cpu, torch.float32, tokenizer_dir(), std=0.05)
    assert written["shards"] > 1 and "tokenizer.json" in written["tokenizer_files"]
    specs = [gpu_models.AdapterSpec("qkvo-r8", 8), gpu_models.AdapterSpec("all-r16", 16, gpu_models.EVERY_LINEAR)]
    paths = gpu_models.write_adapters(shape, tmp_path / "adapters", specs, cpu, torch.float32)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path / "model"),
            dtype="float32",
            device="cpu",
            adapter_dir=str(tmp_path / "adapters"),
            kv_cache_bytes=64 << 20,
            disk_cache_dir=str(tmp_path / "disk"),
        )
    )
    assert engine.runner.model.args.vocab_size == 128_256 > len(engine.tokenizer) == 49_152
    assert engine.runner.model.args.rope_scaling["rope_type"] == "llama3"
    reference = gpu_models.load_reference(tmp_path / "model", paths, torch.float32, cpu)
    prompt = list(range(1000, 1020))
    for adapter in [None, *paths]:
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        ours = engine.generate([prompt], params)[0] if adapter is None else _one(engine, prompt, adapter)
        assert ours.token_ids == gpu_models.reference_greedy(reference, prompt, adapter, 6), adapter
    for adapter in paths:  # B is not zero: each adapter moves the logits
        assert gpu_models.adapter_effect(reference, prompt, adapter) > 0.1


def _one(engine: LLMEngine, prompt: list[int], adapter: str):
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True), adapter_id=adapter)
    done, _ = gpu.run_to_end(engine, 60)
    assert done[rid].error is None
    return done[rid]


def test_quick_parity_run_writes_its_json_and_plot(tmp_path: Path) -> None:
    """The script end to end on the CPU for two sections, with fastapi, uvicorn, pydantic, boto3 and gguf hidden
    (the GPU machine lacks them): one JSON on stdout, the same in gpu.json, a small PNG; fp32 token for token,
    bf16 divergences near ties, every request and adapter recorded."""
    out = tmp_path / "out"
    argv = [str(BENCH / "gpu.py"), "--device", "cpu", "--quick", "--sections", "ceilings,parity", "--out", str(out)]
    run = f"sys.argv = {argv!r}\nsys.path.insert(0, {str(BENCH)!r})\nrunpy.run_path(sys.argv[0], run_name='__main__')"
    code = HIDE + "import runpy\n" + run  # as `python bench/gpu.py ...` runs it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # OpenMP's spin-waits crawl on a shared 2-core machine
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert json.loads((out / "gpu.json").read_text()) == result
    assert set(result["sections"]) == {"ceilings", "parity"}
    assert result["sections"]["ceilings"]["gpu"] == "needs CUDA"
    parity = result["sections"]["parity"]
    assert parity["status"] == "ok", parity
    fp32, bf16 = parity["float32"], parity["bfloat16"]
    assert fp32["status"] == "ok" and fp32["passed"] and fp32["matches"] == 8
    assert bf16["status"] == "ok" and bf16["matches"] + bf16["mismatches"] == 8
    assert bf16["passed"] == (bf16["near_ties"] == bf16["mismatches"])  # bf16 itself may part anywhere
    for row in bf16["per_request"]:
        assert row["match"] == (row["divergence"] is None)
        if row["divergence"] is not None:  # scored by the bf16 reference and by the fp32 one
            assert {"at", "ref_token", "ours_token", "ours_gap", "exact_ours_gap"} <= set(row["divergence"])
    assert [r["adapter"] for r in parity["requests"]] == [None, None, "p-r8", "p-r8", "p-r16", "p-r16"] + [
        "p-r64-all"
    ] * 2
    assert len(fp32["per_request"]) == 8 and all(r["match"] for r in fp32["per_request"])
    assert min(fp32["adapter_effect_max_abs_logit"].values()) > 0.1
    assert result["summary"]["parity_fp32_passed"] is True
    assert result["tokenizer"]["ok"] and result["tokenizer"]["size"] == 49_152
    assert {e["key"] for e in result["engines"]} == {"parity-float32", "parity-bfloat16"}
    png = Path(result["plot"])
    assert png == out / "gpu.png" and 0 < png.stat().st_size < 1 << 20


def test_the_hidden_packages_are_hidden() -> None:
    """HIDE (used by the run above) does make the packages the GPU machine lacks unimportable."""
    code = HIDE + "import torch\nimport fastapi\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1 and done.stderr.strip().endswith("No module named 'fastapi'"), done.stderr[-2000:]


@pytest.mark.skipif(cuda_unusable_reason() is None, reason="a machine without a usable CUDA device")
def test_cuda_without_a_gpu_fails_at_once(tmp_path: Path) -> None:
    start = time.monotonic()
    cmd = [sys.executable, str(BENCH / "gpu.py"), "--device", "cuda", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("bench/gpu.py: --device cuda: ") and "CUDA" in done.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "gpu.json").exists()


def test_a_failing_or_late_step_is_recorded() -> None:
    def boom() -> dict:
        raise ValueError("broken on purpose")

    dropped = []
    failed = gpu.guarded(boom, lambda: dropped.append(True))
    assert failed["status"] == "error" and dropped == [True]
    assert failed["error"]["type"] == "ValueError" and failed["error"]["message"] == "broken on purpose"
    assert any("boom" in line for line in failed["error"]["traceback"])
    budget = gpu.Budget(10.0)
    late = gpu.guarded(lambda: budget.need(20, "a big step") or {})
    assert late["status"] == "skipped" and late["reason"].startswith("skipped: out of time (a big step")
    assert gpu.guarded(lambda: {"x": 1}) == {"status": "ok", "x": 1, "seconds": pytest.approx(0, abs=1)}
    section = {"status": "ok", "shapes": {"a": late, "b": {"status": "skipped"}}, "graphs": "n/a"}
    assert gpu.rolled_up(section)["status"] == "skipped"
    section["shapes"]["b"]["status"] = "ok"
    assert gpu.rolled_up(section)["status"] == "ok"


def test_alarm_stops_a_section_that_overruns() -> None:
    def forever() -> dict:
        with gpu.alarm(1.0):
            while True:
                time.sleep(0.01)

    start = time.monotonic()
    record = gpu.guarded(forever)
    assert record["status"] == "error" and record["error"]["type"] == "SectionTimeout"
    assert time.monotonic() - start < 5


class _FakeEngine:
    def __init__(self, graphs: int) -> None:
        self.runner = SimpleNamespace(graphs=SimpleNamespace(graphs=dict.fromkeys(range(graphs)), num_replays=0))


@pytest.mark.parametrize("captured", [True, False])
def test_decode_runs_eager_again_only_where_graphs_are_captured(
    captured: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served engine first (it tells whether this device captures graphs); where it does, --enforce-eager
    too, the eager one first for the later shapes so the served engine stays for multi_lora (the 1B, last)."""
    args = gpu.parse_args(["--device", "cpu", "--quick"])
    run = gpu.Run(args, torch.device("cpu"), gpu.QUICK, gpu_models.quick_shapes(), tmp_path, gpu.Budget(600), [5])
    started: list[tuple[str, bool]] = []

    def engine(name: str, eager: bool = False) -> _FakeEngine:
        started.append((name, eager))
        return _FakeEngine(0 if eager or not captured else 3)

    monkeypatch.setattr(run, "serving_engine", engine)
    monkeypatch.setattr(gpu, "decode_batches", lambda run, engine, w, k: {"graphs": gpu.captured_graphs(engine)})
    shapes = gpu.section_decode(run)["shapes"]
    if captured:
        assert started == [
            ("smollm2-135m", False),
            ("smollm2-135m", True),
            ("llama-3.1-8b", True),
            ("llama-3.1-8b", False),
            ("llama-3.2-1b", True),
            ("llama-3.2-1b", False),
        ]
        assert all(s["graphs"]["graphs"] == 3 and s["eager"]["graphs"] == 0 for s in shapes.values())
    else:
        assert started == [("smollm2-135m", False), ("llama-3.1-8b", False), ("llama-3.2-1b", False)]
        assert all(s["graphs"] == "not captured: every decode step eager" for s in shapes.values())
    assert run.graphs is captured


def test_the_gpu_test_files_import_without_the_absent_packages() -> None:
    """Every file bench/gpu.py's tests section runs collects with the GPU machine's missing packages hidden (on
    the H200, test_device.py failed to import fastapi through the HTTP test helpers)."""
    found = (REPO / "tests").rglob("test_*.py")
    files = [str(p.relative_to(REPO)) for p in found if gpu.GPU_MARK.search(p.read_text())]
    assert "tests/test_gpu_engine.py" in files and "tests/test_device.py" in files
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", *files]
    code = HIDE + f"import pytest\nsys.exit(pytest.main({args!r}))\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower().splitlines()[-1], proc.stdout[-2000:]


def test_slot_load_times_both_ways_into_a_spare_slot(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """multi_lora's slot-load record on the CPU: both ways timed, the engine's own slots left as they were; a
    workload's count of slot loads."""
    from engine_helpers import make_engine, run_all

    from lora_helpers import make_peft_adapter

    for seed, name in enumerate(("a", "b")):
        make_peft_adapter(tiny_llama_dir, tmp_path / "adapters" / name, seed=seed, r=4, target_modules=["q_proj"])
    engine = make_engine(tiny_llama_dir, adapter_dir=str(tmp_path / "adapters"), disk_cache_dir=str(tmp_path / "dc"))
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0), adapter_id="a")
    run_all(engine, check_errors=True)
    before = {kind: t.clone() for kind, t in engine.lora_slots.a.items()}
    record = gpu.slot_load(SimpleNamespace(device=torch.device("cpu")), engine, "a", repeats=2)  # type: ignore[arg-type]
    assert record["adapter_mb"] > 0 and record["pinned"] is False
    for way in ("one_transfer", "per_tensor_pageable"):
        assert 0 < record[way]["host_ms"] <= record[way]["done_ms"], record
    assert all(torch.equal(engine.lora_slots.a[kind], t) for kind, t in before.items())
    run = gpu.timed_workload(engine, torch.device("cpu"), [[4, 5, 6], [7, 8]], ["b", "a"], 2)
    assert run["slot_loads"] == 1 and run["generated_tokens"] == 4  # b took a slot; a already held one
