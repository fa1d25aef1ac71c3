"""vLLM's LoRARequest: which adapter a request runs with."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what the server lists and a request's `model` names; lora_int_id: a positive id, unique per
    adapter in the engine; lora_path: the PEFT folder (adapter_config.json and adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer (0 means the base model), got "
                             f"{self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
