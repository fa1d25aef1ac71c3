"""Hugging Face folders quantised by the tools people use: GPTQ (AutoGPTQ / GPTQModel), AWQ (AutoAWQ's GEMM
packing), llm-compressor's compressed-tensors, and gpt-oss's MXFP4 experts. The folder's `quantization_config` says which; each packed matrix
comes out as a GroupWeight (integer codes, per-group scales and zero points) or an Fp8Weight, read from the packing
as it is and never through a float copy. Where the weights then live is the execution plan's choice (ops.adopt)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch

from tokenmill.executor.layers.quant import Fp8Weight, GGMLWeight, GroupWeight, QuantWeight, ggml_block, pack_codes

log = logging.getLogger("tokenmill")

# vLLM's `quantization` names for these formats (the Marlin ones are its GPU kernels' names for the same folders)
METHOD_NAMES = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                "compressed-tensors": "compressed-tensors", "fp8": "fp8", "mxfp4": "mxfp4"}
SUPPORTED = ("GPTQ: 4 or 8 bits, group_size -1 or a multiple of 32 (32, 64, 128), sym or not, desc_act with g_idx; "
             "AWQ: 4 bits, version gemm, zero_point; compressed-tensors: pack-quantized W4A16/W8A16 (group or "
             "channel), int-quantized W8A8, float-quantized FP8 (channel or tensor); mxfp4: gpt-oss's stacked "
             "experts")
MXFP4_GROUP = 32            # values a shared exponent scales
_FP8 = (torch.float8_e4m3fn,)           # the FP8 codes a float-quantized folder stores
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ's GEMM packing: nibble i of a word holds column _AWQ_ORDER[i]


@dataclass(frozen=True)
class WeightScheme:
    """How one family of matrices is quantised."""
    kind: str                      # "int" (GroupWeight) or "fp8" (Fp8Weight)
    bits: int
    group: int                     # -1: one group per row
    symmetric: bool
    packing: str                   # "gptq", "gptq_v2", "awq", "ct-packed", "ct-int", "ct-float"


@dataclass(frozen=True)
class HFQuant:
    """A folder's quantization_config, checked."""
    method: str                    # "gptq", "awq", "compressed-tensors"
    scheme: WeightScheme
    # (modules the config leaves in float, GPTQ's and AWQ's lists and compressed-tensors' ignore, need nothing
    # here: their weights come as plain float tensors)
    activations: Optional[str] = None   # compressed-tensors' input activations, for the plan's log ("int8 dynamic")

    @property
    def name(self) -> str:
        s = self.scheme
        what = "FP8" if s.kind == "fp8" else f"W{s.bits}A16" if self.activations is None else f"W{s.bits}A{s.bits}"
        group = "" if s.kind == "fp8" else f", group {s.group}" if s.group > 0 else ", per channel"
        return f"{self.method} {what}{group}{'' if s.symmetric else ', asymmetric'}"


def _bad(found: str) -> ValueError:
    return ValueError(f"this checkpoint's quantization_config asks for {found}, which tokenmill does not load; "
                      f"supported: {SUPPORTED}")


def _int_group(bits: Any, group: Any, what: str) -> tuple[int, int]:
    if bits not in (4, 8):
        raise _bad(f"{what} with {bits} bits")
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise _bad(f"{what} with group_size {group}")
    return bits, group


def parse(config: dict, override: Optional[str] = None) -> Optional[HFQuant]:
    """The folder's quantisation, or None for a float checkpoint. override: vLLM's `quantization` name, which must
    name the folder's method."""
    qc = config.get("quantization_config")
    if qc is None:
        if override in ("gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors"):
            raise ValueError(f"quantization={override!r} reads a checkpoint quantised by that method, but this "
                             f"folder's config.json has no quantization_config; load it without quantization= (or "
                             f"with 'int8', 'int4' or 'fp8' to quantise the float weights at load)")
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        bits, group = _int_group(qc.get("bits"), qc.get("group_size", -1), "GPTQ")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _bad(f"GPTQ in checkpoint_format {fmt!r}")
        found = HFQuant("gptq", WeightScheme("int", bits, group, bool(qc.get("sym", True)), fmt))
    elif method == "awq":
        bits, group = _int_group(qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", 128)),
                                 "AWQ")
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise _bad(f"AWQ with {bits} bits, version {version!r}, zero_point={qc.get('zero_point', True)}")
        found = HFQuant("awq", WeightScheme("int", 4, group, False, "awq"))
    elif method == "compressed-tensors":
        found = _compressed_tensors(qc)
        if found is None:
            return None
    elif method == "mxfp4":
        found = HFQuant("mxfp4", WeightScheme("mxfp4", 4, MXFP4_GROUP, True, "mxfp4"))
    else:
        raise _bad(f"quant_method {method!r}")
    if override is not None:
        want = METHOD_NAMES.get(override)
        ok = want == found.method or (want == "fp8" and found.scheme.kind == "fp8")
        if not ok:
            raise ValueError(f"quantization={override!r} was asked for, but this folder is quantised by "
                             f"{found.method} ({found.name}); leave quantization unset to load it as it is")
    return found


