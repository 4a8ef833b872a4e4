"""Checkpoints that are int8 already (issue 24): compressed-tensors, written here by the compressed-tensors
library itself as llm-compressor would, and GGUF Q8_0, written by gguf-py (llama.cpp's own Python package) from
the built-in model. Their weights against the formats' own readers (compressed-tensors' decompression through
transformers, transformers' GGUF dequantization), the engine against PEFT on the decompressed model token for
token, the Q8_0 model's perplexity against bf16's, and the formats the engine refuses, with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine
from safetensors.torch import load_file, save_file
from test_quantization import assert_matches_peft, peft_adapters_and_work

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.layers.linear import ProjectionLinear
from loraplane_server.executor.models.loader import load_model
from loraplane_server.executor.models.quantized import (
    UnsupportedQuantizationError,
    checkpoint_quantization,
    compressed_tensors_config,
    unpack_int8,
)
from loraplane_server.store.gguf_models import find_gguf, write_q8_0
from loraplane_server.store.models import resolve
from loraplane_server.store.sources import ModelSourceError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# what config.json may announce


def _ct(weights: dict | None = None, **top: object) -> dict:
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"} | (weights or {})
    group = {"targets": ["Linear"], "weights": w, "input_activations": None}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group}}
    return {"quantization_config": qc | top}


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "'awq'"),
        ({"quantization_config": {"load_in_4bit": True}}, "bitsandbytes"),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, "'fp8'"),
        (_ct({"num_bits": 4}), "int4 weights"),
        (_ct({"type": "float"}), "float8 weights"),
        (_ct({"symmetric": False}), "asymmetric"),
        (_ct({"strategy": "tensor"}), "'tensor' scale"),
        (_ct({"strategy": "group", "group_size": None}), "group_size"),
        (_ct({"strategy": "group", "group_size": 128, "actorder": "group"}), "activation-ordered"),
        (_ct(format="nvfp4-pack-quantized"), "'nvfp4-pack-quantized'"),
        (_ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "quantized KV cache"),
    ],
)
def test_unsupported_quantization_is_refused_with_what_to_do(config: dict, named: str) -> None:
    with pytest.raises(UnsupportedQuantizationError) as err:
        checkpoint_quantization({"model_type": "llama"} | config)
    message = str(err.value)
    assert named in message and "compressed-tensors int8" in message and "--quantization int8" in message


def test_loadable_quantization_configs() -> None:
    assert checkpoint_quantization({"model_type": "llama"}) is None
    channel = checkpoint_quantization(_ct())
    assert channel is not None and channel.strategies == ("channel",) and not channel.activations
    group = checkpoint_quantization(_ct({"strategy": "group", "group_size": 128}))
    assert group is not None and group.strategies == ("group",)
    ours = checkpoint_quantization({"quantization_config": compressed_tensors_config(32, ["lm_head"])})
    assert ours is not None and ours.formats == ("naive-quantized",) and ours.strategies == ("group",)


def test_a_checkpoint_of_an_unsupported_format_fails_before_loading(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The model cache's verification (the same check runs on an hf:// or s3:// config.json before any shard is
    fetched) and an engine start both say what is wrong and what to serve instead."""
    model = tmp_path / "gptq"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match="quant_method 'gptq' is not supported"):
        resolve(str(model), tmp_path / "cache")
    with pytest.raises(ModelSourceError, match="--quantization int8 to quantize it at load"):
        LLMEngine(EngineConfig(model=str(model), model_cache=str(tmp_path / "cache")))


def test_unpack_int8_is_compressed_tensors_layout() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (5, 37), generator=gen, dtype=torch.int8)  # K not a multiple of 4
    packed = pack_to_int32(q, 8)
    assert torch.equal(unpack_int8(packed, torch.tensor([5, 37])), q)


# compressed-tensors checkpoints


