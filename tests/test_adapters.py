"""Adapters in the engine: validation, the residency API, 1,000 adapters through 8 slots, fairness."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, run_all
from safetensors.torch import load_file, save_file

from lora_helpers import make_peft_adapter, peft_greedy
from loraplane_server.engine.llm_engine import LLMEngine, RequestOutput
from loraplane_server.sampling_params import SamplingParams

GOOD = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def good_adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("good") / "good", seed=5, **GOOD)


def new_engine(model_dir: Path, tmp: Path, **kw: object) -> LLMEngine:
    defaults = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_lora_rank=16)
    return make_engine(model_dir, **{**defaults, "disk_cache_dir": str(tmp / "disk-cache"), **kw})


def corrupt(kind: str, src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    weights, cfg_path = dst / "adapter_model.safetensors", dst / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    if kind == "pickle":
        weights.rename(dst / "adapter_model.bin")
    elif kind == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    elif kind == "missing":
        weights.unlink()
    elif kind == "nan":
        tensors[first][0, 0] = float("nan")
        save_file(tensors, str(weights))
    elif kind == "shape":
        tensors[first] = torch.zeros(tensors[first].shape[0], 7)
        save_file(tensors, str(weights))
    elif kind == "rank":
        cfg["r"] = 32
        cfg_path.write_text(json.dumps(cfg))
        tensors = {
            k: (torch.zeros(32, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 32))
            for k, v in tensors.items()
        }
        save_file(tensors, str(weights))
    elif kind == "target":
        cfg["target_modules"] = ["q_proj", "c_attn"]
        cfg_path.write_text(json.dumps(cfg))
    elif kind == "json":
        cfg_path.write_text("{not json")
    elif kind == "dora":
        cfg["use_dora"] = True
        cfg_path.write_text(json.dumps(cfg))
    return dst


BROKEN = {
    "pickle": "pickle",
    "truncated": "truncated",
    "missing": "no adapter_model.safetensors",
    "nan": "NaN",
    "shape": "do not fit the base model",
    "rank": "exceeds --max-lora-rank 16",
    "target": "unknown target modules",
    "json": "not valid JSON",
    "dora": "DoRA",
}


def test_broken_adapters_fail_alone(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    engine = new_engine(tiny_llama_dir, tmp_path)
    engine.adapters.register("good", str(good_adapter))
    for kind in BROKEN:
        engine.adapters.register(kind, str(corrupt(kind, good_adapter, tmp_path / kind)))
    prompt = [5, 6, 7, 8, 9, 10]
    free0 = engine.block_manager.num_free_blocks
    ids = {kind: engine.add_request(prompt, SamplingParams(max_new_tokens=6), adapter_id=kind) for kind in BROKEN}
    good = engine.add_request(prompt, SamplingParams(max_new_tokens=6), adapter_id="good")
    base = engine.add_request(prompt, SamplingParams(max_new_tokens=6))
    done = run_all(engine)
    for kind, needle in BROKEN.items():
        out = done[ids[kind]]
        assert out.finish_reason == "error" and needle in (out.error or ""), (kind, out.error)
        assert engine.adapters.manager.records[kind].state.value == "failed"
    assert done[good].token_ids == peft_greedy(tiny_llama_dir, good_adapter, [prompt], [6])[0]
    assert done[base].token_ids == peft_greedy(tiny_llama_dir, None, [prompt], [6])[0]
    assert engine.block_manager.num_free_blocks == free0 and engine.slots.num_busy == 0
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.add_request(prompt, SamplingParams(), adapter_id="nobody")


def test_failed_load_can_be_retried(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    engine = new_engine(tiny_llama_dir, tmp_path)
    path = tmp_path / "later"
    engine.adapters.register("later", str(path))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3), adapter_id="later")
    assert "does not exist" in (run_all(engine)[rid].error or "")
    shutil.copytree(good_adapter, path)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3), adapter_id="later")
    out = run_all(engine)[rid]
    assert out.error is None and len(out.token_ids) == 3


def test_residency_prewarm_pin_unload(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    adapter_dir = tmp_path / "adapters"
    for name in ("a", "b", "c"):
        shutil.copytree(good_adapter, adapter_dir / name)
    engine = new_engine(tiny_llama_dir, tmp_path, adapter_dir=str(adapter_dir), max_loras=2)
    rows = {r["id"]: r for r in engine.adapters.residency()}
    assert set(rows) == {"a", "b", "c"} and rows["a"]["tier"] == "disk" and rows["a"]["state"] == "registered"
    engine.adapters.prewarm("a", "device", pinned=True)
    engine.adapters.prewarm("b", "host")
    run_all(engine)
    for _ in range(50):
        engine.poll_adapters()
        rows = {r["id"]: r for r in engine.adapters.residency()}
        if rows["a"]["tier"] == "device":
            break
    assert rows["a"]["tier"] == "device" and rows["a"]["pinned"] and rows["a"]["rank"] == 4
    assert rows["b"]["tier"] == "host" and rows["b"]["size_bytes"] > 0
    assert rows["c"]["tier"] == "disk"
    # the pinned one keeps its slot while others cycle through the remaining one
    for name in ("b", "c", "b"):
        engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=2), adapter_id=name)
        run_all(engine)
    assert engine.slots.lookup("a") is not None
    assert engine.adapters.unload("c") and "c" not in {r["id"] for r in engine.adapters.residency()}
    assert engine.adapters.unload("a") and engine.slots.lookup("a") is None
    rid = engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=200), adapter_id="b")
    engine.step()
    with pytest.raises(ValueError, match="in use"):
        engine.adapters.unload("b")
    engine.abort(rid)
    run_all(engine)


@pytest.mark.isa_agnostic  # the torch LoRA backend on a tiny model: the slots' and caches' churn, no ISA path
def test_thousand_adapters_through_eight_slots(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    """1,000 adapters on disk, 8 device slots, every adapter touched: everything completes, slots and
    blocks return, and the host and disk caches stay within their byte budgets."""
    template = load_file(str(good_adapter / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    adapter_dir = tmp_path / "adapters"
    for i in range(1000):
        d = adapter_dir / f"tenant-{i:04d}"
        d.mkdir(parents=True)
        shutil.copy(good_adapter / "adapter_config.json", d)
        save_file(
            {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in template.items()},
            str(d / "adapter_model.safetensors"),
        )
    size = sum(v.numel() * 4 for v in template.values())
    host_budget = 40 * size
    engine = new_engine(
        tiny_llama_dir,
        tmp_path,
        adapter_dir=str(adapter_dir),
        max_loras=8,
        max_num_seqs=32,
        host_cache_bytes=host_budget,
        num_kv_blocks=200,
    )
    free0 = engine.block_manager.num_free_blocks
    ids: dict[int, str] = {}
    done: dict[str, RequestOutput] = {}
    for i in range(1000):
        ids[i] = engine.add_request(
            [1 + i % 50, 2, 3, 4], SamplingParams(max_new_tokens=3), adapter_id=f"tenant-{i:04d}"
        )
        if i % 25 == 0:
            for _ in range(3):
                done.update((o.request_id, o) for o in engine.step() if o.finished)
                assert engine.adapters.manager.host_bytes <= host_budget
    done.update(run_all(engine))
    assert all(done[r].error is None and len(done[r].token_ids) == 3 for r in ids.values())
    assert engine.block_manager.num_free_blocks == free0
    assert engine.slots.num_busy == 0 and engine.adapters.manager.host_bytes <= host_budget
    assert engine.adapters.manager.stats.evictions["host"] > 0
    assert len({tuple(done[ids[i]].token_ids) for i in range(0, 1000, 50)}) > 1  # adapters really differ
    assert done[ids[7]].token_ids == peft_greedy(tiny_llama_dir, adapter_dir / "tenant-0007", [[8, 2, 3, 4]], [3])[0]


def test_the_host_tier_never_passes_its_budget_while_it_evicts(
    tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six adapters into a host budget of three: each eviction happens before the new weights are counted, so
    host_bytes (read without the manager's lock, as the thousand-adapter test does) is within the budget at every
    eviction, where adding first had it one adapter over until the evictions ran."""
    size = sum(v.numel() * 4 for v in load_file(str(good_adapter / "adapter_model.safetensors")).values())
    adapter_dir = tmp_path / "adapters"
    for i in range(6):
        shutil.copytree(good_adapter, adapter_dir / f"t{i}")
    engine = new_engine(tiny_llama_dir, tmp_path, adapter_dir=str(adapter_dir), host_cache_bytes=3 * size)
    manager = engine.adapters.manager
    seen: list[int] = []
    forget = manager._forget_host
    monkeypatch.setattr(
        manager, "_forget_host", lambda adapter_id: seen.append(manager.host_bytes) or forget(adapter_id)
    )
    for i in range(6):
        engine.adapters.prewarm(f"t{i}", "host")
        run_all(engine)
    assert manager.stats.evictions["host"] == 3 and len(manager.host) == 3
    assert seen and max(seen) <= 3 * size and manager.host_bytes == 3 * size


