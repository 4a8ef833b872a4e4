"""Decode graphs (cuda_graphs.py): bucket choice and padding as pure functions; the static-buffer step against
the plain engine, on the CPU without a capture (Triton interpreted) and, marked `gpu`, captured on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, run_all

from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.cuda_graphs import MAX_GRAPH_BATCH, graph_batch_sizes, graph_bucket, is_plain_decode
from loraplane_server.executor.lora.backends.triton import slot_runs
from loraplane_server.executor.model_runner import decode_tables
from loraplane_server.kernels.triton_lora import triton_available
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import Sequence
from loraplane_server.spec.policy import SpecState

TRITON_ON_CPU = {"device": "cpu", "attention_backend": "triton", "lora_backend": "triton", "layer_backend": "triton"}


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 24]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_graph_batch_sizes(max_num_seqs: int, expected: list[int]) -> None:
    assert graph_batch_sizes(max_num_seqs) == expected


@pytest.mark.parametrize("max_num_seqs", [1, 5, 8, 9, 63, 64, 256, 1000])
def test_every_batch_has_a_bucket_that_pads_little(max_num_seqs: int) -> None:
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] <= MAX_GRAPH_BATCH
    for n in range(1, min(max_num_seqs, MAX_GRAPH_BATCH) + 1):
        bucket = graph_bucket(n, sizes)
        assert bucket is not None and bucket >= n
        assert bucket - n < (8 if n > 8 else n)  # at most 7 padding rows, or doubling below 8
    assert graph_bucket(sizes[-1] + 1, sizes) is None  # past the largest bucket: eager


def test_only_plain_decode_steps_replay() -> None:
    def seq(n_tokens: int, computed: int, proposed: list[int] | None = None) -> Sequence:
        s = Sequence("r", list(range(n_tokens)), SamplingParams())
        s.num_computed_tokens = computed
        if proposed:
            s.spec = SpecState(max_k=4, proposed=proposed)
        return s

    assert is_plain_decode([(seq(5, 4), 1), (seq(9, 8), 1)])
    assert not is_plain_decode([(seq(5, 4), 1), (seq(9, 0), 9)])  # a prefill in the step
    assert not is_plain_decode([(seq(9, 4), 1)])  # a chunk of a longer prompt
    assert not is_plain_decode([(seq(5, 4, [7, 8]), 3)])  # speculative proposals


def _work(adapters: dict[str, Path]) -> list[tuple[str | None, list[int], int]]:
    names = [*adapters, None, *adapters, None, None]
    return [(name, [3 + i, 9, 27, (11 * i) % 50, 5][: 2 + i % 4], 6 + i % 6) for i, name in enumerate(names)]


def _run(engine: LLMEngine, adapters: dict[str, Path], work: list) -> list[list[int]]:
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
        engine.adapters.prewarm(name, "host")
    ids, done = [], {}
    for i, (name, prompt, n) in enumerate(work):  # joins over several steps: buckets change as rows come and go
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=n), adapter_id=name))
        if i % 3 == 2:  # a request may finish here already (its adapter loaded in time): keep its output
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    done.update(run_all(engine, check_errors=True))
    assert all(done[i].error is None for i in ids)
    return [done[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def adapters(spec_adapters: dict[str, Path]) -> dict[str, Path]:
    return spec_adapters


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_static_decode_step_equals_the_plain_step(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Padding rows, the scratch block, every row's adapter slot (-1 for base rows) and the ranks refreshed as
    two device slots take turns among four adapters of ranks 2-16: the same tokens as the plain engine."""
    fields = {"block_size": 4, "num_kv_blocks": 128, "max_loras": 2, "max_lora_rank": 16, "max_num_seqs": 12}
    work = _work(adapters)
    plain = make_engine(tiny_llama_dir, disk_cache_dir=str(tmp_path / "a"), **TRITON_ON_CPU, **fields)
    assert plain.runner.graphs is None
    expected = _run(plain, adapters, work)
    monkeypatch.setattr(LLMEngine, "_graphs_mode", lambda self: "eager")
    engine = make_engine(tiny_llama_dir, disk_cache_dir=str(tmp_path / "b"), **TRITON_ON_CPU, **fields)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    assert engine.block_manager.num_blocks == 127 and engine.runner.kv_caches.shape[2] == 128  # + the scratch
    assert _run(engine, adapters, work) == expected
    assert graphs.num_replays >= 8 and graphs.num_lora_replays >= 4
    assert engine.adapters.manager.stats.evictions["device"] > 0  # slots changed hands between replays


