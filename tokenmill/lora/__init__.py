"""LoRA adapters over one base model (vLLM's names): the request that names one, and the PEFT folder read, checked
against the model and kept as plain tensors. The runner's side (slots and the batched apply) is executor/lora.py."""
from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
