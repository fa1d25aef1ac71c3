"""One decoder for Llama, Mistral, Qwen2, Qwen3 and Phi-3, Gemma 2/3, the Mixture-of-Experts kin Mixtral, Qwen2-MoE
and Qwen3-MoE, and DeepSeek-V2/V3 (latent attention, layers/mla.py): config switches for bias, qk-norm, sliding
window, tying, partial rotary, and which layers' MLP is a set of experts.

Every tensor here is flattened over the batch: [T, ...] with T = all scheduled tokens of all requests.
q/k/v and gate/up are fused at load time into one matmul each.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

from collections import Counter
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.attention import AttentionBackend, AttentionMetadata
from tokenmill.executor.layers.gated_deltanet import GatedDeltaNet, LinearStep
from tokenmill.executor.layers.linear import Embedding, Linear
from tokenmill.executor.layers.mla import LatentAttention
from tokenmill.executor.layers.moe import SparseMoeBlock
from tokenmill.executor.layers.quant import (QuantWeight, RowParts, concat_fp8, concat_groups, concat_rows,
                                            dequantize_rows, select_rows)
from tokenmill.executor.layers.norm import RMSNorm
from tokenmill.executor.layers.rotary import RotaryEmbedding
from tokenmill.executor.ops import ReferenceOps

Rope = tuple[torch.Tensor, torch.Tensor]   # cos, sin [T, 1, head_dim] of this step's positions

log = logging.getLogger("tokenmill")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ReferenceOps):
        super().__init__()
        self.ops, self.layer_idx = ops, layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen3.5: q_proj gives each head its query and then as many gate values (a sigmoid of them scales the
        # head's output)
        self.output_gate = cfg.attn_output_gate
        q_rows = self.q_size * (2 if self.output_gate else 1)
        self.qkv_proj = Linear(cfg.hidden_size, q_rows + 2 * self.kv_size, cfg.attention_bias, ops)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, ops)
        offset = cfg.norm_offset
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops, offset) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.rotary_dim = cfg.rotary_dim
        # Gemma: this layer's sliding window (None: global or the model's), its scores' soft cap, and whether it
        # turns its rotary embeddings at the local base (the model's second table)
        self.window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.softcap = cfg.attn_logit_softcapping
        self.local_rope = self.window is not None and cfg.rope_local_theta is not None
        # gpt-oss: each query head's sink logit (float32 for the kernels, whatever the model's dtype)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, rope: Rope, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        gate = None
        if self.output_gate:
            qg = qkv[:, :2 * self.q_size].view(T, H, 2 * self.head_dim)
            gate = qg[..., self.head_dim:].reshape(T, self.q_size)
            qkv = torch.cat([qg[..., :self.head_dim].reshape(T, self.q_size), qkv[:, 2 * self.q_size:]], dim=1)
        # q and k side by side as [T, H + KV, D] (a view of the qkv rows), so one rotation covers both
        qk = qkv[:, :self.q_size + self.kv_size].view(T, H + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        o = backend.forward_rotary(self.layer_idx, qk, v, rope, self.ops.rotary, meta, self.scale, self.window,
                                   self.softcap, self.sinks).reshape(T, self.q_size)        # [T, H * D]
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.ops.all_reduce(self.o_proj(o))      # rank's heads' share, summed


class VocabParallelEmbedding(Embedding):
    """One rank's rows of the embedding table (rank r holds ids [r * num, (r + 1) * num)): ids elsewhere give
    zeros, and the sum over ranks is every id's row."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.ops.tp.rank * self.num
        here = (local >= 0) & (local < self.num)
        rows = super().forward(torch.where(here, local, torch.zeros_like(local)))
        return self.ops.all_reduce(rows * here[:, None].to(rows.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ReferenceOps, inter: Optional[int] = None, reduce: bool = True,
                 bias: bool = False):
        """reduce=False: an expert's, whose Mixture-of-Experts block all-reduces once, after the experts; bias: on
        both matrices (gpt-oss's experts)."""
        super().__init__()
        self.ops, self.reduce = ops, reduce
        self.inter = inter or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias, ops)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias, ops)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.act = ops.gelu_tanh_mul if self.gelu else ops.silu_mul
        if cfg.hidden_act == "swigluoai":
            self.act = partial(ops.swiglu_oai_mul, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(self.act(self.gate_up_proj(x)))
        return self.ops.all_reduce(y) if self.reduce else y


class DecoderLayer(nn.Module):
    gemma = False

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ReferenceOps):
        super().__init__()
        self.layer_idx = layer_idx
        offset = cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset)
        # the attending layers by their place among those that keep KV; a linear layer (Qwen3.5) keeps a state
        attn_idx = cfg.attention_index(layer_idx)
        self.self_attn: Optional[nn.Module] = None
        self.linear_attn: Optional[GatedDeltaNet] = None
        if attn_idx is None:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer_idx), ops)
        else:
            self.self_attn = LatentAttention(cfg, attn_idx, ops) if cfg.mla else Attention(cfg, attn_idx, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset)
        if layer_idx in cfg.moe_layers:
            self.mlp = SparseMoeBlock(cfg, ops, lambda inter: MLP(cfg, ops, inter, reduce=False,
                                                                                bias=cfg.expert_bias))
        else:
            self.mlp = MLP(cfg, ops)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: Rope, backend: AttentionBackend,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual form: x is the previous layer's MLP output (the embeddings, with residual None, on
        the first layer) and residual the running sum before it. Returns this layer's (MLP output, residual)."""
        h, residual = self._attention(x, residual, rope, backend, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def _attention(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: Rope, backend: AttentionBackend,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x added into the residual, normalised and attended: (attention output, residual)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        mixer = self.self_attn if self.linear_attn is None else self.linear_attn
        return mixer(h, rope, backend, meta), residual

    @property
    def local_rope(self) -> bool:
        return self.self_attn is not None and self.self_attn.local_rope


class GemmaDecoderLayer(DecoderLayer):
    """Gemma's sandwich: a norm after attention (before the residual add), and one before and one after the MLP."""
    gemma = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ReferenceOps):
        super().__init__(cfg, layer_idx, ops)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, 1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, 1.0)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: Rope, backend: AttentionBackend,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._attention(x, residual, rope, backend, meta)
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


