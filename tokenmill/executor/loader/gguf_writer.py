"""`tokenmill quantize IN OUT --type TYPE`: write a GGUF file that llama.cpp loads.

IN is a GGUF file or a Hugging Face folder (config.json + *.safetensors + tokenizer.json) of a llama, qwen2
or qwen3 model. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16 and F32 are written here, with our quantisers
(quantize.py, bit-equal to gguf-py's). K-quants (q4_k_m, ...) are llama.cpp's own mixes: we write a float
GGUF to a temporary file and run llama.cpp's quantiser (llama_model_quantize) on it.

Tensors stream: every tensor's type and size is known from the shapes alone, so the header goes out first
and each tensor is then loaded, quantised, written and dropped in turn; a model never sits in memory twice.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import mmap
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import (GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, LlamaFileType, RopeScalingType,
                             TokenType)
from gguf.vocab import SpecialVocab
from tqdm import tqdm

from tokenmill.executor.loader.gguf import _GLOBAL_NAMES, _LAYER_NAMES, ARCHITECTURES, _dequantize, open_gguf
from tokenmill.executor.loader.quantize import BLOCK_TYPES, can_quantize, quantize, row_bytes

# --type names (llama.cpp's spelling, lower case) -> the GGML type written for weight matrices
OUR_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
             "f16": "F16", "bf16": "BF16", "f32": "F32"}
# --type names -> llama.cpp's file type, made by its own quantiser (a bare q3_k/q4_k/q5_k is the _M mix,
# as in llama.cpp's llama-quantize)
LLAMA_CPP_TYPES = {
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "q2_k_s": "LLAMA_FTYPE_MOSTLY_Q2_K_S",
    "q3_k": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q3_k_s": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q3_k_l": "LLAMA_FTYPE_MOSTLY_Q3_K_L",
    "q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}
_FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
               "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
               "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
               "Q5_1": LlamaFileType.MOSTLY_Q5_1}
# block types whose output head is written Q8_0 instead (see _tensor_type)
_LOW_BIT_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1"}
# HF model_type -> GGUF architecture (llama.cpp's converter writes Mistral as llama)
HF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama.cpp's converter interleaves q/k rows per head only for these (its rotary kernel's layout)
_PERMUTED_ARCHS = {"llama"}
# keys the writer sets itself rather than copies from a GGUF input
_WRITER_KEYS = {"general.architecture", "general.file_type", "general.quantization_version"}
# below this many weights, llama.cpp quantises from an F32 copy (exact); above, from F16 (half the temp disk)
_F32_INTERMEDIATE_MAX = 1 << 28
# pre-tokenizer regexes of tokenizer.json -> llama.cpp's tokenizer.ggml.pre names
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_BY_REGEX = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


def valid_types() -> list[str]:
    return list(OUR_TYPES) + list(LLAMA_CPP_TYPES)


@dataclass(frozen=True)
class PlannedTensor:
    name: str                                   # GGUF name
    shape: tuple[int, ...]                      # torch order
    load: Callable[[], torch.Tensor]            # float weights in GGUF layout (llama q/k rows permuted)
    source_type: Optional[str] = None           # GGUF input: the type stored there ...
    raw: Optional[Callable[[], np.ndarray]] = None  # ... and its bytes, copied as they are when unchanged


@dataclass(frozen=True)
class Source:
    arch: str
    metadata: Callable[[GGUFWriter], None]      # adds every key but architecture / file type
    tensors: list[PlannedTensor]


# ------------------------------------------------------------------------------------------- entry point

def quantize_model(src: str, out: str, type_name: str, force: bool = False, progress: bool = True) -> None:
    """Write src (GGUF file or HF folder) to out as a GGUF of type_name (see valid_types())."""
    kind = type_name.lower()
    if kind not in OUR_TYPES and kind not in LLAMA_CPP_TYPES:
        raise ValueError(f"unknown quantisation type {type_name!r}; valid: {', '.join(valid_types())}")
    _check_output(out, force)
    source = open_source(src)
    part = f"{out}.part"
    try:
        if kind in OUR_TYPES:
            write_gguf(source, part, OUR_TYPES[kind], progress)
        else:
            _quantize_with_llama_cpp(source, part, LLAMA_CPP_TYPES[kind], progress)
        os.replace(part, out)
    finally:
        if os.path.exists(part):
            os.remove(part)


def _check_output(out: str, force: bool) -> None:
    if os.path.isdir(out):
        raise ValueError(f"output {out!r} is a directory; give a .gguf file path")
    if os.path.exists(out) and not force:
        raise ValueError(f"output {out!r} exists; pass --force to overwrite it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"output folder {parent!r} does not exist")


def open_source(path: str) -> Source:
    if not os.path.exists(path):
        raise ValueError(f"input {path!r} does not exist; pass a .gguf file or a Hugging Face folder "
                         f"(config.json + *.safetensors + tokenizer.json)")
    return _hf_source(Path(path)) if os.path.isdir(path) else _gguf_source(path)


# ------------------------------------------------------------------------------------------------ writing

def _tensor_type(t: PlannedTensor, target: str, head: str) -> str:
    """Norms and other 1-D tensors stay F32 (as llama.cpp's converter keeps them). The output head (head:
    its name) stays 8-bit under a 4/5-bit target, as llama.cpp's quantiser keeps it (Q6_K, or Q8_0 where rows
    are not 256-blocks): it decides every token, and a 4-bit head costs small models most of their accuracy.
    A matrix whose rows are not whole 32-blocks falls back to F16 (llama.cpp falls back per tensor too)."""
    if len(t.shape) < 2:
        return "F32"
    if t.name == head and target in _LOW_BIT_TYPES:
        target = "Q8_0"
    return target if can_quantize(target, t.shape[-1]) else "F16"


def _head_name(source: Source) -> str:
    """The output projection: output.weight, or the token embedding where the model ties the two."""
    names = {t.name for t in source.tensors}
    return "output.weight" if "output.weight" in names else "token_embd.weight"


def _tensor_bytes(t: PlannedTensor, type_name: str) -> np.ndarray:
    if t.raw is not None and t.source_type == type_name:
        return np.ascontiguousarray(t.raw())
    return quantize(t.load(), type_name)


def write_gguf(source: Source, path: str, target: str, progress: bool = True) -> None:
    """Write source as a GGUF at path, matrices in target (a quantize.supported_types() name)."""
    head = _head_name(source)
    plan = [(t, _tensor_type(t, target, head)) for t in source.tensors]
    writer = GGUFWriter(path, source.arch)
    source.metadata(writer)
    writer.add_file_type(int(_FILE_TYPES[target]))
    if target in BLOCK_TYPES:
        writer.add_quantization_version(GGML_QUANT_VERSION)
    for t, type_name in plan:
        n_bytes = math.prod(t.shape[:-1]) * row_bytes(type_name, t.shape[-1])
        byte_shape = (*t.shape[:-1], row_bytes(type_name, t.shape[-1]))
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), n_bytes,
                               raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for t, type_name in tqdm(plan, desc=f"writing {target}", unit="tensor", file=sys.stderr,
                                 disable=not progress):
            writer.write_tensor_data(_tensor_bytes(t, type_name))
    finally:
        writer.close()


# ------------------------------------------------------------------------------------------- GGUF input

def _gguf_source(path: str) -> Source:
    f = open_gguf(path)
    arch = f.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    if int(f.metadata.get("split.count", 1)) > 1:
        raise ValueError(f"{path!r} is one part of a split GGUF; merge it first (llama-gguf-split --merge)")
    kv = read_typed_metadata(path)
    tensors = [PlannedTensor(info.name, info.shape, partial(_dequantize, f, info), info.type_name,
                             partial(f.raw, info)) for info in f.tensors.values()]
    return Source(arch, partial(_copy_metadata, kv), tensors)


def _copy_metadata(kv: list[tuple[str, GGUFValueType, Any, Optional[GGUFValueType]]], writer: GGUFWriter) -> None:
    for key, vtype, value, sub_type in kv:
        if key in _WRITER_KEYS:
            continue
        if vtype == GGUFValueType.ARRAY and not value:
            continue  # gguf-py cannot write an empty array; a missing key reads the same to llama.cpp
        writer.add_key_value(key, value, vtype, sub_type)
        if key == "general.alignment":
            writer.data_alignment = int(value)


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


class _KVReader:
    """The metadata of a GGUF file with each value's GGUF type, so a copy keeps them (llama.cpp checks the
    types of the keys it reads). Strings stay bytes: a vocabulary need not be valid UTF-8."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.off = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.scalar("Q")
        s = bytes(self.buf[self.off:self.off + n])
        self.off += n
        return s

    def value(self, vtype: GGUFValueType) -> tuple[Any, Optional[GGUFValueType]]:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype]), None
        if vtype == GGUFValueType.STRING:
            return self.string(), None
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF metadata type {vtype}")
        sub, n = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if sub in _SCALAR_FORMATS:  # numbers in one go (token types, scores)
            arr = np.frombuffer(self.buf, dtype=np.dtype("<" + _SCALAR_FORMATS[sub]), count=n, offset=self.off)
            self.off += arr.nbytes
            return arr.tolist(), sub
        if sub == GGUFValueType.STRING:
            return [self.string() for _ in range(n)], sub
        raise ValueError("GGUF metadata arrays of arrays are not supported")


