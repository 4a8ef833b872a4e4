"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE, GQA attention, SwiGLU; and the
base classes of the other families (executor/models/qwen3.py, phi3.py, gemma3.py), which set what differs.

Every projection an adapter may target (q, k, v, o, gate, up, down) is a ProjectionLinear.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplane_server.executor.attention import AttentionBackend, TorchAttention
from loraplane_server.executor.forward_batch import ForwardBatch
from loraplane_server.executor.layers.linear import ProjectionLinear, base_linear
from loraplane_server.executor.layers.norm import RMSNorm
from loraplane_server.executor.layers.rotary import RotaryEmbedding, apply_rotary, rope_attention_scaling
from loraplane_server.executor.lora.backends.base import LoRABatch
from loraplane_server.executor.lora.layout import LayerShape
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.kernels import cpu_kernels, triton_layer_ops

if TYPE_CHECKING:
    from loraplane_server.executor.backends import Backends


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, qk_norm: type[RMSNorm] | None = None) -> None:
        """qk_norm: a per-head norm class for q and k before rotary (Qwen3, Gemma 3); None: none."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv = ProjectionLinear(
            args.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, args.qkv_bias, "qkv", layer_idx
        )
        self.o = ProjectionLinear(q, {"o_proj": args.hidden_size}, False, "o", layer_idx)
        self.q_norm = qk_norm(args.head_dim, args.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(args.head_dim, args.rms_norm_eps) if qk_norm else None
        self.scale = args.attention_scale or args.head_dim**-0.5
        self.kernel_rotary = args.is_llama_shaped  # the CPU rotary kernel rotates whole heads
        self.layer_idx = layer_idx
        self.window = args.window(layer_idx)  # sliding attention window, 0: full
        self.kernels = False  # the bf16 CPU layer kernels; this and the backend: LlamaForCausalLM.use_backends
        self.triton = False  # the Triton layer ops (CUDA): rotary
        self.backend: AttentionBackend = TorchAttention()

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        rows: ForwardBatch | None = None,
    ) -> torch.Tensor:
        """With `rows` (the logits rows' view of the step), attention runs for every row and the o
        projection for batch.logits_indices' rows alone."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x, batch).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kernels and q.dtype == torch.bfloat16 and self.kernel_rotary:
            cpu_kernels.rotary_(q, k, *cos_sin)  # in place
        elif self.triton and cos_sin[0].shape[-1] == self.head_dim:  # whole heads rotated
            triton_layer_ops.rotary_(q, k, *cos_sin)  # in place
        else:
            q, k = apply_rotary(q, k, *cos_sin)
        # a sliding layer of a model with global layers too: its own KV pool's slots and tables
        kv_batch = batch.window_batch if self.window and batch.window_batch is not None else batch
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], kv_batch, self.scale, self.window)  # [T, H, D]
        if rows is not None and batch.logits_indices is not None:
            return self.o(out.reshape(t, q_size)[batch.logits_indices], rows)
        return self.o(out.reshape(t, q_size), batch)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up = ProjectionLinear(
            args.hidden_size, {"gate_proj": inter, "up_proj": inter}, args.mlp_bias, "gate_up", layer_idx
        )
        self.down = ProjectionLinear(inter, {"down_proj": args.hidden_size}, args.mlp_bias, "down", layer_idx)
        self.intermediate_size = inter
        self.hidden_act = args.hidden_act
        self.kernels = False  # the bf16 CPU layer kernels (LlamaForCausalLM.use_backends)
        self.triton = False  # the Triton layer ops (CUDA): SiLU-and-multiply

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.hidden_act != "silu":  # the CPU kernels fuse SiLU only
            gate, up = self.gate_up(x, batch).split(self.intermediate_size, dim=-1)
            return self.down(F.gelu(gate, approximate="tanh") * up, batch)
        kernels = self.kernels and x.dtype == torch.bfloat16
        if kernels and x.stride(-1) == 1 and (batch.lora is None or not batch.lora.targets(self.gate_up)):
            # no LoRA delta to add between the two: the activation runs in the GEMM's epilogue
            return self.down(self.gate_up.silu_mul(x), batch)
        gate_up = self.gate_up(x, batch)
        if kernels:
            return self.down(cpu_kernels.silu_mul(gate_up), batch)
        if self.triton and gate_up.stride(-1) == 1:
            return self.down(triton_layer_ops.silu_mul(gate_up), batch)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down(F.silu(gate) * up, batch)


@dataclass
class FusedStep:
    """One step's arguments to cpu_kernels.decoder_layer that every layer shares."""

    step: list[torch.Tensor | None]  # cos, sin, slot_mapping, decode tables, decode lengths, LoRA row slots
    last_step: list[torch.Tensor | None]  # step + the logits rows and their LoRA slots where the step prunes
    chunk_tables: list[torch.Tensor]
    chunks: list[int]  # (query_start, tokens, context) per prefill chunk
    lora: LoRABatch | None
    skip_slot: int
    last_layer: int


