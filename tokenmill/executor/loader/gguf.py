"""Read a GGUF file (llama.cpp's format) into a Hugging Face-style config and state dict.

We parse the header ourselves and mmap the tensor data. Matrices stay in their file's blocks
(layers/quant.py): a view of the mapped file where the layout allows, repacked for the tuned kernels for
Q4_0/Q4_1/Q8_0. Asked for float (keep_blocks=False, the plain path the kernels are tested against), each
tensor is dequantised one at a time, so a caller never holds two full copies of the weights.
"""

from __future__ import annotations

import mmap
import os
import re
import logging
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from tokenmill.executor.layers.quant import (GGMLWeight, QuantWeight, ggml_block, ggml_weight, pack_ggml,
                                             permute_rows)

log = logging.getLogger("tokenmill")

# GGUF architecture name -> (HF model_type, HF architecture class).
# Mistral GGUFs say "llama", and Llama's decoder is the same, so they load as Llama.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
}
# hybrid linear attention: Gated DeltaNet layers between every full_attention_interval-th attending one
_LINEAR_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# a "deepseek2" GGUF whose experts are gated by sigmoid scores (llama.cpp's expert_gating_func 2) is DeepSeek-V3
_DEEPSEEK3 = ("deepseek_v3", "DeepseekV3ForCausalLM")
_SIGMOID_GATING = 2
# a "llama" GGUF with experts is Mixtral
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
# whether the router's top-k weights are renormalised, where the file does not say (llama.cpp's choice per arch)
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "gpt-oss": True, "qwen35moe": True,
              "qwen3next": True}

# llama.cpp's converter permutes q/k rows per head only for these (its rotary kernel wants
# the two rotated halves interleaved); Qwen's converter does not.
_PERMUTED_ARCHS = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<gguf> -> model.layers.N.<hf>; the suffix (.weight / .bias) carries over.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",                              # a Mixture-of-Experts layer's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",         # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# all experts of a layer in one [experts, rows, columns] tensor -> each expert's matrix in HF form ({e}: its index)
_EXPERT_NAMES = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")      # (ssm_a has no suffix)
# where an architecture's HF names differ from the ones above (one table each, chosen when a file is read):
# Mixtral's MoE block; Gemma's four norms a layer (llama.cpp's ffn_norm is the one before the MLP, and Gemma's norm
# after attention takes Llama's HF name); Phi-3's q/k/v and gate/up, fused as in its HF checkpoint
_ARCH_NAMES: dict[str, dict[str, str]] = {
    "MixtralForCausalLM": {"ffn_gate_inp": "block_sparse_moe.gate",
                           "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                           "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                           "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "Gemma2ForCausalLM": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"},
    "Phi3ForCausalLM": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # latent attention's projections; recent converters split kv_b into k_b ([heads, rank, nope], transposed) and
    # v_b ([heads, v, rank]), which read_gguf joins back; exp_probs_b is V3's routing bias
    # gpt-oss: the norm before the MLP is llama.cpp's attn_post_norm, and each head's sink a tensor of its own
    "GptOssForCausalLM": {"attn_post_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    "DeepseekV2ForCausalLM": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                              "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                              "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                              "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                              "exp_probs_b": "mlp.gate"},
}
# Qwen3.5's and Qwen3-Next's linear layers (b and a apart in Qwen3.5, in one matrix grouped by key head in Qwen3-Next;
# q, k and v in one, z apart, in both); ssm_dt's bias is dt_bias and ssm_a is -exp(A_log), both restored as read
_LINEAR_NAMES = {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
                 "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                 "ssm_alpha": "linear_attn.in_proj_a", "ssm_ba": "linear_attn.in_proj_ba",
                 "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
                 "ssm_dt": "linear_attn.dt", "ssm_a": "linear_attn.A_log"}
for _arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
    _ARCH_NAMES[_arch] = _LINEAR_NAMES
_ARCH_NAMES["Gemma3ForCausalLM"] = _ARCH_NAMES["Gemma2ForCausalLM"]
_ARCH_NAMES["DeepseekV3ForCausalLM"] = _ARCH_NAMES["DeepseekV2ForCausalLM"]


