"""One OpenMP thread team per serving process: the engine loads and steps on one thread, the adapter loaders
run their torch ops serially (why: async_engine's docstring)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine

from loraplane_server.engine.async_engine import AsyncEngine
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.platforms.torch_threads import DEFAULT_THREADS, cpu_quota, default_threads, engine_thread
from loraplane_server.sampling_params import SamplingParams


def test_build_loads_and_steps_the_engine_on_one_thread(smollm2_dir: Path) -> None:
    built_on: list[int] = []

    def factory() -> LLMEngine:
        engine_thread()
        built_on.append(threading.get_ident())
        return make_engine(smollm2_dir, num_kv_blocks=64, max_model_len=256)

    front = AsyncEngine.build(factory).result(timeout=300)
    try:
        stepped_on = asyncio.run(front.call(threading.get_ident))
        assert built_on == [stepped_on] and stepped_on != threading.get_ident()
        assert asyncio.run(front.call(torch.get_num_threads)) == DEFAULT_THREADS

        async def generate() -> list[int]:
            ids: list[int] = []
            async for out in front.generate("Hello", SamplingParams(max_new_tokens=4, ignore_eos=True)):
                ids += out.delta_token_ids
            return ids

        assert len(asyncio.run(generate())) == 4
        # the adapter loaders' pool: every thread of it runs torch ops alone
        pool = front.engine.adapters.manager._pool
        assert {pool.submit(torch.get_num_threads).result() for _ in range(4)} == {1}
        assert torch.get_num_threads() == DEFAULT_THREADS  # this thread's own count is untouched
        fresh: list[int] = []  # and so is the process-wide count a new thread starts with
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [DEFAULT_THREADS]
    finally:
        front.shutdown()
    assert not any(t.ident == stepped_on for t in threading.enumerate())  # the stepping thread ended


def test_build_failure_reaches_the_caller_and_ends_the_thread() -> None:
    def factory() -> LLMEngine:
        raise RuntimeError("no such model")

    before = set(threading.enumerate())
    future = AsyncEngine.build(factory)
    with pytest.raises(RuntimeError, match="no such model"):
        future.result(timeout=30)
    for t in set(threading.enumerate()) - before:
        t.join(timeout=10)
        assert t.name != "engine-step" or not t.is_alive()


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no limit
        ({"cpu.max": "200000 100000\n"}, 2.0),  # resources.limits.cpu: 2
        ({"cpu.max": "150000 100000\n"}, 1.5),  # 1500m
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # cgroup v1, no limit
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
        ({}, None),  # no cgroup files at all
        ({"cpu.max": "garbage"}, None),
    ],
)
def test_cpu_quota_reads_both_cgroup_versions(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


def test_default_threads_follow_the_cpu_limit() -> None:
    """A pod limited to 2 CPUs on a 64-core node runs 2 threads, 1500m runs 2, 500m runs 1; no limit, or a
    limit above the cores, keeps torch's default."""
    assert default_threads(64, 2.0) == 2
    assert default_threads(64, 1.5) == 2
    assert default_threads(64, 0.5) == 1
    assert default_threads(8, None) == 8
    assert default_threads(8, 16.0) == 8