def read_typed_metadata(path: str) -> list[tuple[str, GGUFValueType, Any, Optional[GGUFValueType]]]:
    """[(key, type, value, array item type)] in file order."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        r = _KVReader(mm)
        r.off = 8  # magic, version (open_gguf has checked both)
        r.scalar("Q")  # tensor count
        out = []
        for _ in range(r.scalar("Q")):
            key = r.string().decode("utf-8")
            vtype = GGUFValueType(r.scalar("I"))
            value, sub = r.value(vtype)
            out.append((key, vtype, value, sub))
        return out


# ------------------------------------------------------------------------------------ Hugging Face input

def _read_hf_config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(folder)!r} has no config.json; is it a Hugging Face model folder?") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {folder / 'config.json'}: {e}") from e
    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"architecture {model_type!r} is not supported; supported: {sorted(HF_ARCHITECTURES)}")
    return cfg


def _hf_source(folder: Path) -> Source:
    cfg = _read_hf_config(folder)
    arch = HF_ARCHITECTURES[cfg["model_type"]]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    tensors = _hf_tensors(files, cfg, arch)
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{str(folder)!r} has no model.embed_tokens.weight")
    n_vocab = embd.shape[0]
    theta, scaling = _rope(cfg)
    if scaling is not None and _scaling_kind(scaling) == "llama3":
        if arch != "llama":
            raise ValueError(f"llama3 rope scaling on a {arch} model is not supported")
        freqs = _llama3_rope_factors(scaling, theta, _head_dim(cfg))
        tensors.insert(1, PlannedTensor("rope_freqs.weight", tuple(freqs.shape), lambda: freqs))
    tokenizer = _read_tokenizer(folder, n_vocab)  # a bad tokenizer fails now, before anything is written
    return Source(arch, partial(_hf_metadata, folder, cfg, arch, tokenizer), tensors)


def _hf_tensors(files: list[Path], cfg: dict[str, Any], arch: str) -> list[PlannedTensor]:
    from safetensors import safe_open
    tied = bool(cfg.get("tie_word_embeddings", False))
    heads = {"q_proj": cfg["num_attention_heads"],
             "k_proj": cfg.get("num_key_value_heads") or cfg["num_attention_heads"]}
    tensors = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                gguf_name = gguf_tensor_name(name)
                if gguf_name is None or (tied and gguf_name == "output.weight"):
                    continue
                proj = name.split(".")[-2]
                n_head = heads[proj] if arch in _PERMUTED_ARCHS and proj in heads else 0
                shape = tuple(f.get_slice(name).get_shape())
                tensors.append(PlannedTensor(gguf_name, shape, partial(_load_hf, file, name, n_head)))
    return sorted(tensors, key=_tensor_order)


def _load_hf(file: Path, name: str, n_head: int) -> torch.Tensor:
    from safetensors import safe_open
    with safe_open(str(file), framework="pt") as f:
        w = f.get_tensor(name)
    return permute_qk(w, n_head) if n_head else w


_HF_GLOBAL = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_HF_LAYER = {hf: g for g, hf in _LAYER_NAMES.items()}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_tensor_name(hf_name: str) -> Optional[str]:
    """The GGUF tensor name for a Hugging Face parameter (None: not a parameter llama.cpp keeps)."""
    if hf_name in _HF_GLOBAL:
        return _HF_GLOBAL[hf_name]
    if hf_name.endswith("rotary_emb.inv_freq"):  # a buffer some checkpoints carry, recomputed at load
        return None
    m = _HF_LAYER_RE.fullmatch(hf_name)
    if m is None or m.group(2) not in _HF_LAYER:
        raise ValueError(f"tensor {hf_name!r} has no GGUF equivalent we know of")
    return f"blk.{m.group(1)}.{_HF_LAYER[m.group(2)]}.{m.group(3)}"


def _tensor_order(t: PlannedTensor) -> tuple[int, int, str]:
    """llama.cpp's converter order: embeddings, the blocks in turn, the final norm, the output head."""
    if m := re.match(r"blk\.(\d+)\.", t.name):
        return 1, int(m.group(1)), t.name
    return {"token_embd.weight": 0, "output_norm.weight": 2, "output.weight": 3}.get(t.name, 2), 0, t.name


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's permute(): per head, interleave the two rotary halves of the rows
    (its rope kernel pairs neighbours, HF's pairs halves). Inverse of gguf.unpermute_qk."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _rope(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope theta, rope scaling or None), from transformers 4 (rope_theta / rope_scaling) or 5
    (rope_parameters) configs."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or params
    return theta, (scaling if _scaling_kind(scaling) not in (None, "default") else None)


def _scaling_kind(scaling: dict[str, Any]) -> Optional[str]:
    return scaling.get("rope_type") or scaling.get("type")


def _llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> torch.Tensor:
    """convert_hf_to_gguf's rope_freqs for Llama 3: a per-dimension divisor of the rotary frequencies, the plain
    frequencies over the scaled ones the model computes (layers/rotary.py)."""
    from tokenmill.executor.layers.rotary import rope_inv_freq
    full = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, **scaling,
            "rope_type": "llama3"}
    plain, _ = rope_inv_freq(head_dim, theta, None, 0)
    scaled, _ = rope_inv_freq(head_dim, theta, full, 0)
    return plain / scaled