def kv_cache_scheme(config: dict) -> Optional[str]:
    """The fp8 KV cache a compressed-tensors folder was calibrated for (llm-compressor's kv_cache_scheme: static
    k_scale / v_scale a layer, shipped with the weights), as a kv_cache_dtype name; None where it has none."""
    qc = config.get("quantization_config") or {}
    kv = qc.get("kv_cache_scheme")
    if not kv:
        return None
    if kv.get("type") != "float" or kv.get("num_bits") != 8 or kv.get("strategy") != "tensor" or kv.get("dynamic"):
        raise _bad(f"a kv_cache_scheme of {kv.get('type')} {kv.get('num_bits')} bits, strategy {kv.get('strategy')!r}"
                   f"{', dynamic' if kv.get('dynamic') else ''} (static fp8 per tensor is read)")
    return "fp8_e4m3"


def _compressed_tensors(qc: dict) -> Optional[HFQuant]:
    groups = qc.get("config_groups") or {}
    if not groups and qc.get("kv_cache_scheme"):
        return None             # float weights; the KV cache's scales (kv_cache_scheme) are read apart
    if len(groups) != 1:
        raise _bad(f"compressed-tensors with {len(groups)} config groups (one scheme for every Linear is read)")
    group_cfg = next(iter(groups.values()))
    w = group_cfg.get("weights") or {}
    fmt = group_cfg.get("format") or qc.get("format")
    bits, typ, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    acts = group_cfg.get("input_activations")
    act = None if not acts else f"{acts.get('type', 'int')}{acts.get('num_bits')} " \
                                f"{'dynamic' if acts.get('dynamic') else 'static'} per {acts.get('strategy')}"
    if typ == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized") or strategy not in ("channel", "tensor"):
            raise _bad(f"compressed-tensors float weights of {bits} bits, format {fmt!r}, strategy {strategy!r}")
        return HFQuant("compressed-tensors", WeightScheme("fp8", 8, -1, True, "ct-float"), act)
    if typ != "int" or strategy not in ("group", "channel"):
        raise _bad(f"compressed-tensors {typ} weights with strategy {strategy!r}")
    bits, group = _int_group(bits, w.get("group_size") if strategy == "group" else -1, "compressed-tensors")
    if fmt == "pack-quantized":
        packing = "ct-packed"
    elif fmt in ("int-quantized", "naive-quantized") and bits == 8:
        packing = "ct-int"
    else:
        raise _bad(f"compressed-tensors format {fmt!r} with {bits} bits")
    return HFQuant("compressed-tensors", WeightScheme("int", bits, group, bool(w.get("symmetric", True)), packing),
                   act)


# the tensors each packing stores per matrix (beside its float bias), by suffix
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "gptq_v2": ("qweight", "qzeros", "scales", "g_idx"),
          "awq": ("qweight", "qzeros", "scales"),
          "ct-packed": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
          "ct-int": ("weight", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale",
                     "input_zero_point"),
          "ct-float": ("weight", "weight_scale", "input_scale")}
_REQUIRED = {"gptq": ("qweight", "qzeros", "scales"), "gptq_v2": ("qweight", "qzeros", "scales"),
             "awq": ("qweight", "qzeros", "scales"), "ct-packed": ("weight_packed", "weight_scale"),
             "ct-int": ("weight", "weight_scale"), "ct-float": ("weight", "weight_scale")}


def quantized_tensors(q: HFQuant, tensors: Iterator[tuple[str, torch.Tensor]], dequantize: bool = False
                      ) -> Iterator[tuple[str, Union[torch.Tensor, QuantWeight]]]:
    """A folder's tensors with each quantised matrix's parts (qweight, scales, ...) gathered into one
    `<module>.weight`; dequantize: as float32 (the plain path the quantised one is tested against)."""
    s = q.scheme
    if s.packing == "mxfp4":
        yield from _mxfp4_tensors(tensors, dequantize)
        return
    parts, required = _PARTS[s.packing], _REQUIRED[s.packing]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        module, _, suffix = name.rpartition(".")
        # ct-int/ct-float store the codes as `weight`: a plain float weight is told apart by its dtype
        if suffix in parts and not (suffix == "weight" and t.is_floating_point() and t.dtype not in _FP8):
            pending.setdefault(module, {})[suffix] = t
        else:
            yield name, t
    for module, got in pending.items():
        missing = [p for p in required if p not in got]
        if missing:
            raise ValueError(f"{module}: the {q.method} packing needs {', '.join(module + '.' + p for p in missing)}"
                             f", which the checkpoint lacks")
        w = _weight(s, module, got)
        yield module + ".weight", (w.dequantize() if dequantize else w)



