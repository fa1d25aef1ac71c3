"""On the path of a peer's Python under `run.py --emulate-avx2` (every process it starts imports this): torch
answers that the CPU has no AVX-512, so vLLM loads its AVX2 kernels (vllm._C_AVX2) as on an AVX2-only machine."""
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
