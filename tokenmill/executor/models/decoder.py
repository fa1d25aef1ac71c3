"""One decoder for Llama, Mistral, Qwen2 and Qwen3: config switches for bias, qk-norm, sliding window, tying.

Every tensor here is flattened over the batch: [T, ...] with T = all scheduled tokens of all requests.
q/k/v and gate/up are fused at load time into one matmul each.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.attention import AttentionBackend, AttentionMetadata
from tokenmill.executor.layers import cpu_ops
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quant import MAX_ROWS, PackedWeight, concat_rows, qmatmul, with_lanes
from tokenmill.executor.layers.norm import RMSNorm
from tokenmill.executor.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.executor.models.fused_decode import FusedDecodeLayer

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
        if self.q_norm is None:
            o = backend.decode_fused(qkv, H, self.num_kv_heads, self.head_dim, rope, self.k_cache, self.v_cache,
                                     meta, self.scale)
            if o is not None:
                return self.o_proj(o.view(T, self.q_size))
        # q and k side by side as [T, H + KV, D], so one rotation covers both
        qk = qkv[:, :self.q_size + self.kv_size].view(T, H + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
            qk = apply_rotary(qk, *rope)
        elif not cpu_ops.rotary_(qkv, H + self.num_kv_heads, self.head_dim, *rope):   # in place in qkv
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
        gate_up = self.gate_up_proj(x)
        h = cpu_ops.silu_mul(gate_up)
        if h is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = F.silu(gate) * up
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fused: Optional[FusedDecodeLayer] = None   # set by load_packed() when the C layer call applies

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: Rope, backend: AttentionBackend,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual form: x is the previous layer's MLP output (the embeddings, with residual None, on
        the first layer) and residual the running sum before it. Returns this layer's (MLP output, residual)."""
        if self.fused is not None:
            args = backend.decode_args(rope, self.self_attn.k_cache, self.self_attn.v_cache, meta)
            done = None if args is None else self.fused.run(x, residual, args, meta)
            if done is not None:
                return done
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, backend, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# HF checkpoint names -> (our fused parameter, shard index) for the fused projections
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_NUM_SHARDS = Counter(target for target, _ in _FUSED.values())    # qkv_proj: 3, gate_up_proj: 2


def _our_name(name: str) -> tuple[str, Optional[int]]:
    """An HF parameter name -> (our parameter name, shard index within a fused projection, or None)."""
    if name.startswith("model."):
        name = name[len("model."):]
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _FUSED:
            target, shard = _FUSED[p]
            return ".".join(parts[:i] + [target] + parts[i + 1:]), shard
    return name, None


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.config = cfg
        # given storage, not a random init: normal_ on the meta device imports torch._dynamo (~1.7 s of start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied_head_t: Optional[torch.Tensor] = None    # set by finalize() on CPU
        self.tied_head_packed: Optional[PackedWeight] = None  # set by load_packed() for a quantised GGUF
        # computed tables, not weights: built on the CPU even when the model is built on the meta device (math on
        # meta tensors imports torch._dynamo, ~1.7 s of start-up); the model's .to() moves them with the rest
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, backend, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (only the rows that sample). Returns float32 logits [S, vocab]."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.tied_head_packed is not None and hidden.shape[0] <= MAX_ROWS:
            return qmatmul(hidden.float(), self.tied_head_packed)
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

    def load_packed(self, weights: Iterable[tuple[str, PackedWeight]]) -> None:
        """Give Linear layers (and a tied head) their GGUF blocks for decode-sized matmuls, after load_weights.
        A fused layer gets them only if every shard came in the same block format."""
        modules = dict(self.named_modules())
        shards: dict[str, dict[int, PackedWeight]] = {}
        for name, p in weights:
            pname, shard = _our_name(name)
            if pname == "embed_tokens.weight":
                if self.lm_head is None:
                    self.tied_head_packed = with_lanes(p)
                continue
            mname, kind = pname.rsplit(".", 1)
            if kind == "weight":
                shards.setdefault(mname, {})[shard or 0] = p
        for mname, got in shards.items():
            module = modules.get(mname)
            if not isinstance(module, Linear) or len(got) != _NUM_SHARDS.get(mname.split(".")[-1], 1):
                continue
            packed = concat_rows([got[i] for i in sorted(got)])
            module.packed = None if packed is None else with_lanes(packed)
        for layer in self.layers:
            layer.fused = FusedDecodeLayer.build(layer)

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
            pname, shard = _our_name(name)
            name = name[len("model."):] if name.startswith("model.") else name
            if "rotary_emb" in name:
                continue
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints store a copy anyway
            if pname not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if shard is not None:
                rows = shard_rows[pname.split(".")[-2]]
                dst = params[pname].data.narrow(0, sum(rows[:shard]), rows[shard])
                key = f"{pname}#{shard}"
            else:
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