# HF checkpoint names -> (our fused parameter, shard index) for the fused projections
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          # a linear-attention layer's four input projections (layers/gated_deltanet.py)
          "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
          "in_proj_a": ("in_proj", 3)}
_NUM_SHARDS = Counter(target for target, _ in _FUSED.values())    # qkv_proj: 3, gate_up_proj: 2


# Mixtral's names for its MoE block and its experts' matrices -> the Qwen-MoE names that map onto ours
_MIXTRAL = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _unstacked_experts(weights: Iterable[tuple[str, torch.Tensor | QuantWeight | tuple]]
                       ) -> Iterable[tuple[str, torch.Tensor | QuantWeight]]:
    """gpt-oss's checkpoint names, one expert at a time in Qwen-MoE's: its router as the gate, and each layer's
    experts stacked in one tensor per matrix ([E, in, out], gate and up columns interleaved; MXFP4 experts come as
    a tuple of one quantised [out, in] each, hf_quant.py) as each expert's gate_proj, up_proj and down_proj
    ([out, in]) with their biases."""
    for name, t in weights:
        head, _, leaf = name.rpartition(".")
        if leaf in ("weight", "bias") and head.endswith(".mlp.router"):
            yield f"{head[:-len('router')]}gate.{leaf}", t
        elif head.endswith(".mlp.experts") and leaf in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                         "down_proj_bias"):
            kind = "bias" if leaf.endswith("_bias") else "weight"
            if not isinstance(t, (torch.Tensor, tuple)):
                raise ValueError(f"{name}: stacked experts quantised as {type(t).__name__} are not implemented")
            for e in range(len(t)):
                w = t[e] if kind == "bias" or isinstance(t, tuple) else t[e].t()      # [out, in] or [out]
                if leaf.startswith("gate_up"):
                    rows = w.shape[0]
                    yield f"{head}.{e}.gate_proj.{kind}", _rows(w, torch.arange(0, rows, 2))
                    yield f"{head}.{e}.up_proj.{kind}", _rows(w, torch.arange(1, rows, 2))
                else:
                    yield f"{head}.{e}.down_proj.{kind}", w
        else:
            yield name, t