def write_compressed_tensors(
    src: Path, out: Path, strategy: str, fmt: str, exact_scale: bool = False, group_size: int = 16
) -> Path:
    """src quantized by the compressed-tensors library: its QuantizationConfig applied to the transformers
    model, the scales an observer would set (min/max through its calculate_qparams; or amax / 127 with
    exact_scale, so no weight lands on -128), compressed in format fmt, saved as llm-compressor saves."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    group = group_size if strategy == "group" else None
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy=strategy, group_size=group)
    acts = None
    if fmt == "int-quantized":  # W8A8: the activations' settings ride along (the engine quantizes its own)
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            w = w.view(w.shape[0], -1, group_size) if strategy == "group" else w.unsqueeze(1)
            if exact_scale:
                scale = w.abs().amax(-1) / 127
            else:
                scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), weights)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    return out


def decompressed(checkpoint: Path, out: Path | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint as transformers loads it (compressed-tensors decompresses it to float weights); saved as
    an ordinary float checkpoint in out if given."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if out is not None:
        out.mkdir(parents=True)
        for f in checkpoint.iterdir():
            if f.suffix != ".safetensors" and f.is_file():
                (out / f.name).write_bytes(f.read_bytes())
        config = json.loads((out / "config.json").read_text())
        config.pop("quantization_config")
        (out / "config.json").write_text(json.dumps(config))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return state


def projections(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each decoder projection's weight as the model holds it (int8 dequantized), by checkpoint name."""
    out = {}
    for module in model.modules():
        if isinstance(module, ProjectionLinear):
            w = module.weight.float()
            if module.int8:
                assert module.weight_scale is not None and module.weight_sum is not None
                assert torch.equal(module.weight_sum, module.weight.sum(1, dtype=torch.int32))
                w = w * module.weight_scale[:, None]
            for name, (lo, hi) in module.slices.items():
                part = "self_attn" if name in PROJECTIONS[:4] else "mlp"
                out[f"model.layers.{module.layer_idx}.{part}.{name}.weight"] = w[lo:hi]
    return out


@pytest.mark.isa_agnostic
@pytest.mark.parametrize(
    ("strategy", "fmt"),
    [("channel", "pack-quantized"), ("group", "pack-quantized"), ("channel", "int-quantized")],
)
def test_compressed_tensors_weights_load_as_written(
    tiny_llama_dir: Path, tmp_path: Path, strategy: str, fmt: str
) -> None:
    """Every projection loads as int8 with its own scale per channel: equal to what compressed-tensors itself
    decompresses, but for the weights it put at -128 (one step off, at -127); group scales requantized per
    channel, within half a channel step. The lm_head it left alone stays float."""
    checkpoint = write_compressed_tensors(tiny_llama_dir, tmp_path / "ct", strategy, fmt)
    reference = decompressed(checkpoint)
    raw = load_file(str(checkpoint / "model.safetensors"))
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), 128)
    assert model.int8
    ours = projections(model)
    assert set(ours) == {k for k in reference if k.split(".")[-2] in PROJECTIONS}
    for name, w in ours.items():
        module = [m for m in model.modules() if isinstance(m, ProjectionLinear) and name.split(".")[-2] in m.slices]
        assert module and all(m.weight.dtype == torch.int8 for m in module)
        step = reference[name].abs().amax(1, keepdim=True) / 127
        if strategy == "channel":
            base = name.removesuffix(".weight")
            q = raw[base + ".weight"] if fmt == "int-quantized" else unpack_int8(raw[base + ".weight_packed"], None)
            at_min = q == -128
            exact = ~at_min
            assert torch.equal(w[exact], reference[name][exact]), name
            scale = raw[base + ".weight_scale"].float().expand_as(w)
            torch.testing.assert_close(w[at_min], reference[name][at_min] + scale[at_min])
        else:
            assert bool(((w - reference[name]).abs() <= step / 2 * 1.0001 + 1e-7).all()), name
    lm_head = model.lm_head if model.lm_head is not None else model.embed_tokens
    assert lm_head.weight.dtype == torch.float32
    assert torch.equal(lm_head.weight, reference["lm_head.weight"])


