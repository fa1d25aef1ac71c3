"""Bad input raises ValueError with a message that says what to change; the engine keeps serving."""
import json

import pytest
import torch

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.01, max_model_len=64)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unreadable_model_folder(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"hello")
    with pytest.raises(ValueError, match="gguf"):
        LLM(str(f))


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"not really a gguf file")
    with pytest.raises(ValueError):
        LLM(str(f))


def test_unsupported_architecture(tiny_llama, tmp_path):
    cfg = json.load(open(f"{tiny_llama[0]}/config.json"))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_kv_budget_too_small(tiny_llama):
    with pytest.raises(ValueError, match="cannot hold even one request.*kv_cache_memory_gb"):
        LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=1e-6, max_model_len=512)


def test_unknown_kv_cache_dtype(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float32, int8, int4, fp8, "
                                         "fp8_e4m3, fp8_e5m2; got 'q8_0'"):
        LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.01, kv_cache_dtype="q8_0")


def test_kv_cache_dtype_a_backend_cannot_serve(tiny_llama, monkeypatch):
    """A cache dtype the chosen attention backend cannot store is refused at start, naming the backend and what it
    does store, never served from a float cache instead. The CPU kernels say what they store by the format
    constants of the header they were built from; one built before fp8 lacks those (a copy of the library with
    them taken out stands for it). The engine asks the backend it picked."""
    import copy
    from tokenmill.executor.attention import get_backend
    from tokenmill.executor.attention.backend import TorchReferenceBackend
    from tokenmill.executor.kernels import load
    lib = load("generic")
    assert get_backend("cpu", torch.device("cpu"), 4, 2, 32, lib).kv_cache_dtype_error("fp8_e5m2", "cpu") is None
    old = copy.copy(lib)
    old.limits = {k: v for k, v in lib.limits.items() if "FP8" not in k}
    why = get_backend("cpu", torch.device("cpu"), 4, 2, 32, old).kv_cache_dtype_error("fp8_e5m2", "cpu")
    assert why == "the CPU kernels (generic) store K/V only as float32, bfloat16, int8, int4"
    monkeypatch.setattr(TorchReferenceBackend, "kv_cache_dtype_error", lambda self, dtype, device: "no fp8 here")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' cannot be served by the 'torch' attention backend: "
                                         "no fp8 here; choose another kv_cache_dtype"):
        LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.01, kv_cache_dtype="fp8", attention_backend="torch")


def test_max_model_len_over_model(tiny_llama):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.01, max_model_len=10_000)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": list(range(64))}, "max_model_len"),
    ({"prompt_token_ids": []}, "empty"),
    ("", "empty"),
    ({"prompt_token_ids": [1, 2, 100000]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ("some text", "no tokenizer"),
    (3.5, "must be a string"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    # nothing was left behind and the engine still works
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(n=0), "n"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_wrong_number_of_params(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams()] * 3, use_tqdm=False)


def test_int4_kv_cache_needs_head_dim_in_groups_of_32(tiny_llama):
    """tiny_llama's head_dim is 8: int4 cannot group it, and says what to use instead."""
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' quantises groups of 32 along head_dim, and this "
                                         "model's head_dim is 8; use kv_cache_dtype='int8'"):
        LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.01, kv_cache_dtype="int4")


def test_kv_cache_out_of_memory_names_the_budget(tiny_llama):
    """A KV budget the device cannot allocate (here more than the address space) is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"out of memory on cpu allocating the KV cache: [\d,]+ blocks of 16 tokens, "
                                         r"[\d,.]+ GiB \(kv_cache_memory_gb=1000000.0\); lower kv_cache_memory_gb"):
        LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=1e6, attention_backend="torch")


def test_gpu_without_bfloat16_runs_float16(caplog):
    from tokenmill.config import gpu_half_dtype
    assert gpu_half_dtype(True) == torch.bfloat16
    with caplog.at_level("WARNING", logger="tokenmill"):
        assert gpu_half_dtype(False) == torch.float16
    assert "this GPU has no bfloat16 (it needs compute capability 8.0, Ampere); the model runs in float16" \
        in caplog.text
