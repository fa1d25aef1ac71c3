"""A decoder layer's pure decode step as one C call (executor/csrc/decode_layer.c).

Only for what that call covers: a step the attention backend can run in C (its decode_args(): the C backend,
float32, decodes only), at most 64 rows, and all four matrices in GGUF blocks with no biases and no q/k norm
(SmolLM2's Q4_1, Llama/Mistral GGUFs).
It runs the very kernels DecoderLayer.forward would call one by one, so it is tested against that path token
for token; it only saves the Python and ctypes overhead between them."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from tokenmill.executor.attention import AttentionMetadata
from tokenmill.executor.layers.quant import MAX_ROWS, PackedWeight
from tokenmill.executor.native import check, kernels


class _Packed(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int), ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("offset", ctypes.c_void_p), ("lanes_codes", ctypes.c_void_p), ("lanes_scale", ctypes.c_void_p),
                ("lanes_offset", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int),
                ("qkv", _Packed), ("o", _Packed), ("gate_up", _Packed), ("down", _Packed)]


def _packed(p: PackedWeight) -> _Packed:
    return _Packed(p.bits, *p.pointers)


class FusedDecodeLayer:
    """The C-side description of one layer (raw pointers into the layer's own tensors, which it keeps alive)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self._keep = layer                                     # the pointers below point into its tensors
        self.desc = _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                           layer.input_layernorm.eps, attn.qkv_proj.packed.shape[1], attn.num_heads, attn.num_kv_heads,
                           attn.head_dim, mlp.inter, _packed(attn.qkv_proj.packed), _packed(attn.o_proj.packed),
                           _packed(mlp.gate_up_proj.packed), _packed(mlp.down_proj.packed))
        self.addr = ctypes.addressof(self.desc)
        self.scale = attn.scale

    @staticmethod
    def build(layer) -> Optional["FusedDecodeLayer"]:
        """The description, or None when the layer is outside what the C call covers."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if kernels() is None or attn.q_norm is not None or norms[0].eps != norms[1].eps:
            return None
        if any(lin.packed is None or lin.bias is not None for lin in linears):
            return None
        if any(n.weight.dtype != torch.float32 or not n.weight.is_cpu for n in norms):
            return None
        return FusedDecodeLayer(layer)

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], decode_args: tuple,
            meta: AttentionMetadata) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """DecoderLayer.forward's (MLP output, residual) for this step, or None when the rows are not ones the
        C call covers (the caller then runs the layer in Python). decode_args: the backend's decode_args()."""
        B = x.shape[0]
        if B > MAX_ROWS or x.dtype != torch.float32 or not x.is_contiguous() \
                or (residual is not None and not residual.is_contiguous()):
            return None
        res = x if residual is None else residual
        out = torch.empty_like(x)
        check(kernels().decode_layer(self.addr, x.data_ptr(), res.data_ptr(), int(residual is not None),
                                     out.data_ptr(), *decode_args, B, meta.block_size, self.scale,
                                     meta.decode_max_len, torch.get_num_threads()), "fused decode layer")
        return out, res