def test_compressed_tensors_engine_matches_peft_on_the_decompressed_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """fp32 activations: a mixed batch of adapters of different ranks and base requests on a pack-quantized
    checkpoint gives, token for token, what transformers and PEFT give on the model compressed-tensors
    decompresses, each adapter alone. No -128 in it (scales of amax / 127), so the weights are the same."""
    checkpoint = write_compressed_tensors(tiny_llama_dir, tmp_path / "ct", "channel", "pack-quantized", True)
    reference = tmp_path / "decompressed"
    decompressed(checkpoint, reference)
    adapters, work = peft_adapters_and_work(tiny_llama_dir, tmp_path, 7)
    engine = make_engine(
        checkpoint, block_size=4, num_kv_blocks=128, max_loras=4, max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk-cache"),
    )  # fmt: skip
    assert engine.runner.model.int8 and "int8 weights" in engine.describe()
    assert_matches_peft(engine, reference, adapters, work)


# GGUF Q8_0


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the Q8_0 GGUF file, its directory in a model cache)."""
    root = tmp_path_factory.mktemp("q8_0")
    gguf_file = write_q8_0(find_gguf("smollm2-135m"), root / "smollm2-135m.Q8_0.gguf")
    return gguf_file, resolve(str(gguf_file), root / "cache")


@pytest.mark.isa_agnostic
def test_q8_0_gguf_converts_to_int8_without_a_float_copy(q8_0: tuple[Path, Path]) -> None:
    """The converted directory keeps each projection's Q8_0 bytes as int8 with its 32-weight scales (no
    dequantization), announced as compressed-tensors; dequantized, they are exactly what transformers' GGUF
    reader gives (its name map and Llama's q/k row order included)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file, converted = q8_0
    config = json.loads((converted / "config.json").read_text())
    check = checkpoint_quantization(config)
    assert check is not None and check.strategies == ("group",)
    state = load_file(str(converted / "model.safetensors"))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(converted)))
    theirs = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    names = [k for k in state if k.endswith(".weight") and k.split(".")[-2] in PROJECTIONS]
    assert len(names) == 7 * config["num_hidden_layers"]
    for name in names:
        q, scale = state[name], state[name.removesuffix("weight") + "weight_scale"]
        assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape[1] * 32 == q.shape[1]
        ours = (q.float().view(q.shape[0], -1, 32) * scale.float()[..., None]).view(q.shape)
        assert torch.equal(ours, theirs[name].float()), name
    for name, t in state.items():  # everything else: gguf-py's dequantization, as before
        if name not in names and not name.endswith("weight_scale"):
            assert torch.equal(t, theirs[name].float()), name


@pytest.mark.requires_bf16_kernels
def test_q8_0_gguf_serves_int8_within_the_accuracy_bound(q8_0: tuple[Path, Path], smollm2_dir: Path) -> None:
    """The Q8_0 model, served as int8 (scales requantized per channel), against the bf16 model it was made
    from: perplexity within 3% and next-token agreement >= 85% on the project's evaluation text; its
    projections take int8's bytes."""
    from test_quantization import _accuracy, weight_bytes

    acc = _accuracy()
    text = acc.EVAL_TEXT.read_text()
    common = dict(dtype="bfloat16", num_kv_blocks=512, max_model_len=1024)
    bf16 = LLMEngine(EngineConfig(model=str(smollm2_dir), **common))  # type: ignore[arg-type]
    ids = acc.text_ids(bf16, text)
    ref = acc.score_tokens(bf16, ids)
    bf16_bytes = weight_bytes(bf16)
    del bf16
    int8 = LLMEngine(EngineConfig(model=str(q8_0[1]), **common))  # type: ignore[arg-type]
    assert "int8 weights" in int8.describe() and int8.runner.model.fused_layers
    assert weight_bytes(int8) <= 0.55 * bf16_bytes
    cand = acc.score_tokens(int8, ids)
    ratio = cand.perplexity / ref.perplexity
    top1 = (ref.top1 == cand.top1).double().mean().item()
    assert 0.97 <= ratio <= 1.03, (ref.perplexity, cand.perplexity)
    assert top1 >= 0.85, top1