def _hf_metadata(folder: Path, cfg: dict[str, Any], arch: str, tokenizer: _Tokenizer, w: GGUFWriter) -> None:
    """The keys llama.cpp's convert_hf_to_gguf writes for these architectures, and the tokenizer."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = _head_dim(cfg)
    w.add_type("model")
    w.add_name(folder.resolve().name)
    w.add_vocab_size(len(tokenizer.tokens))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta, scaling = _rope(cfg)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if scaling is not None:
        _add_rope_scaling(w, scaling)
    if cfg["model_type"] == "mistral" and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    _add_tokenizer(w, tokenizer)


def _add_rope_scaling(w: GGUFWriter, scaling: dict[str, Any]) -> None:
    kind = _scaling_kind(scaling)
    if kind == "llama3":
        return  # carried by the rope_freqs tensor
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope scaling {kind!r} is not supported (linear, yarn and llama3 are)")
    w.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "yarn" and "original_max_position_embeddings" in scaling:
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))


# ------------------------------------------------------------------------------------------- tokenizer

@dataclass(frozen=True)
class _Tokenizer:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer."""
    tokens: list[str]         # by id, padded to the embedding's rows
    types: list[int]          # gguf TokenType
    pre: Optional[str]        # llama.cpp's pre-tokenizer name, where we recognise it
    special: SpecialVocab     # merges, special ids, add-bos/eos flags, chat template


