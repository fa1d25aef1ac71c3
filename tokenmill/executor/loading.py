"""Model loading and the KV cache's size: a checkpoint opened (and quantised at load when asked), its model built on
the meta device and filled once, and how many blocks the memory left over holds."""
from __future__ import annotations

from typing import Any, Optional

import torch

from tokenmill.config import EngineConfig, LoRAConfig, ModelConfig
from tokenmill.executor.loader import Checkpoint, open_checkpoint, quantized_at_load
from tokenmill.executor.lora import attach_lora
from tokenmill.executor.models.decoder import DecoderForCausalLM
from tokenmill.executor.ops import make_ops


def load_model(path: str, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
               ckpt: Checkpoint, quantized_kernels: bool = True, cpu_kernels: str = "auto",
               int8_activations: bool = True, tp: Optional[Any] = None,
               lora: Optional[LoRAConfig] = None) -> DecoderForCausalLM:
    """tp: the tensor-parallel group of a rank's share of a split model (mc and ckpt are that share's). lora: its
    projections take adapters (executor/lora.py)."""
    ops = make_ops(device, dtype, cpu_kernels, int8_activations)     # the execution plan: what serves each op, chosen once
    ops.tp = tp
    with torch.device("meta"):
        model = DecoderForCausalLM(mc, max_len, ops)
    model.make_rotary(max_len, device)
    # quantised matrices stay quantised, in the form the plan adopts (ops.adopt); quantized_kernels=False
    # dequantises them
    keep_blocks = quantized_kernels
    model.load_weights(ckpt.tensors(keep_blocks=keep_blocks), dtype, device)
    model.finalize()
    model.lora_step = None if lora is None else attach_lora(model, lora, dtype, device)
    ops.prepare(model)
    ckpt.release()
    return model.eval()


def open_model(path: str, quantization: Optional[str], device: torch.device) -> tuple[Checkpoint, ModelConfig]:
    """A checkpoint (quantised at load when asked) and its config."""
    ckpt = open_checkpoint(path)
    if quantization == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"quantization='fp8' multiplies in FP8, which needs compute capability 8.9 or later (Ada, "
                         f"Hopper); this GPU has {major}.{minor}: use 'int8' or 'int4'")
    if quantization is not None:
        ckpt = quantized_at_load(ckpt, quantization, device)
    return ckpt, ModelConfig.from_hf_dict(ckpt.config)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2 ** 30


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def utilization_budget(device: torch.device, utilization: float) -> tuple[int, int, int]:
    """vLLM's gpu_memory_utilization rule: (bytes a share of the whole memory leaves after what is in use, the
    whole, what is in use)."""
    total = total_memory_bytes(device)
    in_use = total - available_memory_bytes(device)
    return max(int(total * utilization) - in_use, 0), total, in_use


def default_kv_budget(device: torch.device, share: float) -> int:
    """The KV cache's bytes when no size is given: a share of the free memory (on CPU at most 4 GiB: plenty for
    CPU batch sizes, and it keeps start-up fast)."""
    budget = int(available_memory_bytes(device) * share)
    return min(budget, 4 * 2 ** 30) if device.type == "cpu" else budget


def size_kv_cache(config: EngineConfig, per_block: int, min_blocks: int, reserved: int = 0, ranks: int = 1) -> int:
    """The KV cache's blocks of per_block bytes: kv_cache_memory_gb's, else a share of the free memory less what the
    runner reserved for itself (a GPU's graphs), split between the ranks on this machine. min_blocks: one request of
    max_model_len; fewer is a ValueError that says what to change."""
    cc = config.cache_config
    if cc.kv_cache_memory_gb is not None:
        budget = int(cc.kv_cache_memory_gb * 2 ** 30)
        origin = f"kv_cache_memory_gb={cc.kv_cache_memory_gb}"
    elif cc.gpu_memory_utilization is not None:      # vLLM's rule: a share of the whole, less what is in use
        budget, total, in_use = utilization_budget(config.device, cc.gpu_memory_utilization)
        budget = max(budget - reserved, 0) // ranks
        origin = (f"gpu_memory_utilization={cc.gpu_memory_utilization}: {cc.gpu_memory_utilization:.0%} of "
                  f"{total / 2 ** 30:.1f} GiB less {in_use / 2 ** 30:.1f} GiB in use")
    else:
        share = 0.8 if config.device.type == "cuda" else cc.memory_utilization
        budget = max(default_kv_budget(config.device, share) - reserved, 0) // ranks
        origin = f"{share:.0%} of free memory" + (f" less {reserved / 2 ** 30:.2f} GiB for the runner" if reserved
                                                    else "")
    num_blocks = budget // per_block
    if num_blocks < min_blocks:
        raise ValueError(
            f"the KV cache ({origin}: {num_blocks} blocks of {cc.block_size} tokens) cannot hold even one request of "
            f"max_model_len={config.scheduler_config.max_model_len} tokens ({min_blocks} blocks, "
            f"{min_blocks * per_block / 2 ** 30:.3f} GiB); raise kv_cache_memory_gb (or gpu_memory_utilization) or "
            f"lower max_model_len")
    return int(num_blocks)
