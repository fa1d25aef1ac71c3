"""Rotary position embeddings with transformers' scalings: default, linear, llama3, yarn, longrope; on all of each
head or (Phi-4-mini's partial_rotary_factor) its first dims only."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict], max_position_embeddings: int,
                  seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention scaling applied to cos and sin). head_dim: the rotated
    dims. seq_len: for longrope, the sequence length its factors are for (transformers' argument)."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        orig = scaling.get("original_max_position_embeddings") or max_position_embeddings
        attn = scaling.get("attention_factor")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attn is None:
            attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
                else get_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        extrap, interp = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - ramp
        return interp * (1 - keep) + extrap * keep, float(attn)
    if kind == "longrope":
        # Phi-3: per-dimension divisors of the frequencies, the long ones past the pretraining length
        orig = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor"] if seq_len > orig else scaling["short_factor"]
        if len(factors) != dim // 2:
            raise ValueError(f"longrope factors have {len(factors)} entries; the rotary dims need {dim // 2}")
        scale = scaling.get("factor") or max_position_embeddings / orig
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(orig))
        return inv_freq / torch.tensor(factors, dtype=torch.float32), float(attn)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, yarn, longrope")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_len, rotary dims], indexed by each token's position."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], max_position_embeddings: int,
                 max_len: int):
        super().__init__()
        inv_freq, attn_scale = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        freqs = pos * inv_freq[None, :]
        if scaling is not None and scaling["rope_type"] == "longrope":
            # a position past the pretraining length takes the long factors: transformers switches to them once a
            # sequence is that long (its keys before stay as they were cached), so each position's rotation is
            # that of the step that first computes it, save a prompt longer than the switch computed in one pass
            orig = scaling["original_max_position_embeddings"]
            long_freq, _ = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings, orig + 1)
            freqs = torch.where(pos < orig, freqs, pos * long_freq[None, :])
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_scale, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for this step's positions, in the activations' dtype (as transformers casts them).
        Looked up once per forward pass and shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by its token's position: x * cos + rotate_half(x) * sin, over the first R dims of
    each head for cos, sin [T, 1, R] (the rest pass through)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
