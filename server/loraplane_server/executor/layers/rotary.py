"""Rotary position embeddings (default, linear, Llama 3, YaRN and LongRoPE frequency scaling; full or partial
rotary dims), cos/sin cached once.

LongRoPE has two sets of factors. transformers (modeling_rope_utils' longrope_frequency_update) takes the long
ones for a whole forward call whose largest position + 1 exceeds original_max_position_embeddings, the short
ones otherwise, and Phi3ForCausalLM.prepare_inputs_for_generation drops the cache on the step where a sequence
first grows past that length, so `generate` recomputes every position with the long factors there. A sequence
is thus computed with one set throughout: the short one while it is at most the original length, the long one
once it is longer (Sequence.rope_long; the scheduler recomputes a sequence that grows past it). The table holds
both: rows 0..P-1 the short factors below the original length and the long ones from it (what any decode step
reads), then rows P + p the long factors of each position p below it, which a long sequence's earlier positions
read (`rows`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch
from torch import nn

SUPPORTED_SCALING = ("default", "linear", "llama3", "yarn", "longrope")


def rope_kind(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return "longrope" if kind == "su" else kind  # "su" is LongRoPE's first name in Phi-3 configs


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int | None = None
) -> torch.Tensor:
    """head_dim: the rotated dims (all of a head's, or a partial rotary's share); max_position_embeddings: the
    model's (YaRN without a factor derives it from this)."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = rope_kind(scaling)
    if kind == "longrope":  # the short factors (longrope_inv_freq gives either)
        assert scaling is not None
        return longrope_inv_freq(head_dim, theta, scaling, long=False)
    inv_freq = 1.0 / (theta**shape)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, theta, scaling, yarn_factor(scaling, max_position_embeddings))
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(SUPPORTED_SCALING)})")


def longrope_inv_freq(head_dim: int, theta: float, scaling: dict, long: bool) -> torch.Tensor:
    """LongRoPE's frequencies: the default ones, each divided by its short or long factor."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * theta**shape)


def yarn_factor(scaling: dict, max_position_embeddings: int | None = None) -> float:
    """YaRN's context factor: the config's, else max_position_embeddings over the original (DeepSeek-V3's form)."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    if not max_position_embeddings:
        raise ValueError("YaRN rope scaling without a factor needs max_position_embeddings")
    return max_position_embeddings / scaling["original_max_position_embeddings"]


def yarn_inv_freq(inv_freq: torch.Tensor, dims: int, theta: float, scaling: dict, factor: float) -> torch.Tensor:
    """YaRN (arXiv 2309.00071, "NTK-by-parts"): frequencies that turn fewer than beta_slow times over the original
    context are interpolated (divided by the factor), those turning more than beta_fast times kept, a linear ramp
    over the dims between; the dims' bounds rounded outwards unless `truncate` is false, as transformers does."""
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over `original`
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency as it was (extrapolated), 0: interpolated
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep


def rope_attention_scaling(scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor LongRoPE and YaRN multiply cos and sin by (1.0 for every other kind), as transformers derives
    it."""
    if rope_kind(scaling) == "yarn":
        assert scaling is not None
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = yarn_factor(scaling, max_position_embeddings)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        return mscale(factor)
    if rope_kind(scaling) != "longrope":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [P, Dr] float32 buffers ([P + original, Dr] for LongRoPE, see the module's docstring)
    sin: torch.Tensor
    # LongRoPE's original_max_position_embeddings where the table holds long factors too; None: one set
    original: int | None

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        attention_scaling: float = 1.0,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.num_positions = max_positions
        self.original = None
        positions = torch.arange(max_positions, dtype=torch.float32)
        emb = _angles(positions, rope_inv_freq(head_dim, theta, scaling, max_position_embeddings))  # [P, D]
        original = int((scaling or {}).get("original_max_position_embeddings") or max_positions)
        if scaling is not None and rope_kind(scaling) == "longrope" and max_positions > original:
            # (a table no longer than the original length never needs the long factors: no sequence outgrows it)
            self.original = original
            long = _angles(positions, longrope_inv_freq(head_dim, theta, scaling, long=True))
            emb = torch.cat((emb[:original], long[original:], long[:original]))
        cos, sin = emb.cos(), emb.sin()
        # transformers scales cos and sin alike under either set of LongRoPE factors (its attention factor follows
        # max_position_embeddings over the original length, whichever set a call takes)
        if attention_scaling != 1.0:
            cos, sin = cos * attention_scaling, sin * attention_scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rows(self, start: int, end: int, long: bool) -> Iterable[int]:
        """The table rows of one sequence's positions start..end-1: the positions themselves, but for a sequence
        computed with LongRoPE's long factors (Sequence.rope_long) those below the original length, which read
        the long rows after the table's first P."""
        if not long or self.original is None or start >= self.original:
            return range(start, end)
        split = min(end, self.original)
        return itertools.chain(range(start + self.num_positions, split + self.num_positions), range(split, end))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step: cos and sin for every token, [T, 1, D] in the activation dtype."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Each position's rotation angles, [P, D]: the frequencies' twice over (rotate_half's layout)."""
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs, freqs), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, H, D], k: [T, KVH, D], cos/sin: [T, 1, Dr]; Dr < D rotates the first Dr dims (partial rotary)
    dr = cos.shape[-1]
    if dr < q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :dr], k[..., :dr], cos, sin)
        return torch.cat((q_rot, q[..., dr:]), dim=-1), torch.cat((k_rot, k[..., dr:]), dim=-1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
