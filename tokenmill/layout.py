"""Which layers of a decoder slide or hold experts, as transformers lays them out from an HF config, and how the
layers share the KV cache's blocks. Plain rules on config values, shared by the model's config and kv-calc (which
reads configs without torch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional


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


@dataclass(frozen=True)
class KVGroups:
    """How a model's layers share the KV cache's blocks. Layers that attend alike form groups of group_size layers;
    a block ("page") holds a block of tokens for one group's layers, and each group has its own block table per
    request, so a sliding-window group holds only its window's blocks. Layer i keeps its K/V in cache tensor
    layer_slot[i], at the blocks of group layer_group[i]'s table; tensor j serves layer j of every group."""
    windows: tuple[Optional[int], ...]       # each group's sliding window (None: full attention)
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_size: int

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1


def kv_groups(layer_windows: tuple[Optional[int], ...], num_layers: int, sliding_window: Optional[int]) -> KVGroups:
    """One group of every layer unless the layers' windows differ (Gemma: global and local layers); then the
    global layers are one group and the local ones groups of as many (the last one may be short), vLLM's layout;
    without global layers, groups of the fewest layers of one window."""
    windows = tuple(layer_windows) or (sliding_window,) * num_layers
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1:
        return KVGroups((kinds[0],), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    full = sum(1 for w in windows if w is None)
    size = full or min(sum(1 for w in windows if w == k) for k in kinds)
    group, slot, group_windows = [0] * num_layers, [0] * num_layers, []
    for k in kinds:
        layers = [i for i, w in enumerate(windows) if w == k]
        for c in range(0, len(layers), size):
            for j, i in enumerate(layers[c:c + size]):
                group[i], slot[i] = len(group_windows), j
            group_windows.append(k)
    return KVGroups(tuple(group_windows), tuple(group), tuple(slot), size)
