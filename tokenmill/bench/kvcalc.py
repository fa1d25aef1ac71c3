"""KV-cache arithmetic: 2 (K and V) × layers × kv_heads × head_dim × bytes per token.

Context is never free: every token of every running sequence holds this much memory until the sequence
ends. GQA/MQA shrink it by sharing K/V heads; a sliding-window layer stops growing at its window.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from .workload import read_json

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
GB = 1e9  # decimal, as memory is sold; GiB figures are printed alongside


def dtype_bytes(kv_dtype: str) -> int:
    d = _DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    if d not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[d]


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[Optional[int], ...]  # per layer: None = full attention, else its sliding window

    @property
    def attention(self) -> str:
        return "MHA" if self.num_kv_heads == self.num_heads else "MQA" if self.num_kv_heads == 1 else "GQA"

    def bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """Full-attention cost of one more token (before any window caps it)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(kv_dtype)

    def bytes_per_seq(self, context: int, kv_dtype: str = "bf16") -> int:
        """One sequence of `context` tokens: each layer keeps min(context, its window) tokens."""
        kept = sum(context if w is None else min(context, w) for w in self.layer_windows)
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(kv_dtype) * kept


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def kv_shape(cfg: Any) -> KVShape:
    """From an HF-style config (dict or object); handles MHA/GQA/MQA defaults and sliding-window layouts."""
    cfg = _get(cfg, "text_config", default=cfg)  # multimodal wrappers keep the LM under text_config
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        raise ValueError("config needs num_hidden_layers and num_attention_heads")
    kv = _get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv",
              default=1 if _get(cfg, "multi_query") else heads)
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        hidden = _get(cfg, "hidden_size", "n_embd")
        if hidden is None:
            raise ValueError("config needs head_dim or hidden_size")
        head_dim = hidden // heads
    return KVShape(int(layers), int(heads), int(kv), int(head_dim), _layer_windows(cfg, int(layers)))


def _layer_windows(cfg: Any, layers: int) -> tuple[Optional[int], ...]:
    sw = _get(cfg, "sliding_window")
    if not sw or _get(cfg, "use_sliding_window") is False:  # Qwen2 ships a window it does not use
        return (None,) * layers
    types = _get(cfg, "layer_types")
    if types and len(types) == layers:  # transformers >= 4.53 spells the layout out
        return tuple(sw if t == "sliding_attention" else None for t in types)
    if _get(cfg, "max_window_layers") is not None:  # older Qwen2: layers from this index on slide
        mwl = _get(cfg, "max_window_layers")
        return tuple(sw if i >= mwl else None for i in range(layers))
    pattern = _get(cfg, "sliding_window_pattern")
    if pattern:  # Gemma 3: every pattern-th layer is global
        return tuple(None if (i + 1) % pattern == 0 else sw for i in range(layers))
    if _get(cfg, "model_type") == "gemma2":  # Gemma 2: even layers slide, odd layers are global
        return tuple(sw if i % 2 == 0 else None for i in range(layers))
    return (sw,) * layers  # Mistral-7B-v0.1: every layer slides


def kv_calc(cfg: Any, context: int = 4096, kv_dtype: str = "bf16",
            memory_gb: Optional[float] = None) -> dict[str, Any]:
    """Bytes per token and per sequence, and how many sequences of `context` fit in `memory_gb` (1e9 B)."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    s = kv_shape(cfg)
    per_seq = s.bytes_per_seq(context, kv_dtype)
    out: dict[str, Any] = {
        **asdict(s), "layer_windows": list(s.layer_windows), "attention": s.attention,
        "kv_dtype": _DTYPE_ALIASES.get(kv_dtype, kv_dtype), "dtype_bytes": dtype_bytes(kv_dtype),
        "context": context, "bytes_per_token": s.bytes_per_token(kv_dtype),
        "bytes_per_seq": per_seq, "avg_bytes_per_token": per_seq / context,
    }
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {memory_gb}")
        mem = memory_gb * GB
        out.update(memory_gb=memory_gb, max_seqs=int(mem // per_seq),
                   max_tokens_full_attention=int(mem // out["bytes_per_token"]))
    return out


def _human(n: float) -> str:
    return f"{n / GB:.3f} GB ({n / 2**30:.3f} GiB)" if n >= 1e8 else f"{n / 1e6:.2f} MB ({n / 2**20:.2f} MiB)"


def format_report(r: dict[str, Any], label: str = "") -> str:
    windows = {w for w in r["layer_windows"] if w is not None}
    slide = (f", sliding window {sorted(windows)} on {sum(w is not None for w in r['layer_windows'])} of "
             f"{r['num_layers']} layers" if windows else "")
    lines = [
        f"model: {label}" if label else "",
        f"shape: {r['num_layers']} layers, {r['num_heads']} query heads, {r['num_kv_heads']} KV heads "
        f"({r['attention']}), head_dim {r['head_dim']}{slide}",
        f"KV dtype: {r['kv_dtype']} ({r['dtype_bytes']} B)",
        f"per token: {r['bytes_per_token']:,} B = 2 x {r['num_layers']} layers x {r['num_kv_heads']} kv_heads"
        f" x {r['head_dim']} head_dim x {r['dtype_bytes']} B",
        f"per sequence of {r['context']:,} tokens: {r['bytes_per_seq']:,} B = {_human(r['bytes_per_seq'])}",
    ]
    if windows:
        lines.append(f"  (windows cap it: {r['avg_bytes_per_token']:,.0f} B per token on average at this context)")
    if "max_seqs" in r:
        lines.append(f"fits in {r['memory_gb']:g} GB: {r['max_seqs']:,} sequences of {r['context']:,} tokens "
                     f"({r['max_tokens_full_attention']:,} tokens at full attention), weights and activations not counted")
    return "\n".join(x for x in lines if x)


# ---- where configs come from ----


def load_config(model: Optional[str] = None, config: Optional[str] = None) -> tuple[dict[str, Any], str]:
    """(HF-style config dict, label) from a config.json, an HF folder, a .gguf file, or the bundled model."""
    if config is not None:
        return read_json(Path(config)), str(config)
    from tokenmill.executor.loader import default_model_path
    path = Path(model) if model else Path(default_model_path())
    if path.is_dir():
        return read_json(path / "config.json"), str(path)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_config(path), str(path)
    if path.suffix == ".json" and path.is_file():
        return read_json(path), str(path)
    raise ValueError(f"{path}: not a Hugging Face folder, a config.json or a .gguf file")


def gguf_config(path: Path) -> dict[str, Any]:
    """The HF-style config of a GGUF file, from the engine's reader (metadata only; tensors stay unread)."""
    from tokenmill.executor.loader.gguf import read_gguf
    return dict(read_gguf(str(path)).config)
