"""DeepSeek's Multi-head Latent Attention with the up-projections absorbed. Each token's K and V come from one
latent c (kv_lora_rank dims, normalised) and one rotary key k_pe (qk_rope_head_dim) shared by every head; the cache
holds [c, k_pe] per token and nothing else. A head's key is [W_UK c, k_pe] and its value W_UV c, so

    q . k = (W_UK^T q_nope) . c + q_pe . k_pe,        softmax(...) @ (W_UV c) = W_UV (softmax(...) @ c)

and attention runs as one kv head over the cache: queries [W_UK^T q_nope, q_pe], keys [c, k_pe], values c (the
keys' first dims), then each head's output goes up through W_UV. kv_b_proj holds W_UK and W_UV per head."""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.attention import AttentionBackend, AttentionMetadata
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.norm import RMSNorm


# the bottlenecks' norms take their own epsilon, not the config's rms_norm_eps (transformers' and DeepSeek's code)
LATENT_NORM_EPS = 1e-6


class Matrix(nn.Module):
    """A weight used whole by the layer's own math (never laid out for a GEMM path, dequantised if quantised)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


def softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope) ** -0.5, times yarn's mscale(mscale_all_dim) squared where the rope is yarn-scaled
    (transformers' DeepSeek attention)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    m = rs.get("mscale_all_dim") or 0
    factor = float(rs.get("factor", 1.0))
    if m and factor > 1:
        mscale = 0.1 * m * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__()
        self.ops, self.layer_idx = ops, layer_idx
        H, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.num_heads, self.rank = H, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_out = H * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, cfg.attention_bias, ops)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, False, ops)
        else:
            self.q_proj = Linear(hidden, q_out, False, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, cfg.attention_bias, ops)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = Matrix(H * (self.nope + self.v_dim), self.rank)
        self.o_proj = Linear(H * self.v_dim, hidden, cfg.attention_bias, ops)
        self.scale = softmax_scale(cfg)
        self.interleaved = cfg.rope_interleave
        self.local_rope = False             # the model reads which rotary table each layer turns by

    def _pe(self, x: torch.Tensor) -> torch.Tensor:
        """The rotary dims in rotate-half order: DeepSeek's come as interleaved pairs (x0, x1), (x2, x3), ...; the
        evens then the odds turn by the same angles (transformers' interleaved rotation, exactly)."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def forward(self, x: torch.Tensor, rope, backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q = q.view(T, H, self.nope + self.rope)
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, :self.rank].contiguous())                        # [T, rank]
        pe = self.ops.rotary(torch.cat([self._pe(q[..., self.nope:]), self._pe(ckv[:, None, self.rank:])], dim=1),
                             *rope)                                                       # [T, H + 1, rope]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        q_lat = torch.einsum("thn,hnr->thr", q[..., :self.nope], w[:, :self.nope])     # W_UK^T q_nope
        query = torch.cat([q_lat, pe[:, :H]], dim=-1)                                     # [T, H, rank + rope]
        key = torch.cat([c, pe[:, H]], dim=-1)[:, None]                                   # [T, 1, rank + rope]
        o = backend.forward(self.layer_idx, query, key, c[:, None], meta, self.scale)    # [T, H, rank]
        o = torch.einsum("thr,hvr->thv", o, w[:, self.nope:])                            # W_UV, [T, H, v]
        return self.ops.all_reduce(self.o_proj(o.reshape(T, H * self.v_dim)))      # rank's heads' share, summed
