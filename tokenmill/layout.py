"""Which layers of a decoder slide or hold experts, as transformers lays them out from an HF config. Plain rules on
config values, shared by the model's config and kv-calc (which reads configs without torch)."""
from __future__ import annotations

from typing import Any, Iterable


def _get(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def sliding_layers(cfg: Any, layers: int) -> tuple[bool, ...]:
    """Whether each layer attends through the sliding window: layer_types where the config spells the layout out
    (transformers >= 4.53), else older Qwen2's max_window_layers (the layers from it on), Gemma 3's
    sliding_window_pattern (every pattern-th layer global), Gemma 2's even layers; else every layer."""
    types = _get(cfg, "layer_types")
    if types and len(types) == layers:
        return tuple(t == "sliding_attention" for t in types)
    if _get(cfg, "max_window_layers") is not None:
        return tuple(i >= _get(cfg, "max_window_layers") for i in range(layers))
    model_type = _get(cfg, "model_type") or ""
    pattern = _get(cfg, "sliding_window_pattern") or _get(cfg, "_sliding_window_pattern") \
        or (6 if model_type.startswith("gemma3") else None)
    if pattern:
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    if model_type == "gemma2":
        return tuple(i % 2 == 0 for i in range(layers))
    return (True,) * layers


def sparse_layers(layers: int, decoder_sparse_step: int = 1, mlp_only_layers: Iterable[int] = ()) -> tuple[int, ...]:
    """The Mixture-of-Experts layers of a Qwen-MoE model: every decoder_sparse_step-th but mlp_only_layers."""
    step, dense = decoder_sparse_step or 1, set(mlp_only_layers or ())
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
