"""A PEFT LoRA folder read and checked against the base model: each adapted projection's A [r, in] and B [out, r],
with PEFT's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded into B. Everything that does not fit is
refused here, at load, naming what."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.config import ModelConfig
from tokenmill.lora.request import LoRARequest

# the projections an adapter may adapt: where each sits in a decoder layer
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's tensor names: base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.adapter].weight
_NAME = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                   r"(?:\.[\w-]+)?\.weight$")
# adapter_config.json settings that change what an adapter computes beyond plain LoRA: each refused when set
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (full copies of modules)",
                "layer_replication": "layer_replication", "alora_invocation_tokens": "activated LoRA",
                "target_parameters": "target_parameters (LoRA on raw parameters)",
                "trainable_token_indices": "trainable_token_indices", "lora_bias": "lora_bias",
                "fan_in_fan_out": "fan_in_fan_out"}


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter as the runner loads it into a slot: (layer, module) -> (A [r, in], B [out, r] scaled), float32."""
    request: LoRARequest
    rank: int                                               # the largest of its modules' ranks
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def cache_key(self) -> tuple:
        """What keeps its KV apart in the prefix cache: two adapters never share blocks, nor does one id that was
        unloaded and loaded again from another folder."""
        return ("lora", self.request.lora_int_id, os.path.realpath(self.request.lora_path))


def module_shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable projection's (in, out) in a layer of this model."""
    q, kv, h, inter = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim, mc.hidden_size, \
        mc.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def lora_model_error(mc: ModelConfig) -> Optional[str]:
    """Why adapters cannot run on this model at all, or None."""
    if mc.mla:
        return "its latent attention (DeepSeek's MLA) has none of the q/k/v/o projections adapters are made for"
    return None


def _pattern_value(pattern: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module's full name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory; give a PEFT adapter folder (with "
                         f"adapter_config.json and adapter_model.safetensors)")
    if not os.path.exists(cfg_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json; give a folder that peft's "
                         f"save_pretrained wrote")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path!r} is a {cfg.get('peft_type')} adapter; only LoRA adapters are served")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"adapter {path!r} uses {what} ({key}={cfg[key]!r}), which is not served; use a plain "
                             f"LoRA adapter")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r} trains biases (bias={cfg['bias']!r}), which is not served; use "
                         f"bias='none'")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return load_file(st)
    if os.path.exists(os.path.join(path, "adapter_model.bin")):
        raise ValueError(f"adapter {path!r} stores its weights as adapter_model.bin (a pickle); save it with "
                         f"safetensors (peft's default)")
    raise ValueError(f"adapter {path!r} has no adapter_model.safetensors")


def load_adapter(request: LoRARequest, mc: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The request's folder read and checked against the base model (its layers, its projections' shapes) and
    against max_lora_rank: a ValueError names what does not fit."""
    why = lora_model_error(mc)
    if why is not None:
        raise ValueError(f"LoRA adapters cannot run on this model: {why}")
    path = request.lora_path
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    shapes = module_shapes(mc)
    base = cfg.get("base_model_name_or_path")
    made_for = f" (made for {base!r})" if base else ""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if m is None:
            what = name.rsplit(".weight", 1)[0]
            raise ValueError(f"adapter {path!r} adapts {what!r}; adapters may adapt only the decoder layers' "
                             f"{', '.join(MODULES)}")
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in MODULES or (block == "self_attn") != (module in ATTENTION_MODULES):
            raise ValueError(f"adapter {path!r} adapts {block}.{module} of layer {layer}; adapters may adapt only "
                             f"{', '.join(MODULES)}")
        if layer >= mc.num_hidden_layers:
            raise ValueError(f"adapter {path!r} adapts layer {layer} but the base model has {mc.num_hidden_layers} "
                             f"layers: it was made for another model{made_for}")
        if block == "mlp" and layer in mc.moe_layers:
            raise ValueError(f"adapter {path!r} adapts the MLP of layer {layer}, a Mixture-of-Experts layer; adapters "
                             f"on experts are not served")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    weights, top = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: layer {layer}'s {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise ValueError(f"adapter {path!r}: layer {layer}'s {module} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)} but this model's {module} maps {fan_in} to {fan_out} features: it "
                             f"was made for another model{made_for}")
        if r > max_lora_rank:
            raise ValueError(f"adapter {path!r} has rank {r} (layer {layer}'s {module}) but max_lora_rank is "
                             f"{max_lora_rank}; raise max_lora_rank (--max-lora-rank) to at least {r}")
        full = f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
        alpha = _pattern_value(alpha_pattern, full, alpha_default)
        r_cfg = _pattern_value(rank_pattern, full, r_default)
        if r_cfg != r:
            raise ValueError(f"adapter {path!r}: layer {layer}'s {module} has rank {r} but its config says {r_cfg}")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[(layer, module)] = (a.float().contiguous(), (b.float() * scale).contiguous())
        top = max(top, r)
    return LoRAAdapter(request, top, weights)