def test_hot_adapter_cannot_starve_the_others(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    """One adapter with 200 queued requests, 20 adapters with one each, all queued before the first step.

    Criterion: with 21 active adapters each one's fair share is 1/21 of admissions, so every single
    request must finish before the hot adapter has finished 2 x 20 = 40 requests (twice the service
    it would get if the 20 others each got exactly one turn per round)."""
    adapter_dir = tmp_path / "adapters"
    for name in ["hot"] + [f"one-{i}" for i in range(20)]:
        shutil.copytree(good_adapter, adapter_dir / name)
    engine = new_engine(tiny_llama_dir, tmp_path, adapter_dir=str(adapter_dir), max_loras=4, max_num_seqs=8)
    for name in ["hot"] + [f"one-{i}" for i in range(20)]:
        engine.adapters.prewarm(name, "host")
    run_all(engine)
    hot = [engine.add_request([7] * 16, SamplingParams(max_new_tokens=4), adapter_id="hot") for _ in range(200)]
    singles = {engine.add_request([8] * 16, SamplingParams(max_new_tokens=4), adapter_id=f"one-{i}") for i in range(20)}
    hot_done = 0
    singles_left = set(singles)
    while singles_left:
        for out in engine.step():
            if out.finished:
                assert out.error is None
                hot_done += out.request_id in hot
                singles_left.discard(out.request_id)
        assert hot_done < 40 or not singles_left, f"{len(singles_left)} singles still waiting at {hot_done} hot"
    run_all(engine)
    assert engine.slots.num_busy == 0


def test_remote_adapters_go_through_the_disk_cache(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    """http(s) archive sources land in the byte-bounded disk cache, then host, then a slot."""
    import functools
    import http.server
    import tarfile
    import threading

    site = tmp_path / "site"
    site.mkdir()
    template = load_file(str(good_adapter / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for i in range(12):
        d = tmp_path / "src" / f"remote-{i}"
        d.mkdir(parents=True)
        shutil.copy(good_adapter / "adapter_config.json", d)
        save_file(
            {k: torch.randn(v.shape, generator=gen) for k, v in template.items()}, str(d / "adapter_model.safetensors")
        )
        with tarfile.open(site / f"remote-{i}.tar.gz", "w:gz") as tar:
            tar.add(d, arcname=d.name)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        entry = sum(
            (tmp_path / "src" / "remote-0" / f).stat().st_size
            for f in ("adapter_config.json", "adapter_model.safetensors")
        )
        budget = 4 * entry + 1000
        engine = new_engine(tiny_llama_dir, tmp_path, max_loras=2, disk_cache_bytes=budget)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for i in range(12):
            engine.adapters.register(f"remote-{i}", f"{url}/remote-{i}.tar.gz")
        ids = {
            i: engine.add_request([4, 5, 6], SamplingParams(max_new_tokens=4), adapter_id=f"remote-{i}")
            for i in range(12)
        }
        done = run_all(engine)
        assert all(done[r].error is None for r in ids.values()), [done[r].error for r in ids.values()]
        assert engine.adapters.manager.disk.total_bytes <= budget and engine.adapters.manager.disk.num_entries <= 4
        assert engine.adapters.manager.stats.loads["disk"] == 12
        ref = peft_greedy(tiny_llama_dir, tmp_path / "src" / "remote-3", [[4, 5, 6]], [4])[0]
        assert done[ids[3]].token_ids == ref
        rows = {r["id"]: r for r in engine.adapters.residency()}
        assert sum(r["tier"] == "disk" for r in rows.values()) <= 4
    finally:
        server.shutdown()


def test_failed_loads_say_whether_a_retry_may_help(tiny_llama_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    """A failed row's error_transient tells the operator what to do: a missing path, a broken adapter or a 404
    can only be fixed at the source (False: fail at once); a 503 or no answer may pass (True: back off, retry)."""
    import http.server
    import socket
    import threading

    class Store(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self.send_error(503 if "busy" in self.path else 404)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cases = {
        "missing": (str(tmp_path / "nowhere"), False),
        "broken": (str(corrupt("shape", good_adapter, tmp_path / "broken")), False),
        "gone": (f"{url}/gone.tar.gz", False),
        "busy": (f"{url}/busy.tar.gz", True),
        "unreachable": (f"http://127.0.0.1:{closed}/a.tar.gz", True),
    }
    try:
        engine = new_engine(tiny_llama_dir, tmp_path)
        for name, (source, _) in cases.items():
            engine.adapters.register(name, source)
            engine.adapters.prewarm(name, "host")
        run_all(engine)
        rows = {r["id"]: r for r in engine.adapters.residency()}
        for name, (_, transient) in cases.items():
            assert rows[name]["state"] == "failed" and rows[name]["last_error"], (name, rows[name])
            assert rows[name]["error_transient"] is transient, (name, rows[name]["last_error"])
        # /metrics counts them by kind (loraplane_adapter_load_failures, what the chart's alert reads)
        assert engine.snapshot().load_failures == {"transient": 2, "permanent": 3}
    finally:
        server.shutdown()