def _read_tokenizer(folder: Path, n_vocab: int) -> _Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} has no tokenizer.json; llama.cpp needs the tokenizer in the GGUF")
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    byte_level = (tj.get("decoder") or {}).get("type") == "ByteLevel"
    if model.get("type") != "BPE" or model.get("byte_fallback") or not byte_level:
        raise ValueError("only byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM) are supported; "
                         f"{path} is not one (SentencePiece-style tokenizers such as Llama 2's are not)")
    tokens, types = _vocab(tj, n_vocab)
    special = SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ValueError(f"{path} has no BPE merges")
    return _Tokenizer(tokens, types, _pre_tokenizer(tj), special)


def _add_tokenizer(w: GGUFWriter, tokenizer: _Tokenizer) -> None:
    w.add_tokenizer_model("gpt2")
    if tokenizer.pre:
        w.add_tokenizer_pre(tokenizer.pre)  # without it llama.cpp splits text with its default regex
    w.add_token_list(tokenizer.tokens)
    w.add_token_types(tokenizer.types)
    tokenizer.special.add_to_gguf(w, quiet=True)


def _vocab(tj: dict[str, Any], n_vocab: int) -> tuple[list[str], list[int]]:
    """Token strings and types by id, padded to the embedding's rows as convert_hf_to_gguf pads."""
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(TokenType.USER_DEFINED)] * n_vocab
    entries = [(i, tok, TokenType.NORMAL) for tok, i in tj["model"]["vocab"].items()]
    entries += [(a["id"], a["content"], TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED)
                for a in tj.get("added_tokens") or []]
    for i, tok, kind in entries:
        if not 0 <= i < n_vocab:
            raise ValueError(f"tokenizer token {tok!r} has id {i}, but the embedding has {n_vocab} rows")
        tokens[i], types[i] = tok, int(kind)
    return tokens, types