def test_decode_tables_pad_each_rows_table_with_zeros() -> None:
    """The eager step's block tables (model_runner.decode_tables, filled through numpy): each row its table, then
    zeros to the widest, int64, as torch.tensor of the padded lists gave them."""
    tables = [[5, 9, 2], [7], [1, 2, 3, 4, 2**40]]
    got = decode_tables(tables)
    assert got.dtype == torch.int64
    assert got.tolist() == [[5, 9, 2, 0, 0], [7, 0, 0, 0, 0], [1, 2, 3, 4, 2**40]]


def test_slot_runs_group_one_adapters_rows() -> None:
    """The LoRA segments of a step's rows (none = 9: the base model): consecutive rows of one slot make one run,
    cut every `longest` rows; a slot seen again after another is a new run."""
    assert slot_runs([], 9) == []
    assert slot_runs([9, 9], 9) == []
    assert slot_runs([0, 0, 0, 1, 9, 1, 1, 0], 9) == [(0, 3, 0), (3, 1, 1), (5, 2, 1), (7, 1, 0)]
    assert slot_runs([2] * 7, 9, longest=3) == [(0, 3, 2), (3, 3, 2), (6, 1, 2)]
    assert slot_runs([-1, 4, 4, -1], -1, longest=16) == [(1, 2, 4)]


def _in_three_groups(engine: LLMEngine, name: str, path: Path) -> list[list[int]]:
    """8 requests on the adapter, a step, 4 on the base model, a step, 10 more on the adapter: the running rows
    interleave adapter and base runs."""
    engine.adapters.register(name, str(path))
    engine.adapters.prewarm(name, "host")
    groups = [[name] * 8, [None] * 4, [name] * 10]
    ids, done = [], {}
    for g, group in enumerate(groups):
        for i, adapter in enumerate(group):
            ids.append(
                engine.add_request(
                    [3 + i, 9, 27 + g, (7 * i) % 50], SamplingParams(max_new_tokens=6), adapter_id=adapter
                )
            )
        while not engine.scheduler.running or engine.scheduler.num_waiting:  # the group admitted, then one step
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    done.update(run_all(engine, check_errors=True))
    return [done[i].token_ids for i in ids]


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_one_adapters_rows_are_one_segment_up_to_a_programs_rows(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Running rows that came as adapter, base, adapter: the static step orders them by slot, so its segments are
    runs of one adapter, cut at ROWS_PER_PROGRAM (16) rows, and its tokens equal the plain engine's (whose eager
    batch orders and merges them alike)."""
    fields = {"block_size": 4, "num_kv_blocks": 256, "max_loras": 2, "max_lora_rank": 16, "max_num_seqs": 22}
    name, path = next(iter(adapters.items()))
    plain = make_engine(tiny_llama_dir, disk_cache_dir=str(tmp_path / "a"), **TRITON_ON_CPU, **fields)
    expected = _in_three_groups(plain, name, path)
    monkeypatch.setattr(LLMEngine, "_graphs_mode", lambda self: "eager")
    engine = make_engine(tiny_llama_dir, disk_cache_dir=str(tmp_path / "b"), **TRITON_ON_CPU, **fields)
    graphs = engine.runner.graphs
    assert graphs is not None
    seen: list[list[tuple[int, int, int]]] = []
    fill = graphs._fill

    def spy(seqs: list[Sequence]) -> bool:
        lora = fill(seqs)
        v = graphs.views
        segments = zip(v["seg_starts"], v["seg_lens"], v["seg_slots"], strict=True)
        seen.append([(int(a), int(n), int(s)) for a, n, s in segments if n])
        return lora

    monkeypatch.setattr(graphs, "_fill", spy)
    assert _in_three_groups(engine, name, path) == expected
    widest = max(seen, key=lambda segs: sum(n for _, n, _ in segs))
    assert [(a, n) for a, n, _ in widest] == [(4, 16), (20, 2)]  # the 4 base rows first, then 18 adapter rows
    assert len({s for _, _, s in widest}) == 1


@pytest.mark.gpu
def test_captured_graphs_equal_eager_on_cuda(tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    fields = {"block_size": 4, "num_kv_blocks": 128, "max_loras": 2, "max_lora_rank": 16, "max_num_seqs": 12}
    work = _work(adapters)
    eager = make_engine(tiny_llama_dir, device="cuda", enforce_eager=True, disk_cache_dir=str(tmp_path / "a"), **fields)
    assert eager.runner.graphs is None and "--enforce-eager" in eager.describe()
    engine = make_engine(tiny_llama_dir, device="cuda", disk_cache_dir=str(tmp_path / "b"), **fields)
    graphs = engine.runner.graphs
    assert graphs is not None and len(graphs.graphs) == 2 * len(graphs.sizes)
    assert "CUDA graphs" in engine.describe()
    assert _run(engine, adapters, work) == _run(eager, adapters, work)
    assert graphs.num_replays >= 8 and graphs.num_lora_replays >= 4
