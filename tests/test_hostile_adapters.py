"""Hostile adapter files and weights (issue 18, items 1, 2 and the adapter-config part of 7): a config
with NaN/huge/mistyped numbers or a pathological pattern is refused fast with a clear AdapterError; no
LoRA compute path lets one slot's NaN/inf reach another row; a request whose logits turn non-finite
fails alone; and through real HTTP, hostile adapters never change another tenant's greedy text."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import drain, make_engine
from safetensors.torch import load_file, save_file
from test_http_support import ADMIN_TOKEN, ServerProcess, admin_headers

from lora_helpers import make_peft_adapter
from loraplane_server.adapters.weights import AdapterError, LoRAWeights, load_lora
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.layers.linear import ProjectionLinear
from loraplane_server.executor.lora.backends import CPUKernelBackend, LoRABackend, TorchBackend, TritonBackend
from loraplane_server.executor.lora.slots import LoRASlots
from loraplane_server.executor.models.llama import ModelArgs
from loraplane_server.executor.models.loader import load_model, read_config
from loraplane_server.sampling_params import SamplingParams

FRENCH = Path(__file__).resolve().parent.parent / "server" / "examples" / "adapters" / "french"
PATHOLOGICAL = ".*" * 10 + "z"  # each extra ".*" multiplied a backtracking match's time by about 4


def smollm2_args(smollm2_dir: Path) -> ModelArgs:
    return ModelArgs.from_hf_config(read_config(smollm2_dir))


def french_copy(root: Path, name: str, **config: object) -> Path:
    """The French example adapter under root/name, with `config` merged into its adapter_config.json
    (written as Python's json writes it: NaN and Infinity as bare tokens, as a hostile file may)."""
    out = root / name
    shutil.copytree(FRENCH, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return out


def load(path: Path, args: ModelArgs, dtype: torch.dtype = torch.float32) -> LoRAWeights:
    return load_lora(path, path.name, args, 64, dtype)


# config and effective-adapter validation


HOSTILE_CONFIGS: dict[str, tuple[dict, str]] = {
    "alpha-nan": ({"lora_alpha": math.nan}, "lora_alpha"),
    "alpha-inf": ({"lora_alpha": math.inf}, "lora_alpha"),
    "alpha-1e300": ({"lora_alpha": 1e300}, "scale"),
    "alpha-string": ({"lora_alpha": "16"}, "lora_alpha"),
    "alpha-bool": ({"lora_alpha": True}, "lora_alpha"),
    "alpha-list": ({"lora_alpha": [16]}, "lora_alpha"),
    "r-string": ({"r": "8"}, "r="),
    "r-zero": ({"r": 0}, "r="),
    "r-negative": ({"r": -8}, "r="),
    "r-float": ({"r": 8.0}, "r="),
    "r-bool": ({"r": True}, "r="),
    "rank-pattern-list": ({"rank_pattern": ["q_proj", 8]}, "rank_pattern"),
    "rank-pattern-string-value": ({"rank_pattern": {"q_proj": "8"}}, "rank_pattern"),
    "rank-pattern-float-value": ({"rank_pattern": {"q_proj": 8.5}}, "rank_pattern"),
    "alpha-pattern-nan": ({"alpha_pattern": {"q_proj": math.nan}}, "alpha_pattern"),
    "alpha-pattern-huge": ({"alpha_pattern": {"v_proj": 1e300}}, "scale"),
    "alpha-pattern-string": ({"alpha_pattern": "q_proj"}, "alpha_pattern"),
    "alpha-pattern-regex": ({"alpha_pattern": {PATHOLOGICAL: 16}}, "alpha_pattern"),
    "rank-pattern-regex": ({"rank_pattern": {PATHOLOGICAL: 8}}, "rank_pattern"),
    "alpha-pattern-too-many": ({"alpha_pattern": {f"layers.{i}.q_proj": 16 for i in range(5000)}}, "alpha_pattern"),
    "rslora-string": ({"use_rslora": "yes"}, "use_rslora"),
    "targets-number": ({"target_modules": 5}, "target_modules"),
    "targets-nested": ({"target_modules": [["q_proj"]]}, "target_modules"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_hostile_config_is_a_clear_adapter_error(name: str, tmp_path: Path, smollm2_dir: Path) -> None:
    """Each is an AdapterError naming the field (never a TypeError or a Python exception's text), in
    milliseconds: before, NaN/1e300 alphas loaded (finiteness was checked before the scale) and the
    pattern held the GIL for seconds."""
    config, field = HOSTILE_CONFIGS[name]
    path = french_copy(tmp_path, name, **config)
    start = time.monotonic()
    with pytest.raises(AdapterError) as err:
        load(path, smollm2_args(smollm2_dir))
    assert time.monotonic() - start < 0.5
    assert field in str(err.value), err.value
    assert "Traceback" not in str(err.value) and "object" not in str(err.value).replace("an object", "")


def test_folded_weights_beyond_the_bound_are_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    """Finite in the file, but B x scale is far beyond any trained adapter (and overflows fp16)."""
    path = french_copy(tmp_path, "loud")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    loud = {k: v * 1e5 if "lora_B" in k else v for k, v in tensors.items()}
    save_file(loud, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AdapterError, match="lora_B times its scale reaches"):
        load(path, smollm2_args(smollm2_dir))
    overflow = {k: v.float() * 1e6 if "lora_B" in k else v for k, v in tensors.items()}  # past fp16's 65504
    save_file(overflow, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AdapterError, match="NaN or infinity in float16"):
        load(path, smollm2_args(smollm2_dir), torch.float16)


@pytest.mark.parametrize("name", ["french", "pirate", "json"])
def test_example_adapters_stay_valid(name: str, smollm2_dir: Path) -> None:
    weights = load(FRENCH.parent / name, smollm2_args(smollm2_dir), torch.bfloat16)
    assert weights.tensors and all(torch.isfinite(b).all() for _, b in weights.tensors.values())


def test_patterns_match_module_name_suffixes_as_peft_does(tmp_path: Path, smollm2_dir: Path) -> None:
    """alpha_pattern keys as PEFT's (.*\\.)?(key)$ matches them: the name, a suffix after a dot, or with a
    leading '^' the whole name; the first key that matches wins; a bare substring never matches."""
    args = smollm2_args(smollm2_dir)
    plain = load(french_copy(tmp_path, "plain"), args)
    patterns = {
        "^model.layers.0.self_attn.q_proj": 160,  # 10x on layer 0's q only
        "layers.1.self_attn.q_proj": 32,  # 2x on layer 1's q (a suffix after a dot)
        "v_proj": 48,  # 3x on every v
        "proj": 1600,  # not a dotted suffix of any module: matches nothing
        "^self_attn.q_proj": 1600,  # '^' asks for the whole name: matches nothing
    }
    patterned = load(french_copy(tmp_path, "patterned", alpha_pattern=patterns), args)
    expected = {(0, "q_proj"): 10.0, (1, "q_proj"): 2.0}
    for key, (_, b) in plain.tensors.items():
        factor = 3.0 if key[1] == "v_proj" else expected.get(key, 1.0)
        torch.testing.assert_close(patterned.tensors[key][1], b * factor, rtol=1e-6, atol=0.0)


# the LoRA compute: a slot's NaN/inf never reaches another row


def plant(slots: LoRASlots, slot: int, value: float) -> None:
    """Fill a device slot with NaN or inf, past any validation (every kind, layer, rank row and column)."""
    if slots.packed is not None:
        for packed in slots.packed.values():
            packed[:, slot] = value
        return
    for kind in slots.a:
        slots.a[kind][:, slot] = value
        slots.bt[kind][:, slot] = value


def projection_layers(model: torch.nn.Module) -> list[ProjectionLinear]:
    return [m for m in model.modules() if isinstance(m, ProjectionLinear)]


def run_layers(
    slots: LoRASlots,
    model: torch.nn.Module,
    decode: list[int],
    segments: list[tuple[int, int, int]],
    num: int,
    backend: LoRABackend,
) -> list[torch.Tensor]:
    """The LoRA output of every projection layer for one step's rows, from fixed random inputs."""
    gen = torch.Generator().manual_seed(7)
    outs = []
    for layer in projection_layers(model):
        dtype = slots.packed[layer.kind].dtype if slots.packed is not None else slots.a[layer.kind].dtype
        x = torch.randn(num, layer.in_features, generator=gen).to(dtype)
        out = torch.randn(num, layer.out_features, generator=gen).to(dtype)
        backend.prepare(slots, decode, segments, num).apply(layer, x, out)
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def same_rank_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("hostile-compute")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return [
        make_peft_adapter(tiny_llama_dir, root / f"all-{seed}", seed=seed, r=8, lora_alpha=16, target_modules=targets)
        for seed in (1, 2)
    ]


PATHS = {
    "torch-grouped": dict(dtype=torch.float32, packed=False, backend=TorchBackend),
    "torch-bgmv": dict(dtype=torch.float32, packed=False, backend=TorchBackend, dense_max=0),
    "triton": dict(dtype=torch.float32, packed=False, backend=TritonBackend),
    "cpu-kernel": dict(
        dtype=torch.bfloat16,
        packed=True,
        backend=CPUKernelBackend,
        marks=[pytest.mark.requires_bf16_kernels, pytest.mark.requires_cpu_kernels],
    ),
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("path", [pytest.param(name, marks=spec.get("marks", [])) for name, spec in PATHS.items()])
def test_a_poisoned_slot_never_reaches_other_rows(
    path: str,
    value: float,
    tiny_llama_dir: Path,
    same_rank_adapters: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows on slot 0, on the base model, and on slot 1 (decode rows mixed, then prefill runs). Slot 1
    full of NaN/inf: every other row's output is bit-identical to the same step with those rows on the
    base model instead (a run without that adapter), and slot 1's own rows are non-finite (the plant
    took). Before, the torch decode path masked other slots with a zero one-hot: 0 x NaN = NaN."""
    spec = PATHS[path]
    if "dense_max" in spec:
        monkeypatch.setattr(TorchBackend, "DENSE_MAX_SLOTS", spec["dense_max"])
    if path == "triton":
        pytest.importorskip("triton")
    dtype = spec["dtype"]
    model = load_model(tiny_llama_dir, dtype, torch.device("cpu"), 64)
    slots = LoRASlots(model.lora_shapes(), model.args.num_layers, 2, 8, dtype, torch.device("cpu"), spec["packed"])
    for slot, adapter in enumerate(same_rank_adapters):
        slots.load(slot, load_lora(adapter, adapter.name, model.args, 8, dtype))
    none = slots.none_slot
    decode = [0, 1, none, 0, 1, none, 1]
    segments = [(7, 11, 0), (11, 14, 1)]  # rows 14..15: a base-model prefill chunk
    num = 16
    hostile = [i for i, s in enumerate(decode) if s == 1] + list(range(11, 14))
    clean_decode = [none if s == 1 else s for s in decode]
    backend = spec["backend"](torch.device("cpu"))
    reference = run_layers(slots, model, clean_decode, segments[:1], num, backend)
    plant(slots, 1, value)
    poisoned = run_layers(slots, model, decode, segments, num, backend)
    others = [i for i in range(num) if i not in hostile]
    for ref, out in zip(reference, poisoned, strict=True):
        assert torch.equal(out[others], ref[others])
        assert not torch.isfinite(out[hostile]).all(dim=-1).any()


# the run-time guard: non-finite logits fail their request alone


def tiny_engine(model_dir: Path, adapter_dir: Path) -> LLMEngine:
    """A float32 engine on the torch paths (LoRA grouped decode, gather + SDPA decode attention)."""
    return make_engine(
        model_dir,
        adapter_dir=str(adapter_dir),
        max_loras=4,
        max_lora_rank=8,
        num_kv_blocks=64,
        attention_backend="torch",
        layer_backend="torch",
        lora_backend="torch",
        disk_cache_dir=str(adapter_dir.parent / "disk-cache"),
    )


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_nonfinite_logits_fail_only_their_request(
    when: str, tiny_llama_dir: Path, same_rank_adapters: list[Path], tmp_path: Path
) -> None:
    """Base, clean-adapter and poisoned-adapter requests in one batch; the poisoned adapter's slot turns
    NaN (validation bypassed: what a run-time overflow would look like) before its prefill or after a
    few decode steps. It finishes with an error naming its adapter; the others' greedy tokens equal an
    idle engine's and every KV block comes back. Before, the NaN spread to every row and nothing failed."""
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    for name, src in zip(("clean", "poisoned"), same_rank_adapters, strict=True):
        shutil.copytree(src, adapter_dir / name)
    # the clean request's block table is the longest, so the others' are padded in decode attention
    prompts = {"poisoned": list(range(3, 9)), None: list(range(40, 46)), "clean": list(range(100, 150))}
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    idle = tiny_engine(tiny_llama_dir, adapter_dir)
    for adapter in (None, "clean"):
        idle.add_request(prompts[adapter], params, f"req-{adapter}", adapter)
    expected = drain(idle)

    engine = tiny_engine(tiny_llama_dir, adapter_dir)
    slots = engine.runner.lora_slots
    if when == "prefill":
        load_slot = slots.load

        def load_then_poison(slot: int, weights: LoRAWeights) -> None:
            load_slot(slot, weights)
            if weights.adapter_id == "poisoned":
                plant(slots, slot, math.nan)

        slots.load = load_then_poison  # type: ignore[method-assign]
    engine.add_request(prompts["poisoned"], params, "req-poisoned", "poisoned")
    if when == "decode":  # its prefill alone first: it holds KV block 0, which shorter block tables pad with
        while engine.requests["req-poisoned"].num_output_tokens == 0:  # (its adapter loads in the background)
            engine.step()
        assert engine.requests["req-poisoned"].block_table == [0]
    for adapter in (None, "clean"):
        engine.add_request(prompts[adapter], params, f"req-{adapter}", adapter)
    done = {}
    if when == "decode":
        done = drain(engine, steps=3)
        assert not done and engine.requests["req-poisoned"].num_output_tokens >= 2
        slot = engine.slots.lookup("poisoned")
        assert slot is not None
        plant(slots, slot, math.nan)
    done.update(drain(engine))
    failed = done["req-poisoned"]
    assert failed.finish_reason == "error" and "NaN or infinite" in (failed.error or "")
    assert "'poisoned'" in (failed.error or "")
    for adapter in (None, "clean"):
        assert done[f"req-{adapter}"].error is None
        assert done[f"req-{adapter}"].token_ids == expected[f"req-{adapter}"].token_ids
        assert len(done[f"req-{adapter}"].token_ids) == 12
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# through real HTTP on the built-in model


QUESTION = "What is the capital of France?"


def chat(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0}
    return client.post("/v1/chat/completions", json=body, timeout=120)


def chat_text(client: httpx.Client, model: str) -> str:
    response = chat(client, model)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


class HealthProbe(threading.Thread):
    """Times /health every 50 ms until stopped; `worst` is the slowest answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.worst, self.count = url, 0.0, 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop_event.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                self.worst, self.count = max(self.worst, time.monotonic() - start), self.count + 1
                time.sleep(0.05)


@pytest.mark.slow
def test_hostile_adapters_over_http_leave_other_tenants_alone(tmp_path: Path) -> None:
    """A real `loraplane serve` with the French adapter and three hostile copies of it (lora_alpha NaN,
    1e300, a pathological alpha_pattern). Chatting with each, and loading copies through POST
    /v1/adapters and /v1/load_lora_adapter, is a 4xx naming the field, while concurrent French and
    base-model chats answer exactly what they answered before, and /health stays fast. Before, the NaN
    and 1e300 copies loaded (200) and turned French and base answers into "La" and "The"."""
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    shutil.copytree(FRENCH, adapters / "french")
    hostile = {
        "fr-nan": ({"lora_alpha": math.nan}, "lora_alpha"),
        "fr-huge": ({"lora_alpha": 1e300}, "scale"),
        "fr-regex": ({"alpha_pattern": {PATHOLOGICAL: 16}}, "alpha_pattern"),
    }
    server = ServerProcess(["--adapter-dir", str(adapters), "--admin-token", ADMIN_TOKEN], tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url) as client:
            base = client.get("/v1/models").json()["data"][0]["id"]
            before = {model: chat_text(client, model) for model in ("french", base)}
            assert "Paris" in before["french"] and before["french"] != before[base]
            for name, (config, _) in hostile.items():
                french_copy(adapters, name, **config)
            probe = HealthProbe(server.url)
            probe.start()
            results = run_concurrently(server.url, base, adapters, hostile)
            probe.stop_event.set()
            probe.join()
        for model in ("french", base):
            assert results[f"good-{model}"] == [before[model]] * 3, server.log()
        for name, (_, field) in hostile.items():
            for key in (f"chat-{name}", f"admin-{name}", f"vllm-{name}"):
                statuses = [r.status_code for r in results[key]]
                assert all(400 <= s < 500 for s in statuses), (key, [r.text for r in results[key]])
            assert all(field in r.text for r in results[f"admin-{name}"] + results[f"vllm-{name}"])
        assert probe.count > 10 and probe.worst < 1.0, probe.worst
    finally:
        server.stop()


def run_concurrently(url: str, base: str, adapters: Path, hostile: dict) -> dict[str, list]:
    """Hostile chats and loads (two of each), and three French and three base-model chats, all at once."""
    jobs: dict[str, list[Callable[[httpx.Client], object]]] = {"good-french": [], f"good-{base}": []}
    for _ in range(3):
        jobs["good-french"].append(lambda c: chat_text(c, "french"))
        jobs[f"good-{base}"].append(lambda c: chat_text(c, base))
    for name in hostile:
        source = str(adapters / name)
        jobs[f"chat-{name}"] = [lambda c, n=name: chat(c, n)] * 2
        jobs[f"admin-{name}"] = [
            lambda c, n=name, s=source, i=i: c.post(
                "/v1/adapters",
                json={"id": f"{n}-copy{i}", "source": s, "tier": "device", "wait": True},
                headers=admin_headers(),
                timeout=120,
            )
            for i in range(2)
        ]
        jobs[f"vllm-{name}"] = [
            lambda c, n=name, s=source, i=i: c.post(
                "/v1/load_lora_adapter",
                json={"lora_name": f"{n}-vllm{i}", "lora_path": s},
                headers=admin_headers(),
                timeout=120,
            )
            for i in range(2)
        ]
    results: dict[str, list] = {key: [None] * len(fns) for key, fns in jobs.items()}

    def work(key: str, i: int, fn: Callable[[httpx.Client], object]) -> None:
        with httpx.Client(base_url=url) as client:
            try:
                results[key][i] = fn(client)
            except (AssertionError, httpx.HTTPError) as exc:  # kept for the test's message
                results[key][i] = f"failed: {exc!r}"

    threads = [
        threading.Thread(target=work, args=(key, i, fn)) for key, fns in jobs.items() for i, fn in enumerate(fns)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results