def _mxfp4_tensors(tensors: Iterator[tuple[str, torch.Tensor]], dequantize: bool
                   ) -> Iterator[tuple[str, Union[torch.Tensor, tuple[QuantWeight, ...]]]]:
    """gpt-oss's MXFP4 experts: each stacked matrix's `<name>_blocks` uint8 [E, out, in / 32, 16] (two e2m1 codes
    a byte, the low nibble first) and `<name>_scales` uint8 [E, out, in / 32] (E8M0 exponents) become `<name>`:
    a tuple of one GGMLWeight [out, in] an expert, in llama.cpp's MXFP4 blocks (the same values, exactly: the
    codes regrouped, the exponent as it is); dequantize: the float32 stack [E, in, out] the float checkpoint has."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales") or not base.endswith("_proj"):
            yield name, t
            continue
        got = pending.setdefault(base, {})
        got[part] = t
        if len(got) == 2:
            del pending[base]
            yield base, _mxfp4_experts(base, got["blocks"], got["scales"], dequantize)
    if pending:
        base, got = next(iter(pending.items()))
        raise ValueError(f"{base}: MXFP4 needs {base}_blocks and {base}_scales; the checkpoint has only "
                         f"{base}_{next(iter(got))}")


def _mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor, dequantize: bool
                   ) -> Union[torch.Tensor, tuple[QuantWeight, ...]]:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or             blocks.shape[-1] != MXFP4_GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks uint8 [experts, rows, groups, 16] and scales uint8 [experts, rows, "
                         f"groups] expected; got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")
    E, out, groups, _ = blocks.shape
    # code 2j and 2j + 1 of a group share byte j here; ggml's byte j holds codes j and j + 16
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(E, out, groups, MXFP4_GROUP)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    ggml = torch.cat([scales.unsqueeze(-1), packed], dim=-1).reshape(E, out, groups * ggml_block("MXFP4")[1])
    experts = tuple(GGMLWeight("MXFP4", ggml[e].contiguous(), (out, groups * MXFP4_GROUP)) for e in range(E))
    if dequantize:
        return torch.stack([w.dequantize().t() for w in experts])
    return experts


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [R, C] holding 32/bits codes each along the last dim, value i at bits i*bits: uint8 [R, C*32/bits]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    v = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(packed.shape[0], packed.shape[1] * per).to(torch.uint8)


def _check(module: str, part: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{module}.{part} has shape {tuple(t.shape)}; the quantization_config implies {shape}")


def _weight(s: WeightScheme, module: str, got: dict[str, torch.Tensor]) -> QuantWeight:
    if s.packing in ("gptq", "gptq_v2"):
        return _gptq(s, module, got)
    if s.packing == "awq":
        return _awq(s, module, got)
    if s.packing == "ct-float":
        w, scale = got["weight"], got["weight_scale"].float().reshape(-1)
        if w.dtype not in _FP8 or scale.numel() not in (1, w.shape[0]):
            raise ValueError(f"{module}.weight is {w.dtype} {tuple(w.shape)} with {scale.numel()} scales; FP8 "
                             f"needs float8_e4m3fn and one scale per row or one in all")
        return Fp8Weight(w.contiguous(), scale.contiguous(), tuple(w.shape))
    if s.packing == "ct-int":
        w = got["weight"]
        if w.dtype != torch.int8:
            raise ValueError(f"{module}.weight is {w.dtype}; int-quantized weights are int8")
        n, k = w.shape
        codes = (w.to(torch.int16) + 128).to(torch.uint8)
        return _grouped(s, module, codes, got["weight_scale"], got.get("weight_zero_point"), 128, n, k,
                        got.get("weight_g_idx"))
    # ct-packed: rows of int32 words along K, codes offset by 2^(bits-1) (compressed-tensors' pack_to_int32)
    packed = got["weight_packed"]
    n = packed.shape[0]
    k = int(got["weight_shape"][1]) if "weight_shape" in got else packed.shape[1] * 32 // s.bits
    _check(module, "weight_packed", packed, (n, -(-k * s.bits // 32)))
    codes = _unpack_rows(packed, s.bits)[:, :k]
    zero = got.get("weight_zero_point")
    if zero is not None and zero.dtype == torch.int32 and zero.shape[0] != n:     # packed along the rows
        zero = _unpack_rows(zero.t().contiguous(), s.bits).t()[:n]
        zero = zero.to(torch.int16) - (1 << (s.bits - 1))
    return _grouped(s, module, codes, got["weight_scale"], zero, 1 << (s.bits - 1), n, k, got.get("weight_g_idx"))


def _grouped(s: WeightScheme, module: str, codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
             offset: int, n: int, k: int, g_idx: Optional[torch.Tensor]) -> GroupWeight:
    """compressed-tensors' [N, G] scales and signed zero points (shifted by offset into code space)."""
    group = k if s.group == -1 else s.group
    if k % group:
        raise ValueError(f"{module}: {k} columns are not whole groups of {group}")
    _check(module, "weight_scale", scale, (n, k // group))
    z = None
    if zero is not None and not s.symmetric:
        _check(module, "weight_zero_point", zero, (n, k // group))
        z = (zero.to(torch.int16) + offset).to(torch.uint8)
    return _finish(s, module, codes, scale, z, group, n, k, g_idx)


def _finish(s: WeightScheme, module: str, codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
            group: int, n: int, k: int, g_idx: Optional[torch.Tensor]) -> GroupWeight:
    """codes uint8 [N, K] in the input's column order; g_idx (act order) regroups the columns."""
    mid = 1 << (s.bits - 1)
    if zero is not None and bool((zero == mid).all()):
        zero = None                                 # symmetric after all: the 8-bit blocks take it as Q8_0
    perm = None
    if g_idx is not None:
        _check(module, "g_idx", g_idx, (k,))
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k) // group):
            if not bool((torch.bincount(g_idx, minlength=k // group) == group).all()) or int(g_idx.max()) >= k // group:
                raise ValueError(f"{module}.g_idx does not give each of the {k // group} groups {group} columns")
            perm = torch.argsort(g_idx, stable=True)
            codes = codes[:, perm]
    return GroupWeight(s.bits, pack_codes(codes, s.bits), scale.contiguous(), None if zero is None else
                       zero.contiguous(), group, (n, k), perm)


def _gptq(s: WeightScheme, module: str, got: dict[str, torch.Tensor]) -> GroupWeight:
    """GPTQ: qweight int32 [K/per, N] packed along K, qzeros int32 [G, N/per] along N, scales [G, N], g_idx [K].
    The v1 ("gptq") format stores each zero point less one, as AutoGPTQ wrote it."""
    qweight, qzeros, scales = got["qweight"], got["qzeros"], got["scales"]
    per = 32 // s.bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    group = k if s.group == -1 else s.group
    if k % group:
        raise ValueError(f"{module}.qweight unpacks to {k} columns, not whole groups of {group}")
    _check(module, "scales", scales, (k // group, n))
    _check(module, "qzeros", qzeros, (k // group, -(-n // per)))
    codes = _unpack_rows(qweight.t().contiguous(), s.bits)                       # [N, K]
    zero = _unpack_rows(qzeros, s.bits)[:, :n].t().to(torch.int16)              # [N, G]
    if s.packing == "gptq":
        zero = zero + 1
    return _finish(s, module, codes.contiguous(), scales.t(), zero.to(torch.uint8), group, n, k, got.get("g_idx"))


def _awq(s: WeightScheme, module: str, got: dict[str, torch.Tensor]) -> GroupWeight:
    """AWQ GEMM: qweight int32 [K, N/8] and qzeros int32 [G, N/8], packed along N in AutoAWQ's interleaved order;
    scales [G, N]."""
    qweight, qzeros, scales = got["qweight"], got["qzeros"], got["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if s.group == -1 else s.group
    if k % group:
        raise ValueError(f"{module}.qweight has {k} rows, not whole groups of {group}")
    _check(module, "scales", scales, (k // group, n))
    _check(module, "qzeros", qzeros, (k // group, n // 8))
    order = torch.tensor(_AWQ_ORDER)

    def columns(packed: torch.Tensor) -> torch.Tensor:      # [R, N/8] words -> [R, N] in column order
        v = _unpack_rows(packed, 4).view(packed.shape[0], -1, 8)
        out = torch.empty_like(v)
        out[:, :, order] = v
        return out.reshape(packed.shape[0], -1)

    codes = columns(qweight).t().contiguous()         # [N, K]
    zero = columns(qzeros).t()                        # [N, G]
    return _finish(s, module, codes, scales.t(), zero, group, n, k, None)