def _pre_tokenizer(tj: dict[str, Any]) -> Optional[str]:
    """llama.cpp's name for the tokenizer's pre-tokenizer, for the ones we recognise (None otherwise)."""
    pre = tj.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre])
    kinds = [p.get("type") for p in parts]
    for p in parts:
        if p.get("type") == "Split" and (regex := (p.get("pattern") or {}).get("Regex")) in _PRE_BY_REGEX:
            return _PRE_BY_REGEX[regex]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    return None


# ------------------------------------------------------------------------------------- llama.cpp K-quants

def peer_llama_cpp_python() -> Optional[str]:
    """The peer venv's python with llama-cpp-python, if installed:
    ${PEERS_DIR:-${TMPDIR:-/tmp}/tokenmill-peers}/llamacpp/bin/python."""
    peers = os.environ.get("PEERS_DIR") or os.path.join(os.environ.get("TMPDIR") or "/tmp", "tokenmill-peers")
    python = os.path.join(peers, "llamacpp", "bin", "python")
    return python if os.path.isfile(python) and os.access(python, os.X_OK) else None


def _import_llama_cpp() -> Any:
    """llama_cpp in this interpreter, or None (not installed, or its shared library does not load)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        import llama_cpp
    except (ImportError, OSError):
        return None
    return llama_cpp


def _intermediate_type(source: Source) -> str:
    n = sum(math.prod(t.shape) for t in source.tensors)
    return "F32" if n <= _F32_INTERMEDIATE_MAX else "F16"


def _quantize_with_llama_cpp(source: Source, out: str, ftype: str, progress: bool) -> None:
    module, peer = _import_llama_cpp(), peer_llama_cpp_python()
    if module is None and peer is None:
        raise ValueError(f"K-quants are made by llama.cpp's quantiser, which needs llama-cpp-python "
                         f"(`pip install llama-cpp-python`); tokenmill writes {', '.join(OUR_TYPES)} itself")
    float_type = _intermediate_type(source)
    tmp = f"{out}.{float_type.lower()}.gguf"
    try:
        write_gguf(source, tmp, float_type, progress)
        if progress:
            print(f"quantising with llama.cpp ({ftype})", file=sys.stderr)
        if module is not None:
            rc = _run_llama_cpp_quantize(module, tmp, out, ftype)
            detail = ""
        else:
            proc = subprocess.run([peer, "-c", _QUANTIZE_SCRIPT, tmp, out, ftype], capture_output=True, text=True)
            rc, detail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        if rc != 0:
            raise ValueError(f"llama.cpp's quantiser failed (exit {rc}) for {ftype}: {detail}")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _run_llama_cpp_quantize(llama_cpp: Any, src: str, dst: str, ftype: str) -> int:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


# the same call, run by the peer venv's python: argv = src, dst, ftype name
_QUANTIZE_SCRIPT = """
import ctypes, sys
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
sys.exit(int(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))))
"""
