"""One decoder for Llama, Mistral, Qwen2 and Qwen3: config switches for bias, qk-norm, sliding window, tying.

Every tensor here is flattened over the batch: [T, ...] with T = all scheduled tokens of all requests.
q/k/v and gate/up are fused at load time into one matmul each.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.attention import AttentionBackend, AttentionMetadata
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.norm import RMSNorm
from tokenmill.executor.layers.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]   # cos, sin [T, 1, head_dim] of this step's positions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.k_cache: Optional[torch.Tensor] = None   # bound by the runner: [slots, KV, D]
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, rope: Rope, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        # q and k side by side as [T, H + KV, D], so one rotation covers both
        qk = qkv[:, :self.q_size + self.kv_size].view(T, H + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, :H], qk[:, H:]
        o = backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)   # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, backend, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF checkpoint names -> (our fused parameter, shard index) for the fused projections
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied_head_t: Optional[torch.Tensor] = None    # set by finalize() on CPU
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                                      max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, backend, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (only the rows that sample). Returns float32 logits [S, vocab]."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.tied_head_t is not None:
            return (hidden @ self.tied_head_t).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def finalize(self) -> None:
        """After loading: lay weights out for the device's fast paths (see Linear.finalize)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()
        self.tied_head_t = None
        if self.lm_head is None and self.embed_tokens.weight.device.type == "cpu":
            # a tied head needs [vocab, hidden] for the lookup and [hidden, vocab] for a fast GEMM: keep both
            self.tied_head_t = self.embed_tokens.weight.data.t().contiguous()

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.layers, caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    # ---- loading -------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; strict about names and shapes."""
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shard_rows = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                continue
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints store a copy anyway
            parts = name.split(".")
            fused = next(((i, _FUSED[p]) for i, p in enumerate(parts) if p in _FUSED), None)
            if fused is not None:
                i, (target, shard) = fused
                pname = ".".join(parts[:i] + [target] + parts[i + 1:])
                if pname not in params:
                    raise ValueError(f"unexpected tensor {name!r} in checkpoint")
                rows = shard_rows[target]
                start = sum(rows[:shard])
                dst = params[pname].data.narrow(0, start, rows[shard])
                key = f"{pname}#{shard}"
            else:
                pname = name
                if pname not in params:
                    raise ValueError(f"unexpected tensor {name!r} in checkpoint")
                dst = params[pname].data
                key = pname
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
            loaded.add(key)
        for pname, p in params.items():
            base = pname.split(".")[-2] if "." in pname else pname
            if base in shard_rows:
                n_shards = len(shard_rows[base]) if p.dim() >= 1 else 1
                missing = [s for s in range(n_shards) if f"{pname}#{s}" not in loaded]
                if missing:
                    raise ValueError(f"checkpoint is missing {len(missing)} shard(s) of {pname}")
            elif pname not in loaded:
                raise ValueError(f"checkpoint is missing tensor {pname!r}")