def _ungrouped_projections(weights: Iterable[tuple[str, torch.Tensor | QuantWeight]], cfg: ModelConfig
                           ) -> Iterable[tuple[str, torch.Tensor | QuantWeight]]:
    """Qwen3-Next's linear layers project q/k/v/z in one matrix and b/a in another, their rows grouped by key head
    (a head's q, k, then its value heads' v and z; its value heads' b, then a): as Qwen3.5's in_proj_qkv (every q,
    every k, every v), in_proj_z, in_proj_b and in_proj_a. Rows are picked, so a matrix quantised by rows (at load,
    or in a GPTQ-style folder) is regrouped as it is."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rep = cfg.linear_num_value_heads // hk

    def runs(width: int, parts: list[int]) -> list[torch.Tensor]:
        """Each part's rows, gathered over the heads' groups of width rows."""
        out, first = [], 0
        for n in parts:
            out.append(torch.cat([torch.arange(h * width + first, h * width + first + n) for h in range(hk)]))
            first += n
        return out
    q, k, v, z = runs(2 * dk + 2 * rep * dv, [dk, dk, rep * dv, rep * dv])
    b, a = runs(2 * rep, [rep, rep])
    for name, t in weights:
        head, _, leaf = name.rpartition(".")
        if not head.endswith((".in_proj_qkvz", ".in_proj_ba")):
            yield name, t
            continue
        base = head.rpartition(".")[0]
        if head.endswith("qkvz"):
            yield f"{base}.in_proj_qkv.{leaf}", _rows(t, torch.cat([q, k, v]))
            yield f"{base}.in_proj_z.{leaf}", _rows(t, z)
        else:
            yield f"{base}.in_proj_b.{leaf}", _rows(t, b)
            yield f"{base}.in_proj_a.{leaf}", _rows(t, a)


def _language_model_only(weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]
                         ) -> Iterable[tuple[str, torch.Tensor | QuantWeight]]:
    """A Qwen3.5 vision-language checkpoint's language model under the text model's names: its vision tower and
    its multi-token-prediction layer (which transformers does not run either) skipped."""
    for name, t in weights:
        if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
            continue
        yield (f"model.{name[len('model.language_model.'):]}" if name.startswith("model.language_model.") else name), t


def _rows(w: torch.Tensor | QuantWeight, ids: torch.Tensor) -> torch.Tensor | QuantWeight:
    return w[ids] if isinstance(w, torch.Tensor) else select_rows(w, ids)


def _our_name(name: str, latent: bool = False) -> tuple[str, Optional[int]]:
    """An HF parameter name -> (our parameter name, shard index within a fused projection, or None). latent:
    DeepSeek's, whose q_proj stands alone."""
    if name.startswith("model."):
        name = name[len("model."):]
    parts = name.split(".")
    if "block_sparse_moe" in parts:
        parts = [_MIXTRAL.get(p, p) for p in parts]
    if "shared_experts" in parts:                       # DeepSeek's name for its (ungated) shared expert
        parts = ["shared_expert" if p == "shared_experts" else p for p in parts]
    if parts[-2:] == ["gate", "e_score_correction_bias"]:
        parts = parts[:-2] + parts[-1:]
    name = ".".join(parts)
    for i, p in enumerate(parts):
        if p in _FUSED and not (latent and p == "q_proj"):
            target, shard = _FUSED[p]
            return ".".join(parts[:i] + [target] + parts[i + 1:]), shard
    return name, None


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, ops: ReferenceOps):
        super().__init__()
        self.config, self.ops = cfg, ops
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, ops) if ops.tp is None else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ops)
        layer = GemmaDecoderLayer if cfg.gemma else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i, ops) for i in range(cfg.num_hidden_layers))
        # each layer's KV group (whose metadata it attends by), None for a linear layer
        groups = cfg.kv_groups.layer_group
        self.layer_group = [None if (j := cfg.attention_index(i)) is None else groups[j]
                            for i in range(cfg.num_hidden_layers)]
        # the step's requests as the linear layers see them, with the state tensors (executor/linear_states.py)
        self.linear_step: Optional[LinearStep] = None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, cfg.norm_offset)
        # a tied head is made by finalize(), from the loaded embeddings
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, ops)
        # computed tables, not weights: built on the CPU even when the model is built on the meta device (math on
        # meta tensors imports torch._dynamo, ~1.7 s of start-up); the model's .to() moves them with the rest
        with torch.device("cpu"):
            self.make_rotary(max_len, torch.device("cpu"))

    def make_rotary(self, max_len: int, device: torch.device) -> None:
        """The rotary tables (float32, as transformers computes them): the model's, and Gemma 3's local layers'."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                                      max_len).to(device)
        self.rotary_local = None if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.rotary_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings, max_len).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                metas: list[AttentionMetadata]) -> torch.Tensor:
        """input_ids, positions: [T]; metas: the step's attention metadata of each KV group (layout.py). Returns
        hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.config.gemma:
            x = x * self.embed_scale
        rope = self.rotary.tables(positions, x.dtype)
        ropes = (rope, self.rotary_local.tables(positions, x.dtype) if self.rotary_local is not None else rope)
        residual = None
        for layer, group in zip(self.layers, self.layer_group):
            x, residual = self.ops.decoder_layer(layer, x, residual, ropes[layer.local_rope], backend,
                                                 self.linear_step if group is None else metas[group])
        return self.norm(x, residual)[0]

    def graph_blocker(self) -> Optional[str]:
        """Why a step of this model cannot be captured in a graph, or None."""
        if not self.ops.graph_safe:
            return f"the {self.ops.name!r} op plan calls kernels no graph records"
        if self.config.moe_layers and not self.ops.moe_graph_safe:
            return "its Mixture-of-Experts layers run each expert on the tokens routed to it, counted on the host"
        if self.config.linear_layers:
            return "its linear-attention layers take each step's requests and state slots from the host"
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (only the rows that sample). Returns float32 logits [S, vocab]."""
        logits = self.ops.gather_vocab(self.lm_head(hidden))
        cap = self.config.final_logit_softcapping
        if cap is not None:          # Gemma 2: tanh soft-capping, in the model's dtype as transformers does it
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def finalize(self) -> None:
        """After loading: lay weights out for the device's fast paths (see Linear.finalize); a tied head gets its
        own [hidden, vocab] copy on CPU beside the embeddings' [vocab, hidden] (lookup and GEMM each want theirs)."""
        if self.config.gemma:       # transformers multiplies by sqrt(hidden) rounded to the activations' dtype
            e = self.embed_tokens
            dtype = e.dtype if e.quant is not None else e.weight.dtype
            self.embed_scale = float(torch.tensor(self.config.hidden_size ** 0.5, dtype=dtype))
        if self.config.tie_word_embeddings:
            self.lm_head = Linear.tied(self.embed_tokens, self.ops)
        for m in self.modules():
            if isinstance(m, (Linear, RMSNorm)):
                m.finalize()

    # ---- loading -------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]], dtype: torch.dtype,
                     device: torch.device) -> None:
        """Copy HF-named tensors into our (partly fused) parameters, allocating each (the model is built on the
        meta device) as it arrives; a quantised matrix becomes its layer's `quant` and no float copy is made.
        Strict about names and shapes."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        q *= 2 if cfg.attn_output_gate else 1          # each head's query, then its gate

        def shard_rows(pname: str) -> list[int]:
            """The rows of each shard of a fused projection's weight"""
            part = pname.split(".")[-2]
            if part == "in_proj":
                return list(modules[pname.rsplit(".", 2)[0]].in_rows)
            return [q, kv, kv] if part == "qkv_proj" else [params[pname].shape[0] // 2] * 2

        loaded: set[str] = set()
        quant: dict[str, dict[int, QuantWeight]] = {}     # parameter -> its quantised shards
        if cfg.architecture == "GptOssForCausalLM":     # its checkpoint stacks each layer's experts
            weights = _unstacked_experts(weights)
        if cfg.architecture == "Qwen3NextForCausalLM":
            weights = _ungrouped_projections(weights, cfg)
        if cfg.linear_layers:
            weights = _language_model_only(weights)
        self.kv_scales: dict[int, tuple[float, float]] = {}    # layer -> a checkpoint's fp8 (k_scale, v_scale)
        for name, tensor in weights:
            if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):     # llm-compressor's kv_cache_scheme
                layer = int(name.split(".")[-3])
                k, v = self.kv_scales.get(layer, (1.0, 1.0))
                value = float(tensor.float().max())
                self.kv_scales[layer] = (value, v) if name.endswith("k_scale") else (k, value)
                continue
            pname, shard = _our_name(name, cfg.mla)
            name = name[len("model."):] if name.startswith("model.") else name
            if "rotary_emb" in name:
                continue
            if name.startswith("layers.") and int(name.split(".")[1]) >= cfg.num_hidden_layers:
                continue       # DeepSeek-V3's multi-token-prediction layer, unused for decoding (as transformers)
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints store a copy anyway
            if pname not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            rows = shard_rows(pname) if shard is not None else None
            dst = params[pname] if rows is None else params[pname].narrow(0, sum(rows[:shard]), rows[shard])
            key = pname if rows is None else f"{pname}#{shard}"
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            loaded.add(key)
            if not isinstance(tensor, torch.Tensor):
                quant.setdefault(pname, {})[shard or 0] = tensor
                continue
            # DeepSeek-V3's routing bias stays float32, as transformers keeps it; sinks, as the kernels read them
            p = self._allocated(modules, params, pname, torch.float32 if pname.endswith(("e_score_correction_bias", ".sinks"))
                                else dtype, device)
            dst = p.data if rows is None else p.data.narrow(0, sum(rows[:shard]), rows[shard])
            dst.copy_(tensor.to(dst.dtype))
        for pname, shards in quant.items():
            self._set_quant(modules, params, pname, shards, shard_rows, dtype, device)
        for pname, p in params.items():
            base = pname.split(".")[-2] if "." in pname else pname
            if base in _NUM_SHARDS and pname not in loaded:     # fused here, or already fused in the file (Phi-3)
                missing = [s for s in range(_NUM_SHARDS[base]) if f"{pname}#{s}" not in loaded]
                if missing:
                    raise ValueError(f"checkpoint is missing {len(missing)} shard(s) of {pname}")
            elif pname not in loaded:
                raise ValueError(f"checkpoint is missing tensor {pname!r}")

    @staticmethod
    def _allocated(modules: dict, params: dict, pname: str, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
        """The parameter, given storage on the device if it is still on the meta device."""
        p = params[pname]
        if p.device.type == "meta":
            mname, attr = pname.rsplit(".", 1) if "." in pname else ("", pname)
            p = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False)
            setattr(modules[mname], attr, p)
            params[pname] = p
        return p

    def _set_quant(self, modules: dict, params: dict, pname: str, shards: dict[int, QuantWeight],
                   shard_rows: Callable[[str], list[int]], dtype: torch.dtype, device: torch.device) -> None:
        """A layer's quantised shards become its `quant` (its float weight dropped); where another shard of the same
        fused layer came in float, they are dequantised into that float weight instead."""
        mname = pname.rsplit(".", 1)[0]
        module = modules[mname]
        whole = None
        if params[pname].device.type == "meta" and hasattr(module, "quant"):
            parts = [shards[i] for i in sorted(shards)]
            whole = parts[0] if len(parts) == 1 else concat_rows(parts) or concat_groups(parts) or concat_fp8(parts)
            if whole is None and not any(getattr(p, "perm", None) is not None for p in parts):
                whole = RowParts(tuple(parts))
            elif whole is None:
                log.warning("%s: its shards' act orders differ (one input permutation cannot serve them): the "
                            "layer runs dequantised", mname)
            # the plan takes the weight in the form its kernels read, or None: it runs as float
            whole = None if whole is None else self.ops.adopt(whole, device)
        if whole is None:
            p = self._allocated(modules, params, pname, dtype, device)
            rows = shard_rows(pname) if mname.split(".")[-1] in _NUM_SHARDS else None
            for shard, w in shards.items():
                dst = p.data if rows is None else p.data.narrow(0, sum(rows[:shard]), rows[shard])
                dst.copy_(dequantize_rows(w).to(dtype))
            return
        perm = getattr(whole, "perm", None)
        if perm is not None:         # act order: the layer permutes its input once, the kernels see plain groups
            module.in_perm = perm.to(device)
            whole = replace(whole, perm=None)
        module.quant = whole
        module.weight = None
        module.dtype = dtype
        params[pname] = None