def layer_names(hf_arch: str) -> dict[str, str]:
    """llama.cpp's per-layer tensor kinds -> HF names, for an architecture."""
    return {**_LAYER_NAMES, **_EXPERT_NAMES, **_ARCH_NAMES.get(hf_arch, {})}
# Tensors in the file that are not model parameters in HF form. rope_freqs holds Llama 3's rope scaling factors and
# rope_factors_long/short Phi-3's longrope ones, which we turn into config["rope_scaling"] instead.
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_SUPPORTED_TYPES = {
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
}


@dataclass(frozen=True)
class GGUFCheckpoint:
    config: dict[str, Any]  # Hugging Face config.json form
    # lazy: (HF name, tensor); keep_blocks=True gives quantised matrices as QuantWeight, the rest float32
    tensors: Callable[..., Iterator[tuple[str, torch.Tensor | QuantWeight]]]
    release: Callable[[], None]  # drop the mapped file's pages from this process (they fault back in when read)
    quantized: bool = False      # some matrix is stored quantised (F16/BF16 count as not)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType name: "F32", "Q4_1", ...
    shape: tuple[int, ...]  # numpy/torch order (GGUF lists dims innermost first)
    offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """A GGUF file: metadata dict and tensor table parsed up front, tensor bytes mmapped.

    Our own parser rather than gguf.GGUFReader: that one builds a numpy view per array element,
    which takes seconds for a 49k-token vocabulary; this takes milliseconds.
    Layout: magic, version, n_tensors, n_kv, kv pairs, tensor infos, padding, tensor data.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # a private mapping: writable, so tensors can view it without a copy; nothing ever writes to it
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        self._off = 0
        if self._read("4s") != b"GGUF":
            raise ValueError("bad magic")  # open_gguf checks this first, with a friendlier message
        version = self._read("I")
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
        n_tensors, n_kv = self._read("Q"), self._read("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            self.metadata[key] = self._value(self._read("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = [self._read("Q") for _ in range(self._read("I"))]
            infos.append((name, dims, self._read("I"), self._read("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment must be a power of two, got {align}")
        data_start = -(-self._off // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, rel in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown ggml type id {type_id}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
            info = TensorInfo(name, qtype.name, tuple(reversed(dims)), data_start + rel, n_bytes)
            quant_shape_to_byte_shape(info.shape, qtype)  # raises if rows are not whole blocks
            if info.offset + n_bytes > len(self._mm):
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated download?)")
            self.tensors[name] = info

    def release(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a uint8 view shaped for gguf.quants.dequantize (rows, row bytes)."""
        data = np.frombuffer(self._mm, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        qtype = GGMLQuantizationType[info.type_name]
        return data.reshape(quant_shape_to_byte_shape(info.shape, qtype))

    # -- little-endian primitives; struct raises struct.error on a truncated file
    def _read(self, fmt: str) -> Any:
        fmt = "<" + fmt
        (v,) = struct.unpack_from(fmt, self._mm, self._off)
        self._off += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._read("Q")
        if self._off + n > len(self._mm):
            raise ValueError("string runs past the end of the file")
        s = self._mm[self._off:self._off + n].decode("utf-8", errors="replace")
        self._off += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == _STRING:
            return self._str()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        item, n = self._read("I"), self._read("Q")
        if item in _SCALARS:  # numeric arrays (token types, scores) in one go
            dtype = np.dtype(_SCALARS[item]).newbyteorder("<")
            arr = np.frombuffer(self._mm, dtype=dtype, count=n, offset=self._off)
            self._off += arr.nbytes
            return arr.tolist()
        if n > len(self._mm) - self._off:
            raise ValueError("array runs past the end of the file")
        return [self._value(item) for _ in range(n)]


# GGUF metadata value type ids -> struct codes (8 is string, 9 is array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def check_gguf_file(path: str | os.PathLike[str]) -> str:
    """A ValueError unless path is a file that starts as a GGUF file does; the path as a string. Reads 4 bytes: a
    large vocabulary's metadata (Gemma's 262k tokens and merges) takes a second to parse."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"GGUF file not found: {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"expected a .gguf file, got a directory or special file: {path!r}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    return path


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header, turning every way it can fail into a ValueError."""
    path = check_gguf_file(path)
    try:
        return GGUFFile(path)
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        raise ValueError(f"could not read GGUF file {path!r} (truncated or corrupt?): {e}") from e


def _f32(x: float) -> float:
    # GGUF stores float32; round-trip through its shortest repr so 1e-5 stays 1e-5, not 9.99e-06.
    return float(str(np.float32(x)))


def _scalar(value: Any, key: str) -> Any:
    # Some GGUFs store per-layer arrays (e.g. feed_forward_length); we only handle uniform ones.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF key {key!r} varies per layer ({value}); not supported")
        return value[0]
    return value


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3's rope_scaling from llama.cpp's rope_freqs tensor (per-dim divisors).

    GGUF keeps no llama3 parameters, only the resulting factors. We take the factor from the
    tensor, assume Meta's published defaults for the rest, and check they reproduce it.
    """
    factor = float(freqs.max())
    guess = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old = guess["original_max_position_embeddings"]
    low_wl, high_wl = old / guess["low_freq_factor"], old / guess["high_freq_factor"]
    smooth = (old / wavelen - guess["low_freq_factor"]) / (guess["high_freq_factor"] - guess["low_freq_factor"])
    expect = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    if expect.shape != freqs.shape or not np.allclose(expect, freqs, rtol=1e-3):
        raise ValueError("GGUF has a rope_freqs tensor that does not match Llama 3 rope scaling; not supported")
    return guess


def _rope_scaling(meta: dict[str, Any], arch: str, context_length: int) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only linear and yarn)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    if kind == "yarn":
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        scaling["original_max_position_embeddings"] = int(orig or context_length / factor)
    return scaling


def _config(f: GGUFFile) -> dict[str, Any]:
    meta, tensors = f.metadata, f.tensors
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    model_type, hf_arch = ARCHITECTURES[arch]
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if arch == "llama" and experts:
        model_type, hf_arch = _MIXTRAL
    if arch == "deepseek2" and meta.get(f"{arch}.expert_gating_func") == _SIGMOID_GATING:
        model_type, hf_arch = _DEEPSEEK3

    def get(key: str, default: Any = None) -> Any:
        key = f"{arch}.{key}"
        if key not in meta and default is None:
            raise ValueError(f"GGUF metadata is missing {key}")
        return _scalar(meta.get(key, default), key)

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    ctx = int(get("context_length"))
    theta = _f32(get("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        # the embedding's row count is what the weights need, whatever metadata says
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", meta.get(f"{arch}.expert_feed_forward_length"))),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    scaling = _rope_scaling(meta, arch, ctx)
    if scaling is None and "rope_freqs.weight" in tensors:
        freqs = _dequantize(f, tensors["rope_freqs.weight"]).double().numpy()
        scaling = _llama3_rope_scaling(freqs, head_dim, theta)
    if arch == "phi3":
        rot = int(get("rope.dimension_count", head_dim))
        if rot != head_dim:
            cfg["partial_rotary_factor"] = rot / head_dim
        scaling = _longrope(f, arch, rot) or scaling
        if scaling is not None and scaling.get("rope_type") == "longrope":
            cfg["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    # transformers >= 5 spells rope settings as one dict; give both so either reader works
    cfg["rope_parameters"] = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
    if "partial_rotary_factor" in cfg:
        cfg["rope_parameters"]["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if f"{arch}.attention.sliding_window" in meta:
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    if arch == "deepseek2":
        cfg.update(_deepseek_config(meta, arch, experts, cfg, scaling))
    elif experts:
        cfg.update(_moe_config(meta, arch, experts, cfg, tensors))
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma_config(meta, arch, cfg))
    if arch == "gpt-oss":
        cfg.update(_gpt_oss_config(cfg))
    if arch in _LINEAR_ARCHS:
        cfg.update(_linear_attention_config(meta, arch, cfg))
    return cfg


def _linear_attention_config(meta: dict[str, Any], arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's and Qwen3-Next's HF keys from llama.cpp's ssm keys: group_count key heads of state_size, time_step_rank
    value heads of inner_size / time_step_rank; every full_attention_interval-th layer attends, its rotary dims
    rope.dimension_count. llama.cpp's converter reorders Qwen3.5's value heads into tiled order (where there are more
    than key heads), not Qwen3-Next's."""
    def get(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return _scalar(meta[f"{arch}.{key}"], key)

    key_heads, value_heads = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    interval = int(meta.get(f"{arch}.full_attention_interval", 4))
    rot = int(meta.get(f"{arch}.rope.dimension_count", cfg["head_dim"] // 4))
    out = {"linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
           "linear_key_head_dim": int(get("ssm.state_size")),
           "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
           "linear_conv_kernel_dim": int(get("ssm.conv_kernel")), "full_attention_interval": interval,
           "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(cfg["num_hidden_layers"])],
           "partial_rotary_factor": rot / cfg["head_dim"],
           "linear_value_heads_tiled": arch != "qwen3next" and value_heads != key_heads}
    out["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": out["partial_rotary_factor"]}
    return out


def _gpt_oss_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's keys that llama.cpp's converter does not write, as llama.cpp runs the model: every even layer
    slides (its window pattern of 2), the clamped SwiGLU at 7 with alpha 1.702, and the published config's yarn,
    whose correction range is not truncated."""
    layers = cfg["num_hidden_layers"]
    out: dict[str, Any] = {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)],
                           "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "attention_bias": True}
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "yarn":
        out["rope_scaling"] = {**cfg["rope_scaling"], "truncate": False}
        out["rope_parameters"] = {**cfg["rope_parameters"], "truncate": False}
    return out


def _gemma_config(meta: dict[str, Any], arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma's HF keys. The file keeps no query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B models
    (46 and 62 layers) and head_dim otherwise, as those checkpoints set it; the local layers' rope base is 10000."""
    layers, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern]
    elif arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    big = layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else cfg["head_dim"],
        "sliding_window": cfg.get("sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcapping": _f32(meta[f"{arch}.attn_logit_softcapping"])
        if f"{arch}.attn_logit_softcapping" in meta else None,
        "final_logit_softcapping": _f32(meta[f"{arch}.final_logit_softcapping"])
        if f"{arch}.final_logit_softcapping" in meta else None,
    }
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out


def _deepseek_config(meta: dict[str, Any], arch: str, experts: int, cfg: dict[str, Any],
                     scaling: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSeek-V2/V3's HF keys. key_length and value_length are the latent's (rank + rope, rank) where the file
    also has the _mla lengths (the heads' own), else the heads'. The file keeps rope dims interleaved, as HF does.
    Expert groups only where the file names them: without, experts are picked among all (as llama.cpp does)."""
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return _scalar(value, key)

    rope = int(get("rope.dimension_count"))
    key_len = int(get("attention.key_length_mla", 0) or get("attention.key_length"))
    v_len = int(get("attention.value_length_mla", 0) or get("attention.value_length"))
    groups, used = int(get("expert_group_count", 1)), int(get("expert_group_used_count", 1))
    v3 = cfg["architectures"] == [_DEEPSEEK3[1]]
    out: dict[str, Any] = {
        "kv_lora_rank": int(get("attention.kv_lora_rank")), "q_lora_rank": meta.get(f"{arch}.attention.q_lora_rank"),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key_len - rope, "v_head_dim": v_len, "head_dim": rope,
        "num_key_value_heads": cfg["num_attention_heads"], "rope_interleave": True,
        "n_routed_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "routed_scaling_factor": _f32(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": groups, "topk_group": used,
        "topk_method": "group_limited_greedy" if groups > 1 or v3 else "greedy",
    }
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if scaling is not None and scaling["rope_type"] == "yarn" and log_mul:
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs set mscale to the same value
        m = round(float(log_mul) / 0.1, 6)
        scaling.update(mscale=m, mscale_all_dim=m)
        out["rope_parameters"] = {**cfg["rope_parameters"], **scaling}
    return out


def _longrope(f: GGUFFile, arch: str, rot: int) -> dict[str, Any] | None:
    """Phi-3's longrope from its factor tensors and original context length (None where the file has none)."""
    t = f.tensors
    if "rope_factors_long.weight" not in t:
        return None
    orig = f.metadata.get(f"{arch}.rope.scaling.original_context_length")
    if orig is None:
        raise ValueError(f"GGUF has rope_factors_long but no {arch}.rope.scaling.original_context_length")
    factors = {k: _dequantize(f, t[f"rope_factors_{k}.weight"]).tolist() for k in ("long", "short")}
    if any(len(v) != rot // 2 for v in factors.values()):
        raise ValueError(f"GGUF rope_factors have {len(factors['long'])} entries; {rot} rotary dims need {rot // 2}")
    out = {"rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"],
           "original_max_position_embeddings": int(orig)}
    attn = f.metadata.get(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        out["attention_factor"] = _f32(attn)
    return out


def _moe_config(meta: dict[str, Any], arch: str, experts: int, cfg: dict[str, Any],
                tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """The HF config's Mixture-of-Experts keys. A layer is sparse where the file has its router."""
    used = meta.get(f"{arch}.expert_used_count")
    if used is None:
        raise ValueError(f"GGUF metadata is missing {arch}.expert_used_count")
    out: dict[str, Any] = {"num_experts_per_tok": int(used),
                           "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch]))}
    if arch in ("llama", "gpt-oss"):
        return {**out, "num_local_experts": experts}
    out.update(num_experts=experts, decoder_sparse_step=1,
               moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length", cfg["intermediate_size"])),
               mlp_only_layers=[i for i in range(cfg["num_hidden_layers"])
                                if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):
        out["shared_expert_intermediate_size"] = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
    return out


def hf_name(gguf_name: str, names: dict[str, str] | None = None, expert: int = 0) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name (None for a skipped tensor), by names (layer_names(),
    Llama's by default); for a tensor of all of a layer's experts, that of expert `expert`'s matrix."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    names = names or layer_names("")
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know of")
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{names[kind].format(e=expert)}" + (f".{suffix}" if suffix else "")


def _linear_attention_tensor(name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A linear layer's tensor back in HF form: A_log from ssm_a (-exp(A_log)), dt_bias, the convolution's
    [channels, kernel] as conv1d's [channels, 1, kernel]; any other tensor as it is."""
    if name.endswith(".linear_attn.A_log"):
        return name, torch.log(-w)
    if name.endswith(".linear_attn.dt.bias"):
        return name[:-len(".dt.bias")] + ".dt_bias", w
    if name.endswith(".linear_attn.conv1d.weight") and w.dim() == 2:
        return name, w.unsqueeze(1)
    return name, w


def _joined_kv_b(name: str, half: torch.Tensor, seen: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """kv_b_proj [heads * (nope + v), rank] once both of a layer's halves have come: k_b [heads, rank, nope]
    (stored transposed) and v_b [heads, v, rank]."""
    layer = name.rsplit(".", 2)[0]
    other = seen.pop(layer, None)
    if other is None:
        seen[layer] = half
        return None
    k_b, v_b = (half, other) if name.endswith(".k_b_proj.weight") else (other, half)
    w = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return f"{layer}.kv_b_proj.weight", w.reshape(-1, w.shape[-1])


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's permute(): per head, llama.cpp stores rows as [half, pair]
    interleaved; HF wants the two rotary halves contiguous. Works for weights and biases."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# Types whose blocks dequantise in one vectorised torch pass (PackedWeight.dequantize), with the same float32
# roundings as gguf-py (d * code + m; d * code): ~20x faster than gguf-py's per-row numpy, seconds of start-up.
_TORCH_DEQUANT = ("Q4_1", "Q8_0")


def _dequantize(f: GGUFFile, info: TensorInfo) -> torch.Tensor:
    if info.type_name in _TORCH_DEQUANT and len(info.shape) == 2 and info.shape[1] % 32 == 0:
        return pack_ggml(info.type_name, f.raw(info), info.shape).dequantize()
    arr = np.asarray(dequantize(f.raw(info), GGMLQuantizationType[info.type_name]), dtype=np.float32)
    if not arr.flags.writeable:  # F32 comes back as a view of the read-only mmap: own a copy
        arr = arr.copy()
    return torch.from_numpy(arr.reshape(info.shape))


def _kept(type_name: str, raw: np.ndarray, shape: tuple[int, ...], heads: int) -> QuantWeight | None:
    """A matrix (raw: its bytes, [rows, row bytes]) in its blocks (rows unpermuted for llama's q/k), or None where
    it must become float."""
    if len(shape) != 2 or type_name == "F32":
        return None
    w = pack_ggml(type_name, raw, shape) or ggml_weight(type_name, raw, shape)
    if w is None or not heads:
        return w
    if isinstance(w, GGMLWeight):
        return GGMLWeight(w.type_name, unpermute_qk(w.data, heads).contiguous(), w.shape)
    return permute_rows(w, lambda t: unpermute_qk(t, heads))


def read_gguf(path: str) -> GGUFCheckpoint:
    """Read metadata now; give tensors (HF names and shapes) when iterated."""
    f = open_gguf(path)
    config = _config(f)
    names = layer_names(config["architectures"][0])
    # llama.cpp stores Gemma's norms, and Qwen3.5's but the gated one of its linear layers, as 1 + w
    gemma = config["architectures"][0] in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    centred = gemma or config["architectures"][0] in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                                      "Qwen3NextForCausalLM")
    deepseek = config["architectures"][0] in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    for info in f.tensors.values():  # fail at load time, not halfway through iterating
        if info.type_name not in _SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {info.name!r} has type {info.type_name}, which tokenmill cannot read; "
                f"supported: {', '.join(sorted(_SUPPORTED_TYPES))}")
        hf_name(info.name, names)
    permuted = f.metadata["general.architecture"] in _PERMUTED_ARCHS
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def permuted_heads(name: str) -> int:
        """How many heads llama.cpp interleaved this tensor's rows over (0: it did not)."""
        proj = name.split(".")[-2]
        return heads[proj] if permuted and proj in heads else 0

    def tensors(keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        in_float: list[str] = []
        latent_halves: dict[str, torch.Tensor] = {}      # a layer's k_b or v_b, until its other half comes
        for info in f.tensors.values():
            name = hf_name(info.name, names)
            if name is None:
                continue
            if name.endswith((".k_b_proj.weight", ".v_b_proj.weight")):
                kv_b = _joined_kv_b(name, _dequantize(f, info), latent_halves)
                if kv_b is not None:
                    yield kv_b
                continue
            if name.endswith("mlp.gate.bias") and deepseek:      # DeepSeek-V3's routing bias
                yield name.replace("gate.bias", "gate.e_score_correction_bias"), _dequantize(f, info)
                continue
            if name.endswith(".sinks.weight"):
                yield name[:-len(".weight")], _dequantize(f, info)
                continue
            if len(info.shape) == 3:          # every expert of a layer: a matrix each
                yield from _experts(info, keep_blocks, in_float)
                continue
            if info.name.endswith("_exps.bias"):      # every expert's bias (gpt-oss): a row each
                whole = _dequantize(f, info)
                for e in range(info.shape[0]):
                    yield hf_name(info.name, names, e), whole[e]
                continue
            if keep_blocks and not name.endswith(".conv1d.weight"):      # a convolution, not a matmul
                kept = _kept(info.type_name, f.raw(info), info.shape, permuted_heads(name))
                if kept is not None:
                    yield name, kept
                    continue
                if len(info.shape) == 2 and info.type_name != "F32":
                    in_float.append(f"{info.name} ({info.type_name}, rows of {info.shape[1]}: not whole blocks "
                                    f"of {ggml_block(info.type_name)[0]})")
            w = _dequantize(f, info)
            if n := permuted_heads(name):
                w = unpermute_qk(w, n)
            if name.endswith("shared_expert_gate.weight"):   # llama.cpp keeps the [1, hidden] gate as [hidden]
                w = w.reshape(1, -1)
            if centred and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                w = w - 1
            yield _linear_attention_tensor(name, w)
        if in_float:
            log.warning("kept in float32: %s", "; ".join(in_float))

    def _experts(info: TensorInfo, keep_blocks: bool, in_float: list[str]
                 ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        shape = info.shape[1:]
        if keep_blocks and info.type_name != "F32":
            raw = f.raw(info)
            kept = [_kept(info.type_name, raw[e], shape, 0) for e in range(info.shape[0])]
            if all(w is not None for w in kept):
                for e, w in enumerate(kept):
                    yield hf_name(info.name, names, e), w
                return
            in_float.append(f"{info.name} ({info.type_name}, rows of {shape[1]}: not whole blocks)")
        whole = _dequantize(f, info)
        for e in range(info.shape[0]):
            yield hf_name(info.name, names, e), whole[e]

    quantized = any(i.type_name not in ("F32", "F16", "BF16") for i in f.tensors.values() if len(i.shape) >= 2)
    return GGUFCheckpoint(config=config, tensors=tensors, release=f.release, quantized=quantized)
