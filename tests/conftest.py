"""Shared fixtures: tiny random models built with transformers (the oracle) and saved as HF folders."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from tests.tiny_models import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with GQA, saved to disk; returns (path, transformers model)."""
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def tiny_mistral_sw(tmp_path_factory):
    return build_tiny("mistral_sw", tmp_path_factory.mktemp("mistral_sw"))