class DecoderLayer(nn.Module):
    norm_class: type[RMSNorm] = RMSNorm
    qk_norm: type[RMSNorm] | None = None

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx, self.qk_norm)
        self.post_attention_layernorm = self.norm_class(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, layer_idx)
        self.kernels = False  # the bf16 CPU layer kernels (LlamaForCausalLM.use_backends)
        # this layer's weights for cpu_kernels.decoder_layer, gathered at load where the layers fuse
        self.fused_weights: torch.ScriptObject | None = None

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        next_norm: RMSNorm | None,
        rows: ForwardBatch | None = None,
    ) -> torch.Tensor:
        """x: the residual stream, updated in place; h: input_layernorm(x). Returns next_norm(x) after
        this layer (the next layer's h; each norm is fused with the residual add before it), or, for
        the last layer (next_norm None), x itself. With `rows` (last layer only), everything after
        attention runs on batch.logits_indices' rows, and x's rows at those indices are returned."""
        a = self.self_attn(h, cos_sin, kv_cache, batch, rows)
        if rows is not None and batch.logits_indices is not None:
            x, batch = x[batch.logits_indices], rows
        h = self.post_attention_layernorm.add_forward(x, a, self.kernels)
        m = self.mlp(h, batch)
        if next_norm is None:
            return x.add_(m)
        return next_norm.add_forward(x, m, self.kernels)

    def gather_fused_weights(self, next_norm: RMSNorm | None) -> None:
        """cpu_kernels.layer_weights for this layer (next_norm: the next layer's input norm; None for the
        last layer): built once at load, so a step passes one object per layer."""
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        weights: list[torch.Tensor | None] = [attn.qkv.weight, attn.qkv.bias, attn.o.weight, post.weight]
        weights += [mlp.gate_up.weight]
        weights += [mlp.gate_up.bias, mlp.down.weight, mlp.down.bias, next_norm.weight if next_norm else None]
        eps = (post.eps, next_norm.eps if next_norm else 0.0)
        heads = (attn.num_heads, attn.num_kv_heads)
        self.fused_weights = cpu_kernels.layer_weights(weights, heads, attn.scale, eps, attn.window)
        if attn.qkv.int8:  # the four projections' scales and row sums
            parts = [(p.weight_scale, p.weight_sum) for p in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
            self.fused_weights.set_int8([t for pair in parts for t in pair])  # type: ignore[attr-defined]

    def fused(
        self, x: torch.Tensor, h: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, f: FusedStep
    ) -> torch.Tensor:
        """forward() as one call to the CPU kernels (bf16): the same kernels in the same order, the same bits
        (tests/kernels/test_cpu_decoder_layer.py); the last layer (no next norm) on the logits rows alone
        where the step prunes to them, as forward() with `rows`."""
        assert self.fused_weights is not None, "gather_fused_weights first"
        lora: list[torch.Tensor | None] = (
            f.lora.fused_layer_args(self.self_attn.layer_idx) if f.lora is not None else [None] * 12
        )
        last = self.self_attn.layer_idx == f.last_layer
        return cpu_kernels.decoder_layer(
            x,
            h,
            self.fused_weights,
            kv_cache[0],
            kv_cache[1],
            f.last_step if last else f.step,
            f.chunk_tables,
            f.chunks,
            lora,
            batch.num_decode_tokens,
            f.skip_slot,
        )


class LlamaForCausalLM(nn.Module):
    # whether cpu_kernels.decoder_layer computes this family's layer: a family whose layer computes anything
    # that kernel does not sets it False (the switch is EngineConfig.fuse_layers)
    can_fuse_layers: bool = True
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(args, i) for i in range(args.num_layers))
        self.norm = self.layer_class.norm_class(args.hidden_size, args.rms_norm_eps)
        scaling = rope_attention_scaling(args.rope_scaling, args.max_position_embeddings)
        self.rotary = RotaryEmbedding(
            args.rotated_dims, max_positions, args.rope_theta, args.rope_scaling, scaling, args.max_position_embeddings
        )
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)
        # the torch paths until use_backends
        self.kernels = False  # the bf16 CPU layer kernels
        self.fused_layers = False  # layers before the last through cpu_kernels.decoder_layer, where it applies

    def quantize_int8(self) -> None:
        """Every decoder projection as int8 with a scale per output channel (executor/layers/quant.py). The lm_head
        keeps the dtype: as int8 too (the same quantization, its own copy of a tied embedding) the evaluation text's
        perplexity rose 3.0% over bf16's against 2.5% without it (bench/accuracy.py, issue 24's bound is 3%)."""
        for module in self.modules():
            if isinstance(module, ProjectionLinear):
                module.quantize_int8()

    @property
    def int8(self) -> bool:
        """Whether the decoder's projections are int8 (quantized at load, or a pre-quantized checkpoint)."""
        return any(isinstance(m, ProjectionLinear) and m.int8 for m in self.modules())

    def use_backends(self, backends: Backends) -> None:
        """Hands the backends resolved once at engine start (backends.py) to every layer: from then on the
        layers read them from themselves, never from a step's batch."""
        self.kernels = backends.layer_kernels
        self.fused_layers = (
            backends.fuse_layers
            and backends.layer_kernels
            and backends.attention.cpu_kernels  # the fused layer attends with those kernels
            and self.can_fuse_layers
            and self.args.is_llama_shaped
        )
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backends.attention
            if isinstance(module, Attention | MLP | DecoderLayer | ProjectionLinear):
                module.kernels = backends.layer_kernels
            if isinstance(module, Attention | MLP | RMSNorm):
                module.triton = backends.layer_triton
        layers = self.decoder_layers
        for i, layer in enumerate(layers):
            if self.fused_layers:
                layer.gather_fused_weights(layers[i + 1].input_layernorm if i + 1 < len(layers) else None)
            else:
                layer.fused_weights = None

    def forward(
        self, input_ids: torch.Tensor, kv_caches: torch.Tensor | list[torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids [T] -> logits [S, V] for the rows in batch.logits_indices. kv_caches: each layer's
        [2, N, B, KVH, D] (the rows of one [L, 2, ...] tensor, or views into two pools, engine/kv_groups.py)."""
        x = self.embed(input_ids)  # [T, hidden]: the residual stream (a fresh tensor, updated in place)
        kernels = self.kernels and x.dtype == torch.bfloat16
        cos_sins = self.cos_sins(batch.positions, x.dtype, kernels)
        layers = self.decoder_layers
        h = layers[0].input_layernorm.add_forward(x, None, kernels)
        last = len(layers) - 1
        rows = batch.logits_rows_batch() if batch.prunes_last_layer else None
        fused = self._fused_step(batch, cos_sins[0]) if kernels and self.fused_layers else None
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if fused is not None:
                h = layer.fused(x, h, kv_cache, batch, fused)
            elif i < last:
                h = layer(x, h, cos_sins[i], kv_cache, batch, layers[i + 1].input_layernorm)
            else:
                h = layer(x, h, cos_sins[i], kv_cache, batch, None, rows)
        if batch.logits_indices is not None and rows is None:
            h = h[batch.logits_indices]
        h = self.norm.add_forward(h.contiguous(), None, kernels)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return base_linear(h, weight, None, self.kernels)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """self.layers as what it holds (an nn.ModuleList's items are plain Modules to a type checker)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def cos_sins(
        self, positions: torch.Tensor, dtype: torch.dtype, kernels: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos and sin ([T, 1, D]; [T, D] for the CPU rotary kernel). One rope for every layer here."""
        cos_sin = self.rotary.cos_sin(positions, dtype)
        if kernels and self.args.is_llama_shaped:
            cos_sin = cos_sin[0].squeeze(1), cos_sin[1].squeeze(1)
        return [cos_sin] * len(self.layers)

    def _fused_step(self, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> FusedStep | None:
        """The step's arguments to cpu_kernels.decoder_layer, or None where the fused layer does not
        apply (the Python layers then run the same kernels one by one)."""
        if batch.window_batch is not None:  # two KV pools: the fused layer reads one
            return None
        lora = batch.lora
        row_slots = lora.fused_row_slots() if lora is not None else None
        if lora is not None and row_slots is None:  # the backend's slots are not what the fused layer reads
            return None
        if batch.prefills and not cpu_kernels.prefill_kernel_applies_to(torch.bfloat16, self.args.head_dim):
            return None
        step = [*cos_sin, batch.slot_mapping, batch.decode_block_tables, batch.decode_context_lens, row_slots]
        last_step = [*step, None, None]
        if batch.prunes_last_layer:
            rows_lora = batch.logits_lora
            rows_slots = rows_lora.fused_row_slots() if rows_lora is not None else None
            if rows_lora is not None and rows_slots is None:
                return None
            last_step[6:] = [batch.logits_indices, rows_slots]
        tables = [c.block_table for c in batch.prefills]
        chunks = [n for c in batch.prefills for n in (c.query_start, c.num_query_tokens, c.num_context_tokens)]
        skip = lora.slots.none_slot if lora is not None else -1
        return FusedStep([*step, None, None], last_step, tables, chunks, lora, skip, len(self.layers) - 1)

    def lora_shapes(self) -> list[LayerShape]:
        """Each merged projection layer's shape, as the LoRA slots lay them out (the same in every layer)."""
        return [m.lora_shape() for m in self.modules() if isinstance(m, ProjectionLinear) and m.layer_idx == 0]

    def projection(self, layer: int, name: str) -> ProjectionLinear:
        """The ProjectionLinear holding target module `name` of layer `layer`."""
        block = self.decoder_layers[layer]
        holder = {
            "q_proj": block.self_attn.qkv,
            "k_proj": block.self_attn.qkv,
            "v_proj": block.self_attn.qkv,
            "o_proj": block.self_attn.o,
            "gate_proj": block.mlp.gate_up,
            "up_proj": block.mlp.gate_up,
            "down_proj": block.mlp.down,
        }
        return holder[name]
