"""Write a GGUF checkpoint out as a Hugging Face folder, so peers (transformers, vLLM) can run
the very same (dequantized) weights that tokenmill runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def gguf_to_hf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files
    (the tokenizer only when the GGUF carries one, as every llama.cpp-made GGUF does)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    from tokenmill.executor.loader.gguf import open_gguf, read_gguf
    from tokenmill.tokenizer import load_tokenizer

    ckpt = read_gguf(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    cfg = dict(ckpt.config)
    cfg.pop("rope_parameters", None)  # transformers rebuilds it from rope_theta / rope_scaling
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.dtype = dtype
    config.save_pretrained(out)
    _portable_config(out / "config.json", cfg, dtype)
    GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"]).save_pretrained(out)

    # One copy in the target dtype; each float32 tensor is dropped as soon as it is cast.
    tensors = {name: w.to(dtype).contiguous() for name, w in ckpt.tensors()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    if "tokenizer.ggml.model" not in open_gguf(gguf_path).metadata:
        return
    tok = load_tokenizer(gguf_path)
    tok.model_max_length = cfg["max_position_embeddings"]
    tok.save_pretrained(out)
    _portable_tokenizer_config(out / "tokenizer_config.json", tok.chat_template)


def _portable_config(path: Path, cfg: dict[str, Any], dtype: torch.dtype) -> None:
    """transformers 5 writes only rope_parameters and dtype; older transformers (and so older
    vLLM) read rope_theta / rope_scaling / torch_dtype and would silently fall back to
    theta=10000 and float32 without them."""
    data = json.loads(path.read_text())
    data["torch_dtype"] = str(dtype).removeprefix("torch.")
    data["rope_theta"] = cfg["rope_theta"]
    if "rope_scaling" in cfg:
        data["rope_scaling"] = cfg["rope_scaling"]
    _write_json(path, data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _portable_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """transformers 5 writes a v5-only class name, keeps the template only in
    chat_template.jinja and records load-time flags; make the file readable by older
    transformers (and so older vLLM) too."""
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    if chat_template:
        data["chat_template"] = chat_template
    _write_json(path, data)
