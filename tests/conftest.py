"""Shared fixtures: tiny random models built with transformers (the oracle) and saved as HF folders."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: OpenMP threads that wait sleep instead of spinning on the other worker's core
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest
import torch

if not torch.cuda.is_available():     # the Triton kernels run on CPU tensors under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with GQA, saved to disk; returns (path, transformers model)."""
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def tiny_mistral_sw(tmp_path_factory):
    return build_tiny("mistral_sw", tmp_path_factory.mktemp("mistral_sw"))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The bundled SmolLM2 tokenizer (from its GGUF), loaded once."""
    from tokenmill.executor.loader import default_model_path
    from tokenmill.tokenizer import load_tokenizer
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """The bundled SmolLM2's GGUF as a float32 Hugging Face folder (tokenizer included), written once."""
    from tokenmill.executor.loader import default_model_path
    from tokenmill.executor.loader.convert import gguf_to_hf
    out = tmp_path_factory.mktemp("smollm2_hf")
    gguf_to_hf(default_model_path(), str(out), dtype=torch.float32)
    return out


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama with SmolLM2's real tokenizer and chat template: text in, text out, fast."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny_text")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=None, bos_token_id=None, tie_word_embeddings=True, initializer_range=0.1)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path), model
